"""The boundary between a node and the model engine it serves, in vLLM's connector words.

A node daemon (dualpath/node/daemon.py) knows engines only through this module: it looks
the configured ``engine.kind`` up in :data:`dualpath.engines.KINDS`, checks the node's
role against it, hands :meth:`EngineKind.open` the node's parts and from then on talks
to the :class:`NodeEngine` it got back. It never tests an engine's type.

Where vLLM's KV connector (``KVConnectorBase_V1``) names a step, the engines take it
under that name, each in its own way (the worker-side half of the vLLM connector,
dualpath/vllm/connector.py, *is* a ``KVConnectorBase_V1``; these are the node-side steps it
calls, and the emulated engine's own):

=============================  ==========================================================
vLLM connector step            here
=============================  ==========================================================
``get_num_new_matched_tokens`` the hit lookup. vLLM: :meth:`~dualpath.engines.vllm.
                               engine.VllmEngine.get_num_new_matched_tokens` (the
                               connector's Lookup: the staged or stored leading blocks);
                               emulated: the scheduler's hit, staged in full
                               (:meth:`PrefillPath.plan`).
``start_load_kv``              the staged hit handed to the engine. vLLM:
                               :meth:`~dualpath.engines.vllm.engine.VllmEngine.
                               start_load_kv` (its worker WRITEs the PE-buffer slots into
                               its KV tensors, yielding layer progress); emulated: the
                               forward starts each layer's load as the layer before
                               computes (engines/emulated/forward.py).
``wait_for_layer_load(l)``     layer ``l`` is in. vLLM: the worker waits for the load's
                               layer progress (a :class:`~dualpath.paths.layers.
                               LayerSource` on the node); emulated: ``ForwardJob.
                               wait_for_layer_load`` (the layer's context PE buffer ->
                               HBM; the hit was staged before the forward: Fig. 4 steps
                               1-2).
``save_kv_layer`` /            the computed KV on its way out. vLLM: the worker's saves
``wait_for_save``              into slots from ``begin_save``, committed by ``end_save``
                               (each saved layer sent on to the DE); emulated:
                               ``ForwardJob.save_kv_layer`` (each layer to the DE buffer),
                               every save awaited at the step's end, before PrefillDone.
``request_finished``           the request's memory let go: each prefill path's
                               ``request_finished`` (run by ``PrefillPath._end_attempt``,
                               whatever cancels it) and ``DecodePath.release_buffer``
                               (DE), fenced while a peer may still write
                               (dualpath/paths/fence.py).
=============================  ==========================================================

Each attempt follows one plan per side (dualpath/paths/kvplan.py): a
:class:`~dualpath.paths.kvplan.PrefillPlan` made when its prefill runs, a
:class:`~dualpath.paths.kvplan.DecodePlan` made at its PrepareRequest.

A new engine (SGLang, say) is one package under dualpath/engines/ with a ``kind.py``
whose :class:`EngineKind` opens a :class:`NodeEngine` (its prefill a
:class:`~dualpath.paths.prefill.PrefillPath` subclass, its decode a
:class:`~dualpath.paths.decode.Decoder`), and one line in ``KINDS``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from dualpath.buffers.pool import BlockPool
from dualpath.buffers.region import PinnedRegion
from dualpath.config import Config
from dualpath.paths.auth import Callers
from dualpath.paths.decode import DecodePath
from dualpath.paths.kvspace import KvSpace
from dualpath.paths.prefill import PrefillPath
from dualpath.paths.ranks import EngineRank
from dualpath.paths.resources import NodeResources


@dataclass(frozen=True)
class NodeParts:
    """What the daemon hands an engine to open itself (it owns all of it)."""

    resources: NodeResources
    buffer: PinnedRegion              # the node's PE or DE buffer
    buffer_name: str                  # its registered region: "pe_buffer" / "de_buffer"
    stack: contextlib.AsyncExitStack  # what the engine opens is closed here, newest first
    region: Callable[[str, int], PinnedRegion]   # another registered region (name, MiB)
    callers: Callers                  # who may call the node's services

    @property
    def cfg(self) -> Config:
        return self.resources.cfg

    @property
    def role(self) -> str:
        return self.resources.role

    @property
    def node_id(self) -> str:
        return self.resources.node_id


@dataclass(frozen=True)
class LeaderTerms:
    """What the leader tells the scheduler of this engine, and asks of it."""

    profile_name: str | None          # the cost-model profile it batches by (None: its own)
    available: Callable[[], bool]     # False while the engine does not answer
    quota: Callable[[float], None] | None   # takes the scheduler's compute quota (§6.2)


class NodeEngine(Protocol):
    """One node's engine, opened: its ranks, its path, what it serves."""

    ranks: list[EngineRank]
    path: PrefillPath | DecodePath | None    # None: a role-both node (no scheduler)
    services: list                           # its own gRPC (add_to_server, servicer)
    forward: object | None                   # ForwardSteps' source (an emulated PE's)

    def describe(self) -> str:
        """One line for the start-up log."""

    @property
    def space(self) -> KvSpace | None:
        """The node's KV space (None until a vLLM worker attached)."""

    def pools(self) -> list[BlockPool]:
        """The slot pools it holds memory in (the node's buffer, its ranks' HBM)."""

    def read_q_tokens(self) -> int:
        """read_q: hit tokens queued or being read, plus those expected."""

    def held_requests(self) -> int:
        """Requests the engine itself still holds (the idle invariant)."""

    def forget(self, request_id: str) -> None:
        """``request_id`` was dropped here (cancelled, given up, lease lost)."""

    async def ready(self, stop: asyncio.Event) -> bool:
        """Wait until the engine can take work (a vLLM instance's worker attached);
        False when ``stop`` came first."""

    def leader_terms(self) -> LeaderTerms:
        """The terms the node registers with (after :meth:`ready`)."""


class EngineKind(Protocol):
    """An engine implementation as registered in :data:`dualpath.engines.KINDS`."""

    name: str
    roles: frozenset[str]             # node roles it serves
    shares_buffer: bool               # the node's buffer mapped by its own processes too

    def check(self, cfg: Config, role: str) -> None:
        """Refuse (ConfigError / UsageError) a configuration it cannot serve."""

    def open(self, parts: NodeParts) -> NodeEngine:
        """Open the engine for a node (what it opens goes on ``parts.stack``)."""
