"""Who does what for a request, in our words: node roles, read sides, completion stages.

A node daemon serves one role: ``prefill`` (PEs: a group of prefill engines that fetch
from the scheduler), ``decode`` (DEs, likewise), or ``both`` (a single vLLM instance,
``kv_both``, that prefills and decodes itself: no scheduler, the node only loads and
persists its KV).

Domain code takes these enums; protobuf stays at the gRPC edges, which convert once
(``ReadSide(pb_value)`` in, ``int(side)`` out: the values equal dualpath.v1's enum values,
and an edge refuses one that names none of them).
"""

from __future__ import annotations

from enum import IntEnum

PREFILL, DECODE, BOTH = "prefill", "decode", "both"
ROLES = (PREFILL, DECODE, BOTH)


class ReadSide(IntEnum):
    """Which node reads a request's hit from storage (the scheduler's choice, §6.1)."""

    UNSPECIFIED = 0   # DE chosen, PE not yet
    NONE = 1          # no prefix hit: nothing to read
    PREFILL = 2       # the PE's node reads
    DECODE = 3        # the DE's node reads
    SPLIT = 4         # both nodes read a part


class CompletionStage(IntEnum):
    """How far a request's attempt got on a node, as its completion says."""

    PREFILL_DONE = 1
    DECODE_DONE = 2
    FAILED = 3
