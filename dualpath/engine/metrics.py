"""A node daemon's Prometheus metrics (dualpath/metrics.py conventions) and the
storage-NIC limiter that also counts what it granted."""

from __future__ import annotations

from dualpath import clock
from dualpath import metrics as m
from dualpath.storage.ratelimit import RateLimiter


class NodeMetrics:
    def __init__(self, registry, role: str):
        self.role = role
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
        self.written_bytes = m.counter(
            registry, "dualpath_node_storage_written_bytes_total",
            "KV bytes this node wrote to storage (its storage NIC, beside the reads).")
        self.persist_failed = m.counter(registry, "dualpath_node_persist_failures_total",
                                        "Full Blocks not cached because the write failed "
                                        "(disk full, I/O error); the request is unaffected.")
        self.recomputed_blocks = m.counter(
            registry, "dualpath_node_hit_blocks_recomputed_total",
            "Hit blocks missing or corrupt in storage that the PE computed instead.")
        self.fenced_blocks = m.gauge(
            registry, "dualpath_node_fenced_blocks",
            "Buffer or HBM blocks held back until the peer that may still write into them "
            "says its writes ended (engine/fence.py).")
        self.transport = m.gauge(registry, "dualpath_node_transport_info",
                                 "1 for the transport KV bytes travel on (verbs or tcp), "
                                 "so a silent fallback to TCP shows on dashboards.",
                                 ("transport",))
        self.read_q = m.gauge(registry, "dualpath_node_read_queue_tokens",
                              "Tokens queued or in flight on this node's storage reads.")
        self.phase_s = m.histogram(registry, "dualpath_node_request_phase_seconds",
                                   "Time per request phase (prefill on PEs, decode on DEs).",
                                   ("phase",))
        # The vLLM connector's side on this node (dualpath/engine/vllm_engine.py).
        self.connector_lookups = m.counter(
            registry, "dualpath_node_connector_lookups_total",
            "Prefix lookups of the local vLLM instance's scheduler.")
        self.connector_lookup_hit_blocks = m.counter(
            registry, "dualpath_node_connector_lookup_hit_blocks_total",
            "Stored blocks those lookups found (leading hits).")
        self.connector_loaded_bytes = m.counter(
            registry, "dualpath_node_connector_loaded_bytes_total",
            "KV bytes written into the local vLLM instance's KV cache.")
        self.connector_pending_blocks = m.gauge(
            registry, "dualpath_node_connector_pending_blocks",
            "Saved blocks committed but not on disk yet (write-back in the DRAM buffer; "
            "lookups and loads already see them).")
        self.connector_load_failed_blocks = m.counter(
            registry, "dualpath_node_connector_load_failed_blocks_total",
            "Hit blocks that could not be loaded (missing, corrupt): vLLM recomputed them.")


class CountingLimiter(RateLimiter):
    """The storage-NIC token bucket, also counting the bytes it grants per wall-clock
    slot: the node's real storage-NIC traffic over time (Node.StorageReads)."""

    SLOT_S = 0.05

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.slots: dict[int, int] = {}

    async def acquire(self, nbytes: int, *, background: bool = False) -> None:
        await super().acquire(nbytes, background=background)
        k = int(clock.unix_now() / self.SLOT_S)
        self.slots[k] = self.slots.get(k, 0) + nbytes
