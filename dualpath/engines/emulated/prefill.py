"""The emulated engine's prefill (paper Fig. 4a/4b), on the skeleton of
dualpath/paths/prefill.py:

    DE prepared (PeerClient.prepare: DE-buffer slots and their placement)
      -> a PE-buffer reservation for every prompt block, and the hit staged in it:
      read side PREFILL: this node reads its hit Full Blocks from storage into it
      read side DECODE:  a LOAD_HIT_KV order: the DE reads them into its buffer and
                         WRITEs each layer here (a RemoteWatch follows it)
      (split: both, each its part; the paper's PE reads the hit into its buffer before
      the request joins a forward batch, Fig. 4 steps 1-2)
    -> the PE's forward (forward.py): batches under the compute quota, layer by
       layer: the layer's context moved PE buffer -> HBM (a WRITE over the node's own
       connection) -> compute (the engine's time; the miss tokens' KV written) -> the
       layer's KV on to the DE buffer (PE read: hit and miss; DE read: miss only, the
       DE keeps what it read) and, between chunks of a chunked prefill, back into the PE
       buffer
    -> PrefillDone

Why a DE's part lands in the PE buffer and not in HBM: HBM is allocated a layer at a
time while the request computes, and a DE cannot know when layer l's HBM exists (the
paper's PE reads layer l from the DE buffer then; our data plane offers WRITE only). A
vLLM prefill node stages the same way (dualpath/engines/vllm/stage.py).

Degrade, don't fail: hit blocks missing or corrupt in storage (either read side) are
computed here like miss tokens, from the first bad block on; PrefillDone tells the DE
where computing began (``computed_from_tokens``) so it caches those blocks again.

Every WRITE comes from a :class:`~dualpath.paths.kvplan.Route` between two placements.
Threads: the node's event loop only.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from dualpath import clock
from dualpath.buffers.pool import Reservation
from dualpath.engines.emulated.engine import EmulatedEngine
from dualpath.engines.emulated.forward import PrefillForward
from dualpath.errors import TransferError
from dualpath.kv.placement import KvPlacement, LayerMove
from dualpath.paths.assignment import Assignment
from dualpath.paths.errors import PeerUnavailable
from dualpath.paths.kvplan import BlockSpan, PrefillPlan, Route
from dualpath.paths.kvspace import KvSpace
from dualpath.paths.peers import LoadOrder, PrefillReport, PrepareJob
from dualpath.paths.prefill import PrefillPath
from dualpath.paths.ranks import EngineRank
from dualpath.paths.resources import NodeResources
from dualpath.transfer.kvio import write_rows


class EmulatedPrefillPath(PrefillPath):
    """PrefillPath whose :meth:`prefill` runs the emulated engine's forward."""

    def __init__(self, node: NodeResources, space: KvSpace, engine: EmulatedEngine,
                 forward: PrefillForward):
        super().__init__(node, space)
        self.engine = engine
        self.forward = forward
        self._rr = itertools.count()

    async def prefill(self, e: EngineRank, a: Assignment, plan: PrefillPlan) -> None:
        """Prefill ``a`` on ``e`` by ``plan`` (see the module docstring)."""
        n, space = self.node, self.space
        fmt = space.fmt
        p = a.payload
        if p.read_policy == "round_robin" and plan.hit_blocks:
            both = plan.hit_blocks
            plan = plan.with_parts(*((both, 0) if next(self._rr) % 2 == 0 else (0, both)))
        local, remote = plan.local, plan.remote
        T, L, k = fmt.block_tokens, fmt.layers, fmt.units
        rid, prompt, hit = a.request_id, a.prompt_tokens, a.hit_tokens
        if local:
            space.read_queue.expect(rid, local * T)
        else:
            space.read_queue.forget(rid)
        de = a.decode_address
        spans, keys = list(plan.spans), plan.keys
        nb, hit_blocks = len(spans), plan.hit_blocks
        layerwise = p.layerwise and n.cfg.engine.layerwise
        assigned = clock.unix_now()
        prep = watch = pebuf = None
        finished = False
        try:
            prep = await n.peers.prepare(de, PrepareJob(rid, a.decode_engine_id, n.address,
                                                        prompt, hit,
                                                        a.payload_bytes, a.attempt,
                                                        plan.decode_read_tokens))
            report = PrefillReport(rid, e.engine_id, n.node_id, 0.0, 0, (0.0, 0.0),
                                   a.attempt, hit)
            if p.oracle:                       # the hit is "in HBM": nothing moves
                staged = clock.unix_now()
                await self.forward.compute(e, _OracleJob(rid, prompt), hit, layerwise)
                await self._done(de, replace(report, phases=(assigned, staged, staged)))
                finished = True
                return
            if prep.buffer is None or len(prep.slots) != nb:
                raise PeerUnavailable(f"{rid}: the DE prepared {len(prep.slots)} blocks, "
                                      f"{nb} needed")
            # Every prompt block: the hit staged here, and a chunked prefill's KV kept
            # between its chunks.
            pebuf = await space.pool.reserve(nb)
            allocated = clock.unix_now()
            own = local                        # our part's leading intact blocks
            if remote:                         # the DE's part: blocks [local, hit)
                await n.transfer.connect(de)
                watch = n.peers.watch(de, rid, a.attempt)
                watch.scope = space.grant(n.transfer, a.decode_identity, pebuf, local,
                                          hit_blocks)
                await n.peers.order_load(de, LoadOrder(
                    rid, keys[local:hit_blocks], n.address, space.buffer,
                    space.buffer_units(pebuf)[local * k:hit_blocks * k], a.attempt,
                    first_block=local))
            if local:                          # ours: blocks [0, local), meanwhile
                got = await space.read(rid, keys[:local], pebuf)
                n.metrics.read_bytes.inc(got.nbytes)
                own = min(got.usable, local)
                report = replace(report, read_bytes=got.nbytes, read_span=got.span)
            if watch is not None:              # every layer of its part staged here
                await watch.ready(L - 1)
            # Tokens before it come from storage: whole blocks only (a hit's tail short
            # of a block, or a "none" policy's hit, is computed).
            computed_from = hit_blocks * T
            if hit_blocks:
                intact = own if own < local or not remote else local + watch.loaded_blocks
                computed_from = self._usable(rid, intact, hit_blocks, T)
            staged = clock.unix_now()
            # The DE holds the blocks it read intact in its own buffer (when they are
            # used); every other prompt block goes to it from here.
            lacks = (0, local * T) if remote and computed_from >= local * T \
                else (0, computed_from)
            job = _Job(self, e, rid, prompt, spans, pebuf, de,
                       prep.buffer, prep.buffer.units_of_slots(prep.slots), lacks,
                       computed_from)
            await self.forward.compute(e, job, computed_from, layerwise)
            await self._done(de, replace(report, computed_from_tokens=computed_from,
                                         phases=(assigned, allocated, staged)))
            finished = True
        finally:
            await self._end_attempt(de, rid, a.attempt, prep is not None, finished,
                                    lambda tell: self.request_finished(de, rid, a.attempt, tell,
                                                              watch, pebuf))

    async def request_finished(self, de: str, rid: str, attempt: int, tell: bool,
                      watch, pebuf: Reservation | None) -> None:
        """The end of an attempt here: the DE told (when it did not finish) and our
        PE-buffer slots released, or fenced while the DE's load may still write into
        them (it did not say it ended)."""
        n = self.node
        told = False
        if tell:
            # The DE drops its state (its slots: our writes ended) and its load into
            # our memory, answering once that load ended.
            told = await n.peers.cancel(de, rid, attempt)
        if watch is not None:
            watch.close()               # (its scope after the load ended, when told)
        if pebuf is not None:
            if watch is not None and not watch.complete and not told:
                n.fences.hold(de, rid, attempt, pebuf)
            else:
                pebuf.release()


