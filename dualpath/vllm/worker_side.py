"""DualPathConnector's worker role (vLLM's worker process): loads and saves per step.

    register_kv_caches   describe the KV tensors (placement.py), start the WorkerAgent
                         (registers them, attaches to the node daemon)
    bind metadata        ask for every save's slots (before the forward: vLLM calls
                         start_load_kv after the forward when a step has no sync load)
    start_load_kv        start every load of the step (the daemon writes layer by layer)
    wait_for_layer_load  wait for exactly that layer of this step's loads to be in the KV
                         memory (written by the daemon, or copied out of its shared
                         buffer by the agent's copier as it arrived); a load that stops
                         making progress is given up (memory fenced first) and its blocks
                         reported for recompute
    save_kv_layer        WRITE that layer of the newly full blocks to the daemon's buffer
    wait_for_save        wait for the saves; commit them, except for a request whose load
                         failed this step (its new KV was computed from wrong inputs)
    load errors          the engine block ids of every block that did not load, for
                         vLLM's load-error hook: vLLM recomputes from the first of them

Threads: vLLM's worker thread; the agent's loop does the I/O (dualpath/vllm/agent.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from dualpath.vllm.agent import AgentSettings, LoadHandle, SaveHandle, WorkerAgent
from dualpath.vllm.kv_tensors import KvTensors
from dualpath.vllm.scheduler_side import StepPlan
from dualpath.vllm.settings import ConnectorSettings

log = logging.getLogger("dualpath.vllm")


@dataclass
class StepStats:
    """What this worker did since the last stats report (vLLM's connector stats)."""

    loads: int = 0
    loaded_tokens: int = 0
    loaded_bytes: int = 0
    failed_blocks: int = 0
    saved_blocks: int = 0
    layer_wait_s: list[float] = field(default_factory=list)


class WorkerSide:
    def __init__(self, settings: ConnectorSettings, model_id: str, tp_rank: int = 0,
                 tp_size: int = 1, prefix_caching: bool = False):
        self.settings = settings
        self.model_id = model_id
        self.prefix_caching = prefix_caching
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.agent: WorkerAgent | None = None
        self.kv: KvTensors | None = None
        self.layer_index: dict[str, int] = {}
        self._loads: list[tuple[LoadHandle, list[int]]] = []
        self._saves: list[SaveHandle] = []
        self._invalid: set[int] = set()
        self.stats = StepStats()

    def register(self, kv: KvTensors) -> None:
        cfg = self.settings.config
        self.kv = kv
        self.layer_index = {n: i for i, n in enumerate(kv.layer_names)}
        self.agent = WorkerAgent(AgentSettings(
            node_address=self.settings.node_address, model_id=self.model_id,
            listen=self.settings.listen, advertise=self.settings.advertise,
            transport=cfg.transport, transfer=cfg.transfer, lane=cfg.kv_lane, tls=cfg.tls,
            load_timeout_s=self.settings.load_timeout_s,
            save_timeout_s=self.settings.save_timeout_s, tp_rank=self.tp_rank,
            tp_size=self.tp_size, shared_buffer=self.settings.shared_buffer,
            prefix_caching=self.prefix_caching),
            kv.ranges, kv.placement, kv.canonical, kv.canonical_rows)
        a = self.agent.start()
        log.info("DualPath connector (worker): %d layers of %s KV (%s layout), format %s, "
                 "node %s", len(kv.layer_names), kv.dtype, kv.layout,
                 kv.placement.fmt.signature(), a.node_id)

    def begin_step(self, plan: StepPlan) -> None:
        """The step's metadata is bound (before its forward): ask for the save slots."""
        for spec in plan.saves:
            self._saves.append(self.agent.begin_save(spec.request_id, spec.keys, spec.units,
                                                       spec.ticket))

    def start_loads(self, plan: StepPlan) -> None:
        k = self.kv.placement.fmt.units
        tails = []
        for spec in plan.loads:
            keys, units = spec.keys, spec.units
            if spec.tail:
                # A prompt's partial last block (a P/D decode): vLLM writes the next
                # token's KV into its engine block before the forward waits for the
                # layer, and the load moves the block whole, so it lands before the
                # forward starts (the rest loads layer by layer meanwhile).
                h = self.agent.load(spec.request_id, keys[-1:], units[-k:], spec.ticket)
                self._loads.append((h, units[-k:]))
                tails.append(h)
                keys, units = keys[:-1], units[:-k]
            if keys:
                self._loads.append((self.agent.load(spec.request_id, keys, units,
                                                    spec.ticket), units))
        last = self.kv.placement.fmt.layers - 1
        for h in tails:
            if not h.wait_layer(last, self.settings.load_timeout_s):
                log.warning("DualPath: load of %s's partial last block made no progress "
                            "for %.0f s; fencing the KV memory and recomputing",
                            h.request_id, self.settings.load_timeout_s)
                self.agent.fence()
                h.give_up("timed out")

    def wait_layer(self, layer_name: str) -> None:
        if not self._loads:
            return
        layer = self.layer_index[layer_name]
        for h, _ in self._loads:
            if not h.wait_layer(layer, self.settings.load_timeout_s):
                log.warning("DualPath: load of %s made no progress for %.0f s at layer %d; "
                            "fencing the KV memory and recomputing", h.request_id,
                            self.settings.load_timeout_s, layer)
                self.agent.fence()
                h.give_up("timed out")

    def save_layer(self, layer_name: str) -> None:
        if not self._saves:
            return
        layer = self.layer_index[layer_name]
        computed = self._layer_computed()
        for h in self._saves:
            self.agent.save_layer(h, layer, computed)

    def _layer_computed(self):
        """For KV in GPU memory: an event recorded now on the model's current stream, as
        the call the save's WRITE waits on (the layer's kernels are queued, not done,
        when vLLM calls save_kv_layer; a device-wide sync would stall the model). None
        for host memory (the layer is computed when the hook runs)."""
        if self.kv is None or all(r.gpu_device is None for r in self.kv.ranges):
            return None
        import torch

        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream())
        return ev.synchronize

    def end_step(self) -> None:
        failed_reqs = set()
        k = self.kv.placement.fmt.units
        for h, units in self._loads:
            # Blocks found corrupt only when their last layer was read come with the
            # load's last message: wait for it (the forward normally already did).
            if not h.ended and not h.wait_layer(self.kv.placement.fmt.layers - 1,
                                                self.settings.load_timeout_s):
                self.agent.fence()
                h.give_up("timed out")
            self.agent.end_load(h)
            if h.failed:
                failed_reqs.add(h.request_id)
                for i in h.failed:
                    self._invalid.update(units[i * k:(i + 1) * k])
                self.stats.failed_blocks += len(h.failed)
                log.warning("DualPath: %d of %d blocks of %s did not load%s; vLLM recomputes",
                            len(h.failed), h.nblocks, h.request_id,
                            f" ({h.error})" if h.error else "")
            self.stats.loads += 1
            self.stats.loaded_tokens += (h.nblocks - len(h.failed)) * \
                self.kv.placement.fmt.block_tokens
            self.stats.loaded_bytes += h.nbytes
            self.stats.layer_wait_s.append(h.wait_s)
            log.debug("DualPath: load of %s: %d blocks, %.1f ms waited in the forward",
                      h.request_id, h.nblocks, 1e3 * h.wait_s)
        for h in self._saves:
            if self.agent.finish_save(h, commit=h.request_id not in failed_reqs):
                self.stats.saved_blocks += len(h.keys)
            elif h.error:
                log.warning("DualPath: blocks of %s not cached: %s", h.request_id, h.error)
        self._loads.clear()
        self._saves.clear()

    def take_load_errors(self) -> set[int]:
        out, self._invalid = self._invalid, set()
        return out

    def take_stats(self) -> StepStats | None:
        s = self.stats
        if not (s.loads or s.saved_blocks or s.failed_blocks):
            return None
        self.stats = StepStats()
        return s

    def close(self) -> None:
        if self.agent is not None:
            t0 = time.monotonic()
            self.agent.close()
            log.info("DualPath connector (worker): closed in %.2f s", time.monotonic() - t0)
