"""How a node opens the vLLM engine (``engine.kind = "vllm"``): a vLLM instance beside
the node, whose workers register their own KV tensors and attach through the KvConnector
service (service.py). Role ``both``: one ``kv_both`` instance, no scheduler; the node
loads and persists its KV. Role ``prefill`` / ``decode``: the node drives its instance at
``engine.vllm_url`` (prefill.py / decode.py) and registers with the scheduler once the
instance's worker attached (:meth:`VllmNode.ready`); its KV space is made then.

Threads: the node's event loop.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from dualpath.buffers.pool import BlockPool
from dualpath.buffers.shm import BufferOffer
from dualpath.config import Config
from dualpath.engines.protocol import LeaderTerms, NodeParts
from dualpath.engines.vllm.decode import VllmDecoder
from dualpath.engines.vllm.engine import VllmEngine
from dualpath.engines.vllm.instance import VllmInstance
from dualpath.engines.vllm.prefill import VllmPrefillPath
from dualpath.engines.vllm.service import KvConnectorServicer
from dualpath.errors import ConfigError
from dualpath.paths.decode import DecodePath
from dualpath.paths.kvspace import KvSpace
from dualpath.paths.prefill import PrefillPath
from dualpath.paths.ranks import EngineRank
from dualpath.roles import BOTH, DECODE, PREFILL
from dualpath.v1 import connector_pb2_grpc

log = logging.getLogger("dualpath.node")


@dataclass
class _KvBlocks:
    """A vLLM engine's KV cache as the scheduler sees it: its blocks (DualPath's)."""

    capacity: int


class VllmKind:
    name = "vllm"
    roles = frozenset({PREFILL, DECODE, BOTH})
    shares_buffer = True         # its workers map the node's buffer (buffers/shm.py)

    def check(self, cfg: Config, role: str) -> None:
        url = cfg.engine.vllm_url
        if role != BOTH and not url:
            raise ConfigError(f"a {role} node of engine.kind = 'vllm' drives its vLLM "
                              "instance: set engine.vllm_url (its OpenAI HTTP address)")
        if url and role == BOTH:
            raise ConfigError("engine.vllm_url is for prefill and decode nodes of "
                              "engine.kind = 'vllm' (a role-both node's instance drives "
                              "itself)")

    def open(self, parts: NodeParts) -> VllmNode:
        return VllmNode(parts)


class VllmNode:
    """A node's vLLM engine: the connector's node side, and (P/D) the instance it drives."""

    forward = None                  # vLLM batches by its own scheduler

    def __init__(self, parts: NodeParts):
        n, buf, ecfg = parts.resources, parts.buffer, parts.cfg.engine
        self.url = ecfg.vllm_url
        offer = BufferOffer(buf.fd, buf.nbytes, f"node {n.node_id}")
        vllm = self.vllm = VllmEngine(
            node_id=n.node_id, storage=parts.cfg.storage, transfer=n.transfer,
            region=buf, region_name=parts.buffer_name, limiter=n.limiter,
            metrics=n.metrics, offer=offer)
        parts.stack.push_async_callback(vllm.close)
        self.ranks: list[EngineRank] = []
        self.path: PrefillPath | DecodePath | None = None
        self.instance: VllmInstance | None = None
        if parts.role in (PREFILL, DECODE):
            instance = self.instance = VllmInstance(ecfg.vllm_url,
                                                    ecfg.vllm_request_timeout_s)
            parts.stack.push_async_callback(instance.close)
            # One instance = one group of one engine at any TP: the scheduler assigns
            # requests to instances, and an instance's tensor-parallel ranks compute each
            # request together (they attach as workers of the node, not as engines);
            # its KV blocks (every rank holds as many) are known at attach.
            e = EngineRank(f"{n.node_id}/e0", 0, "vllm", _KvBlocks(0))
            self.ranks.append(e)
            if parts.role == PREFILL:
                e.slots = asyncio.Semaphore(ecfg.max_prefills_per_engine)
                self.path = VllmPrefillPath(n, vllm, instance)
            else:
                self.path = DecodePath(n, None, {e.engine_id: e},
                                       lambda path: VllmDecoder(n, vllm, instance))
        self.services = [(connector_pb2_grpc.add_KvConnectorServicer_to_server,
                          KvConnectorServicer(vllm, parts.callers))]

    @property
    def space(self) -> KvSpace | None:
        return self.vllm.space

    def describe(self) -> str:
        return self.vllm.describe() + (f", driving the instance at {self.url}"
                                       if self.url else "")

    def pools(self) -> list[BlockPool]:
        """Its buffer's (its ranks' KV is the instance's, counted in blocks only)."""
        return [self.vllm.space.pool] if self.vllm.space is not None else []

    def read_q_tokens(self) -> int:
        return self.vllm.read_q_tokens

    def held_requests(self) -> int:
        return len(self.vllm.stages)

    def forget(self, request_id: str) -> None:
        """(A stage ends with its prefill's task; nothing of it is kept here.)"""

    async def ready(self, stop: asyncio.Event) -> bool:
        """Wait for the instance's worker to attach (the KV space and the engine's KV
        blocks are known then)."""
        vllm = self.vllm
        log.info("%s: waiting for the vLLM instance's worker to attach (instance %s)",
                 vllm.node_id, self.url)
        waiter = asyncio.ensure_future(vllm.attached.wait())
        stopper = asyncio.ensure_future(stop.wait())
        await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
        for f in (waiter, stopper):
            f.cancel()
        if stop.is_set():
            return False
        w = next(iter(vllm.workers.values()))
        self.ranks[0].hbm.capacity = w.placement.num_units // vllm.space.fmt.units
        self.path.space = vllm.space
        return True

    def leader_terms(self) -> LeaderTerms:
        instance = self.instance
        return LeaderTerms(None, lambda: instance.up, None)