@dataclass(frozen=True)
class _OracleJob:
    """An oracle request in the forward: computed, nothing moved (the paper's Oracle
    bypasses every read and transfer)."""

    request_id: str
    prompt_tokens: int
    moves_kv = False

    async def wait_for_layer_load(self, layer, window, stop) -> None:
        return

    def write(self, layer, window, first, stop, blocks) -> None:
        return

    async def save_kv_layer(self, layer, window, first, stop, last) -> None:
        return


class _Job:
    """One request's KV in the forward (engines/emulated/forward.py's ForwardJob): its context in
    PE-buffer slots ``pebuf`` (block i in slot i), its computed KV from the engine's
    HBM windows to the DE buffer ``de_units`` (and back to the PE buffer between
    chunks). ``lacks``: the span of hit tokens the DE does not hold and is sent with
    the first chunk; ``first``: the first token computed."""

    moves_kv = True

    def __init__(self, path: PrefillPath, e: EngineRank, rid: str, prompt: int,
                 spans: list[BlockSpan], pebuf: Reservation, de: str,
                 de_buffer: KvPlacement, de_units: Sequence[int],
                 lacks: tuple[int, int], first: int):
        self.path, self.e = path, e
        self.request_id, self.prompt_tokens = rid, prompt
        self.spans, self.pebuf, self.de = spans, pebuf, de
        space = path.space
        self.buf = space.buffer
        self.buf_units = space.buffer_units(pebuf)
        self.hbm = e.placement(space.fmt)
        self.de_buffer, self.de_units = de_buffer, de_units
        self.lacks, self.first = lacks, first
        self._moves: dict[tuple, LayerMove] = {}
        self._scope: asyncio.Future | None = None

    def _route(self, kind: str, window: Sequence[int]) -> Route:
        """Where ``kind``'s WRITEs go: "load" PE buffer -> HBM ``window``, "push" the
        window -> the DE's buffer, "back" the window -> the PE buffer."""
        if kind == "load":
            return Route(self.buf, self.buf_units, self.hbm, window)
        if kind == "push":
            return Route(self.hbm, window, self.de_buffer, self.de_units)
        return Route(self.hbm, window, self.buf, self.buf_units)

    def _rows(self, kind: str, window: Sequence[int], layer: int,
              spans: list[tuple[int, int]]) -> tuple[str, str, np.ndarray]:
        """``kind``'s runs of ``layer`` over ``spans``: its move made once per (kind,
        HBM window, spans) and shifted for each later layer (Route.move), not computed
        layer by layer (the windows are a ring of a few)."""
        key = (kind, tuple(window), tuple(spans))
        move = self._moves.get(key)
        if move is None:
            move = self._moves[key] = self._route(kind, window).move(spans)
        return move.rows(layer)

    async def wait_for_layer_load(self, layer: int, window: Sequence[int],
                                  stop: int) -> None:
        n = self.path.node
        await write_rows(n.transfer, n.address, *self._rows("load", window, layer,
                                                             [(0, stop)]))

    def write(self, layer: int, window: Reservation, first: int, stop: int,
              blocks: Sequence[int]) -> None:
        self.path.engine.write_layer_kv(window, blocks, self.spans, layer, first, stop)

    async def save_kv_layer(self, layer: int, window: Sequence[int], first: int,
                            stop: int, last: bool) -> None:
        n = self.path.node
        spans = [(first, stop)]
        if first == self.first:                # the first chunk: the hit the DE lacks
            spans.insert(0, self.lacks)
        try:
            if self._scope is None:     # the DE's grant to us, once (verbs: its keys)
                self._scope = asyncio.ensure_future(n.transfer.rescope(self.de))
            await asyncio.shield(self._scope)
            await write_rows(n.transfer, self.de, *self._rows("push", window, layer, spans))
        except TransferError as err:
            raise PeerUnavailable(f"push of layer {layer} to {self.de}: {err}") from err
        if not last:                           # the next chunk loads it from here
            await write_rows(n.transfer, n.address, *self._rows("back", window, layer,
                                                                 [(first, stop)]))
