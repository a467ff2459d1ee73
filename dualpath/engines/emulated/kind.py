"""How a node opens the emulated engine (``engine.kind = "emulated"``): its KV format,
store namespace and DRAM pool from the model profile, an "HBM" region per engine rank,
and the PE's forward or the DE's write-back.

Threads: the node's event loop.
"""

from __future__ import annotations

import asyncio
import logging

from dualpath.buffers.pool import BlockPool
from dualpath.config import Config
from dualpath.engines.emulated.batching import fit_attention
from dualpath.engines.emulated.decode import EmulatedDecoder
from dualpath.engines.emulated.engine import EmulatedEngine
from dualpath.engines.emulated.forward import PrefillForward
from dualpath.engines.emulated.prefill import EmulatedPrefillPath
from dualpath.engines.protocol import LeaderTerms, NodeParts
from dualpath.errors import ConfigError, UsageError
from dualpath.kv.layout import BlockLayout
from dualpath.kv.profiles import get_profile
from dualpath.kv.synth import SyntheticKV
from dualpath.paths.decode import DecodePath
from dualpath.paths.kvspace import KvSpace
from dualpath.paths.prefill import PrefillPath
from dualpath.paths.ranks import EngineRank
from dualpath.paths.writeback import WriteBack
from dualpath.roles import DECODE, PREFILL
from dualpath.storage.read_queue import ReadQueue

log = logging.getLogger("dualpath.node")


class EmulatedKind:
    name = "emulated"
    roles = frozenset({PREFILL, DECODE})
    shares_buffer = False

    def check(self, cfg: Config, role: str) -> None:
        if role not in self.roles:
            raise UsageError(f"--role {role} is for a vLLM instance (engine.kind = 'vllm'); "
                             "emulated engines are prefill or decode nodes")
        if cfg.engine.vllm_url:
            raise ConfigError("engine.vllm_url is for prefill and decode nodes of "
                              "engine.kind = 'vllm'")

    def open(self, parts: NodeParts) -> EmulatedNode:
        return EmulatedNode(parts)


class EmulatedNode:
    """A node's emulated engines: the cost model, their "HBM" regions, the path."""

    def __init__(self, parts: NodeParts):
        cfg, role, n = parts.cfg, parts.role, parts.resources
        ecfg, s = cfg.engine, cfg.storage
        st = parts.stack
        profile = get_profile(ecfg.model_profile).scaled(ecfg.speed_scale)
        layout = BlockLayout.of(profile)
        store = s.open_store(profile)
        st.callback(store.close)
        read_queue = ReadQueue(store, n.limiter)
        st.push_async_callback(read_queue.close)
        buf = parts.buffer
        pool = BlockPool(parts.buffer_name, buf.array, layout, region_addr=buf.addr,
                         key=f"buffers.{parts.buffer_name}_mib")
        self._space = KvSpace.for_store(store, read_queue, pool, parts.buffer_name)
        self.profile = profile
        engine = self.engine = EmulatedEngine(profile, ecfg.speed_scale,
                                              ecfg.verify_fraction)
        engine.bind(self._space.fmt, SyntheticKV(layout))
        engine.cpu_counter = n.metrics.emulator_cpu
        hbm_mib = ecfg.prefill_hbm_mib if role == PREFILL else ecfg.decode_hbm_mib
        # A PE's HBM is allocated a Layer Block at a time (forward.py), a DE's a Full
        # Block per block of a request it decodes.
        hbm_layout = layout.one_layer() if role == PREFILL else layout
        self.ranks: list[EngineRank] = []
        for rank in range(ecfg.engines_per_node):
            name = f"hbm{rank}"
            region = parts.region(name, hbm_mib)
            e = EngineRank(f"{n.node_id}/e{rank}", rank, name,
                           BlockPool(name, region.array, hbm_layout, region_addr=region.addr))
            if role == PREFILL:
                e.slots = asyncio.Semaphore(ecfg.max_prefills_per_engine)
            self.ranks.append(e)
        self.services: list = []
        self.forward: PrefillForward | None = None
        self.path: PrefillPath | DecodePath
        if role == PREFILL:
            # The packer's estimator, fitted by profiling the engine (paper §6.2).
            fit = fit_attention(profile, engine.attention_s)
            self.forward = PrefillForward(profile, self._space.fmt, self.ranks, fit,
                                          metrics=n.metrics)
            st.push_async_callback(self.forward.close)
            log.info("%s: forward batches packed by %s (profiled)", n.node_id,
                     fit.describe())
            self.path = EmulatedPrefillPath(n, self._space, engine, self.forward)
        else:
            # New KV goes to storage from DE-buffer slots through the storage NIC's write
            # direction; each request waits for its own blocks (docs/e2e.md).
            self._space.writeback = WriteBack(store, n.limiter, self._space.pending,
                                              n.metrics)
            st.push_async_callback(self._space.writeback.close)
            self.path = DecodePath(n, self._space, {e.engine_id: e for e in self.ranks},
                                   lambda path: EmulatedDecoder(path, engine))

    @property
    def space(self) -> KvSpace:
        return self._space

    def describe(self) -> str:
        return self.engine.describe()

    def pools(self) -> list[BlockPool]:
        return [self._space.pool] + [e.hbm for e in self.ranks]

    def read_q_tokens(self) -> int:
        return self._space.read_queue.read_q_tokens

    def held_requests(self) -> int:
        return 0

    def forget(self, request_id: str) -> None:
        self._space.read_queue.forget(request_id)

    async def ready(self, stop: asyncio.Event) -> bool:
        return True

    def leader_terms(self) -> LeaderTerms:
        return LeaderTerms(self.profile.name, lambda: True,
                           self.forward.set_quota if self.forward is not None else None)
