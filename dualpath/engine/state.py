"""What the PE and DE paths of a node share: its engines, its metrics, the role and
read-side names, the failure that requeues a request, and the cross-process clock."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from dualpath import metrics as _metrics
from dualpath.buffers.pool import BlockPool
from dualpath.errors import DualPathError
from dualpath.v1 import scheduler_pb2

PREFILL, DECODE = "prefill", "decode"
ROLE_PB = {PREFILL: scheduler_pb2.ENGINE_ROLE_PREFILL, DECODE: scheduler_pb2.ENGINE_ROLE_DECODE}
RS_NONE, RS_PREFILL, RS_DECODE = (scheduler_pb2.READ_SIDE_NONE, scheduler_pb2.READ_SIDE_PREFILL,
                                  scheduler_pb2.READ_SIDE_DECODE)


def unix_now() -> float:
    """Wall-clock seconds: the one clock comparable across processes (and, with NTP,
    across nodes) for the replay's per-request timings."""
    return time.time()


class RequestFailed(DualPathError):
    """A request could not be served here; it is reported FAILED and requeued."""


@dataclass
class Engine:
    """One (emulated) GPU: its HBM pool, its compute lock and its requests."""

    engine_id: str
    rank: int
    region: str                 # registered name of its HBM region
    hbm: BlockPool
    gpu: asyncio.Lock = field(default_factory=asyncio.Lock)
    tokens: dict[str, int] = field(default_factory=dict)   # request -> prompt tokens
    reserved_blocks: dict[str, int] = field(default_factory=dict)  # DE: HBM promised
    slots: asyncio.Semaphore | None = None                 # PE: concurrent prefills


class NodeMetrics:
    def __init__(self, registry, role: str):
        m = _metrics
        self.read_bytes = m.counter(registry, "dualpath_node_storage_read_bytes_total",
                                    "KV bytes this node read from storage (its storage NIC).")
        self.requests = m.counter(registry, "dualpath_node_requests_total",
                                  "Requests this node finished, by outcome.", ("outcome",))
        self.verified = m.counter(registry, "dualpath_node_kv_verified_bytes_total",
                                  "Prompt KV bytes the DE verified against the generator.")
        self.mismatched = m.counter(registry, "dualpath_node_kv_mismatched_bytes_total",
                                    "Prompt KV bytes in requests that failed verification.")
        self.persisted = m.counter(registry, "dualpath_node_blocks_persisted_total",
                                   "Full Blocks of new KV written to storage.")
        self.transport = m.gauge(registry, "dualpath_node_transport_info",
                                 "1 for the transport KV bytes travel on (verbs or tcp), "
                                 "so a silent fallback to TCP shows on dashboards.",
                                 ("transport",))
        self.read_q = m.gauge(registry, "dualpath_node_read_queue_tokens",
                              "Tokens queued or in flight on this node's storage reads.")
        self.phase_s = m.histogram(registry, "dualpath_node_request_phase_seconds",
                                   "Time per request phase (prefill on PEs, decode on DEs).",
                                   ("phase",))
        self.role = role
