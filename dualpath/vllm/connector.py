"""DualPathConnector: DualPath inside vLLM (a v1 KV connector loaded out of tree).

    --kv-transfer-config '{"kv_connector": "DualPathConnector",
                           "kv_connector_module_path": "dualpath.vllm.connector",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"node_address": "127.0.0.1:7001"}}'

beside a node daemon ``dualpath node --role both --engine vllm`` (see dualpath/vllm/
settings.py for the extra config). vLLM's own KV cache is the memory DualPath writes
into: hits are loaded from the block store layer by layer (``wait_for_layer_load(l)``
waits for exactly layer l, so layer l+1 loads while layer l computes), and every new
full block is persisted. A failed or corrupt load is reported through vLLM's load-error
hook, so vLLM recomputes those blocks: never a wrong token, never a hung request
(``kv_load_failure_policy = "recompute"``; with "fail" vLLM fails such a request).

One class, two roles: :class:`~dualpath.vllm.scheduler_side.SchedulerSide` in vLLM's
scheduler process, :class:`~dualpath.vllm.worker_side.WorkerSide` in each worker.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from dualpath.errors import UsageError
from dualpath.vllm import SUPPORTED_VLLM, check_vllm_version
from dualpath.vllm.kv_tensors import describe_kv_caches
from dualpath.vllm.scheduler_side import Lookup, SchedulerSide, StepPlan
from dualpath.vllm.settings import ConnectorSettings, model_id
from dualpath.vllm.worker_side import WorkerSide

if TYPE_CHECKING:
    from vllm.forward_context import ForwardContext

log = logging.getLogger("dualpath.vllm")


def _log_like_vllm() -> None:
    """DualPath's log lines in vLLM's processes go where vLLM's go, formatted alike."""
    ours, theirs = logging.getLogger("dualpath"), logging.getLogger("vllm")
    if not ours.handlers and theirs.handlers:
        for h in theirs.handlers:
            ours.addHandler(h)
        ours.setLevel(theirs.level or logging.INFO)
        ours.propagate = False


_log_like_vllm()


@dataclass
class DualPathMetadata(KVConnectorMetadata):
    plan: StepPlan


@dataclass
class DualPathStats(KVConnectorStats):
    """Per-interval connector stats (vLLM aggregates them over workers and logs them)."""

    KEYS = ("loads", "loaded_tokens", "loaded_bytes", "failed_blocks", "saved_blocks")

    def __post_init__(self):
        for k in self.KEYS:
            self.data.setdefault(k, 0)
        self.data.setdefault("layer_wait_s", [])

    def reset(self):
        self.data = {}
        self.__post_init__()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k in self.KEYS:
            self.data[k] += other.data.get(k, 0)
        self.data["layer_wait_s"] = self.data["layer_wait_s"] + list(
            other.data.get("layer_wait_s", []))
        return self

    def reduce(self) -> dict[str, int | float]:
        waits = self.data["layer_wait_s"]
        out = {k: self.data[k] for k in self.KEYS}
        out["layer_wait_ms_mean"] = round(1e3 * sum(waits) / len(waits), 3) if waits else 0.0
        return out

    def is_empty(self) -> bool:
        return not any(self.data[k] for k in self.KEYS)


