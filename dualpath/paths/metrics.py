"""A node daemon's Prometheus metrics (dualpath/metrics.py conventions) and the
storage-NIC limiter that also counts what it granted."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)

from dualpath import clock
from dualpath import metrics as m
from dualpath.storage.evictor import HIT_AGE_BUCKETS
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
        self.unverified = m.counter(registry, "dualpath_node_kv_unverified_bytes_total",
                                    "Prompt KV bytes the DE received and did not verify "
                                    "(engine.verify_fraction < 1).")
        self.emulator_cpu = m.counter(
            registry, "dualpath_node_emulator_cpu_seconds_total",
            "CPU seconds of the emulated engine's own work, by kind: 'synth' (the "
            "synthetic KV it computes) and 'verify' (the DE's byte check); not data-path "
            "work.", ("work",))
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
        self.instance_cache_blocks = m.counter(
            registry, "dualpath_node_hit_blocks_in_instance_cache_total",
            "Hit blocks a vLLM prefill was not staged for: its instance's own prefix "
            "cache held the whole hit (engines/vllm/instance_cache.py).")
        self.held_by_instance = m.counter(
            registry, "dualpath_node_prompt_blocks_held_by_instance_total",
            "Prompt blocks a vLLM decode node asked not to be sent: its instance's own "
            "prefix cache held them (engines/vllm/instance_cache.py).")
        self.partial_blocks_loaded = m.counter(
            registry, "dualpath_node_partial_prompt_blocks_loaded_total",
            "Prompts' partial last blocks a vLLM decode instance loaded from this node "
            "(sent by the prefill node): it computed the first token only.")
        self.loop_stalls = m.counter(
            registry, "dualpath_node_event_loop_stalls_total",
            "Times the node's event loop ran no callback for over a second (its log "
            "names where its thread was: dualpath/stall.py).")
        self.loop_stalled = m.counter(
            registry, "dualpath_node_event_loop_stalled_seconds_total",
            "Seconds the node's event loop spent in those stalls.")
        self.fenced_blocks = m.gauge(
            registry, "dualpath_node_fenced_blocks",
            "Buffer or HBM blocks held back until the peer that may still write into them "
            "says its writes ended (paths/fence.py).")
        self.transport = m.gauge(registry, "dualpath_node_transport_info",
                                 "1 for the transport KV bytes travel on (verbs or tcp), "
                                 "so a silent fallback to TCP shows on dashboards.",
                                 ("transport",))
        self.snic_rate = m.gauge(registry, "dualpath_node_storage_nic_bytes_per_second",
                                 "The storage-NIC limit this node reads and writes under, "
                                 "each direction (storage.snic_gbit_per_s; 0 = unlimited).")
        self.read_q = m.gauge(registry, "dualpath_node_read_queue_tokens",
                              "Tokens queued or in flight on this node's storage reads.")
        self.layer_wait_s = m.histogram(
            registry, "dualpath_node_layer_wait_seconds",
            "Time a PE's forward pass waited for one layer's hit KV to be in place "
            "(requests with a hit only; without layerwise loading one sample: all of it).")
        # A PE's forward steps (the emulated engine: engines/emulated/forward.py).
        self.forward_steps = m.counter(registry, "dualpath_node_forward_steps_total",
                                       "Forward steps the PE's engines took together.")
        self.attention_s = m.counter(
            registry, "dualpath_node_attention_seconds_total",
            "Seconds each PE engine spent in attention (emulated).", ("engine",))
        self.attention_max_avg = m.histogram(
            registry, "dualpath_node_attention_max_over_avg_ratio",
            "Per forward step, the slowest engine's attention time over the engines' mean "
            "(1 = balanced; the paper's Fig. 14).",
            buckets=(1.0, 1.02, 1.05, 1.1, 1.2, 1.5, 2.0, 3.0, 4.0, 8.0))
        self.batch_requests = m.histogram(
            registry, "dualpath_node_forward_batch_requests",
            "Requests in one PE engine's forward batch.",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128))
        self.batch_tokens = m.histogram(
            registry, "dualpath_node_forward_batch_tokens",
            "New tokens in one PE engine's forward batch.",
            buckets=(64, 256, 1024, 4096, 16384, 65536))
        self.phase_s = m.histogram(registry, "dualpath_node_request_phase_seconds",
                                   "Time per request phase (prefill on PEs, decode on DEs).",
                                   ("phase",))
        # The vLLM connector's side on this node (dualpath/engines/vllm/engine.py).
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


# Counters other owners keep, read when /metrics is scraped: (metric, owner, key, help).
_OWNED_COUNTERS = (
    ("dualpath_node_transfer_writes_total", "transfer", "writes_posted",
     "RDMA WRITEs (or TCP provider writes) posted by this node's transfer engine."),
    ("dualpath_node_transfer_error_completions_total", "transfer", "error_completions",
     "Completions with an error status: a write that failed on the wire."),
    ("dualpath_node_transfer_recoveries_total", "transfer", "recoveries",
     ("Connections (QPs on verbs) reset after an error or a timed-out write, a reconnect "
      "attempted; their in-flight writes go back to the queue.")),
    ("dualpath_node_transfer_retried_slices_total", "transfer", "retried_slices",
     "Writes posted again after their connection broke."),
    ("dualpath_node_transfer_rescopes_total", "transfer", "rescopes",
     ("Fetches of a peer's windows before writing under its grant, where the peer's "
      "regions are scoped by key (verbs under mutual TLS): about one per request.")),
    ("dualpath_node_data_writes_refused_total", "target", "refused",
     ("Peers' WRITEs into this node refused where they landed, before a byte was written "
      "(a bad key or range, memory deregistered, or out of the writer's scope). TCP "
      "provider only.")),
    ("dualpath_node_data_writes_out_of_scope_total", "target", "out_of_scope",
     ("Of those, WRITEs outside the windows granted to their writer: another request's "
      "slots, or an ended attempt's (docs/security.md, the data plane's scope).")),
    ("dualpath_node_store_corrupt_blocks_total", "store", "corrupt_blocks",
     ("Stored blocks that failed their checksum (or header, length) check: quarantined "
     "and recomputed.")),
    ("dualpath_node_store_read_errors_total", "store", "read_errors",
     "Block reads that failed with an I/O error: the block is recomputed."),
    ("dualpath_node_store_missing_blocks_total", "store", "misses",
     "Block reads that found no such block."),
    ("dualpath_node_store_evictions_total", "store", "evictions",
     ("Blocks this process evicted as the store's evictor (storage.capacity_gib; "
      "docs/storage.md).")),
    ("dualpath_node_store_evicted_bytes_total", "store", "evicted_bytes",
     "Bytes on disk of the blocks this process evicted."),
    ("dualpath_node_store_writes_refused_capacity_total", "store", "writes_refused_capacity",
     ("Block writes refused because the store was at its bound (the block is not "
      "cached); many mean the evictor cannot keep up or leases hold the space.")),
    ("dualpath_node_store_index_stat_calls_total", "store", "index_stat_calls",
     ("Filesystem lookups of keys the store's index did not know (about one per "
      "lookup once the index is warm).")),
)


class OwnedCounters:
    """A collector exporting the transfer engine's, its provider's target side's and the
    block store's own counters at scrape time (kept by their owners' threads; read here
    as one dict each, the target's by one C call that reads its counters atomically)."""

    def __init__(self, transfer: Mapping[str, int], store: Callable[[], Mapping[str, int]],
                 target: Callable[[], Mapping[str, int]] = dict):
        self._sources = {"transfer": lambda: transfer, "store": store, "target": target}

    def describe(self) -> Iterator[CounterMetricFamily]:
        for name, _, _, doc in _OWNED_COUNTERS:
            yield CounterMetricFamily(name[: -len("_total")], doc)

    def collect(self) -> Iterator[CounterMetricFamily]:
        values = {owner: get() for owner, get in self._sources.items()}
        for name, owner, k, doc in _OWNED_COUNTERS:
            yield CounterMetricFamily(name[: -len("_total")], doc,
                                      value=values[owner].get(k, 0))


