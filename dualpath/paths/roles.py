"""Node roles and read sides, in our words and on the wire.

A node daemon serves one role: ``prefill`` (PEs: a group of prefill engines that fetch
from the scheduler), ``decode`` (DEs, likewise), or ``both`` (a single vLLM instance,
``kv_both``, that prefills and decodes itself: no scheduler, the node only loads and
persists its KV).
"""

from __future__ import annotations

from dualpath.v1 import scheduler_pb2

PREFILL, DECODE, BOTH = "prefill", "decode", "both"
ROLES = (PREFILL, DECODE, BOTH)
ROLE_PB = {PREFILL: scheduler_pb2.ENGINE_ROLE_PREFILL, DECODE: scheduler_pb2.ENGINE_ROLE_DECODE}

RS_NONE = scheduler_pb2.READ_SIDE_NONE
RS_PREFILL = scheduler_pb2.READ_SIDE_PREFILL
RS_DECODE = scheduler_pb2.READ_SIDE_DECODE
RS_SPLIT = scheduler_pb2.READ_SIDE_SPLIT