class DualPathPromMetrics(KVConnectorPromMetrics):
    """The connector's Prometheus metrics in vLLM's own registry (its /metrics)."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        c, hst = self._counter_cls, self._histogram_cls
        self._counters = {
            "loaded_tokens": c("dualpath_connector_loaded_tokens_total",
                               "Prompt tokens whose KV DualPath loaded (hit tokens).",
                               labelnames),
            "loaded_bytes": c("dualpath_connector_loaded_bytes_total",
                              "KV bytes DualPath wrote into vLLM's KV cache.", labelnames),
            "failed_blocks": c("dualpath_connector_load_failed_blocks_total",
                               "Blocks that did not load and were recomputed.", labelnames),
            "saved_blocks": c("dualpath_connector_saved_blocks_total",
                              "New full blocks handed to the store.", labelnames),
        }
        self._wait = hst("dualpath_connector_layer_wait_seconds",
                         "Time a forward pass waited for one request's hit KV (summed "
                         "over its layers).", labelnames,
                         buckets=[1e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1, 5])

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        labels = self.per_engine_labelvalues[engine_idx]
        for k, counter in self._counters.items():
            v = transfer_stats_data.get(k, 0)
            if v:
                counter.labels(*labels).inc(v)
        for w in transfer_stats_data.get("layer_wait_s", []):
            self._wait.labels(*labels).observe(w)


class DualPathConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        untested = check_vllm_version(vllm.__version__)
        if untested:
            log.warning("DualPath: %s", untested)
        kvt = vllm_config.kv_transfer_config
        self.settings = ConnectorSettings.from_extra_config(kvt.kv_connector_extra_config)
        if kvt.kv_load_failure_policy != "recompute":
            log.warning("DualPath: kv_load_failure_policy is %r: a block that fails to load "
                        "fails its request instead of being recomputed",
                        kvt.kv_load_failure_policy)
        self.model_id = self.settings.model_id or model_id(vllm_config)
        self.block_size = vllm_config.cache_config.block_size
        self._sched: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        pc = vllm_config.parallel_config
        if pc.pipeline_parallel_size != 1:
            # A stage holds some of the layers; a block holds all of them, and a stage
            # would need its own layer range of each (a load's layer order, a save that
            # completes only when every stage's layers landed): not built.
            raise UsageError("DualPathConnector does not support pipeline parallelism "
                             f"(pipeline_parallel_size {pc.pipeline_parallel_size}): each "
                             "stage holds a part of the layers, and a DualPath block holds "
                             "every layer; use tensor parallelism")
        self._tp = pc.tensor_parallel_size
        if role == KVConnectorRole.SCHEDULER:
            self._sched = SchedulerSide(
                Lookup(self.settings.node_address, self.model_id,
                       self.settings.lookup_timeout_s, self.settings.config.tls),
                self.block_size, self.settings.block_units,
                partial_tails=kvt.kv_role == "kv_consumer")
        else:
            self._worker = WorkerSide(
                self.settings, self.model_id, tp_size=self._tp,
                prefix_caching=bool(vllm_config.cache_config.enable_prefix_caching))
        mc = vllm_config.model_config
        self._mla = bool(mc.use_mla)             # a latent per token: no heads, no K/V
        # (head size, this rank's KV heads, every rank's)
        self._geometry = (mc.get_head_size(),
                          1 if self._mla else mc.get_num_kv_heads(pc),
                          1 if self._mla else mc.get_total_num_kv_heads())
        log.info("DualPath connector (%s): node %s, model %s, vLLM %s (supported %s)",
                 role.name.lower(), self.settings.node_address, self.model_id,
                 vllm.__version__, SUPPORTED_VLLM)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Yes: DualPath loads and saves layer by layer (wait_for_layer_load and
        save_kv_layer wait on and start transfers), which a full CUDA graph's replay
        would skip; PIECEWISE graphs run them between the pieces."""
        return True

    @classmethod
    def kv_cache_access(cls, kv_transfer_config):
        """vLLM 0.34+: the workers register vLLM's KV memory with the NIC
        (dualpath/vllm/agent.py), so each segment must be one physical allocation."""
        from vllm.config.kv_transfer import KVCacheAccess
        return KVCacheAccess.REGISTERS

    # ------------------------------------------------------------ worker role

    def register_kv_caches(self, kv_caches):
        head_size, kv_heads, total = self._geometry
        rank = 0
        if self._tp > 1:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
            rank = get_tensor_model_parallel_rank()
        self._worker.tp_rank = rank
        self._worker.register(describe_kv_caches(kv_caches, self.block_size, head_size,
                                                 kv_heads, self.settings.block_units,
                                                 mla=self._mla, tp_rank=rank,
                                                 tp_size=self._tp, total_kv_heads=total))

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            assert isinstance(connector_metadata, DualPathMetadata)
            self._worker.begin_step(connector_metadata.plan)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, DualPathMetadata)
        self._worker.start_loads(meta.plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        self._worker.save_layer(layer_name)

    def wait_for_save(self):
        self._worker.end_step()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors() if self._worker is not None else set()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        s = self._worker.take_stats() if self._worker is not None else None
        if s is None:
            return None
        return DualPathStats(data={"loads": s.loads, "loaded_tokens": s.loaded_tokens,
                                   "loaded_bytes": s.loaded_bytes,
                                   "failed_blocks": s.failed_blocks,
                                   "saved_blocks": s.saved_blocks,
                                   "layer_wait_s": s.layer_wait_s})

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None):
        return DualPathStats(data=dict(data)) if data is not None else DualPathStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames,
                           per_engine_labelvalues):
        return DualPathPromMetrics(vllm_config, metric_types, labelnames,
                                   per_engine_labelvalues)

    def shutdown(self):
        if self._worker is not None:
            self._worker.close()
        if self._sched is not None:
            self._sched.lookup.close()

    # ------------------------------------------------------------ scheduler role

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        n = self._sched.matched_tokens(request, num_computed_tokens)
        return n, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        self._sched.after_alloc(request, blocks.get_block_ids()[0], num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        so = scheduler_output
        return DualPathMetadata(self._sched.build(so.scheduled_new_reqs,
                                                  so.scheduled_cached_reqs,
                                                  so.num_scheduled_tokens))

    def request_finished(self, request, block_ids):
        self._sched.finished(request.request_id)
        return False, None