_POOL_GAUGES = (
    ("dualpath_node_buffer_capacity_blocks", "capacity",
     "Full Block slots of this node's DRAM buffer (PE or DE buffer)."),
    ("dualpath_node_buffer_free_blocks", "free",
     ("Slots of that buffer no request holds; equal to its capacity once the node is "
      "idle and its write-back drained (less means a leak).")),
    ("dualpath_node_buffer_waiting_reservations", "waiting",
     "Requests waiting for slots of that buffer (first come, first served)."),
)


class PoolGauges:
    """A collector reading the node's buffer pool at scrape time (``pool()``: the pool,
    or None before a vLLM worker attached and the pool exists)."""

    def __init__(self, pool: Callable[[], object | None]):
        self._pool = pool

    def describe(self) -> Iterator[GaugeMetricFamily]:
        for name, _, doc in _POOL_GAUGES:
            yield GaugeMetricFamily(name, doc, labels=("buffer",))

    def collect(self) -> Iterator[GaugeMetricFamily]:
        pool = self._pool()
        for name, attr, doc in _POOL_GAUGES:
            g = GaugeMetricFamily(name, doc, labels=("buffer",))
            if pool is not None:
                g.add_metric((pool.name,), getattr(pool, attr))
            yield g


class StoreGauges:
    """The store's bound as its evictor sees it, and the age of hits (``upkeep()``: the
    store's Upkeep, or None without a capacity or before the store opened). Usage and
    hit ages come from the evictor only: 0 and empty on the other nodes."""

    def __init__(self, upkeep: Callable[[], object | None]):
        self._upkeep = upkeep

    def describe(self) -> Iterator:
        return self.collect()

    def collect(self) -> Iterator:
        u = self._upkeep()
        g = u.gauges() if u is not None else {}
        for name, k, doc in (
                ("dualpath_node_store_evictor", "evictor",
                 "1 when this process is the store's evictor (holds its lock)."),
                ("dualpath_node_store_usage_bytes", "usage_bytes",
                 "Bytes of blocks in the store's namespace (evictor only)."),
                ("dualpath_node_store_capacity_bytes", "capacity_bytes",
                 "The namespace's bound, storage.capacity_gib."),
                ("dualpath_node_store_blocks", "blocks",
                 "Blocks in the store's namespace (evictor only).")):
            yield GaugeMetricFamily(name, doc, value=g.get(k, 0.0))
        h = HistogramMetricFamily(
            "dualpath_node_store_hit_age_seconds",
            "Time since a block's previous hit (or its write) at each hit (evictor only): "
            "how far back in the store the working set reaches.")
        counts = u.stats.hit_age_counts if u is not None else [0] * len(HIT_AGE_BUCKETS)
        buckets, acc = [], 0
        for bound, n in zip(HIT_AGE_BUCKETS, counts):
            acc += n
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), acc))
        h.add_metric((), buckets, u.stats.hit_age_sum if u is not None else 0.0)
        yield h


class CountingLimiter(RateLimiter):
    """The storage-NIC token buckets, also counting the read bytes they grant per
    wall-clock slot: the node's storage reads over time (Node.StorageReads)."""

    SLOT_S = 0.05

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.slots: dict[int, int] = {}

    async def acquire(self, nbytes: int) -> None:
        await super().acquire(nbytes)
        k = int(clock.unix_now() / self.SLOT_S)
        self.slots[k] = self.slots.get(k, 0) + nbytes
