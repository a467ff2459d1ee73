"""The PE side of a node: one prefill per assigned request (paper Fig. 4a/4b).

    assigned -> DE prepared (PeerClient.prepare: DE-buffer slots and their placement)
      read side PREFILL: hit Full Blocks storage -> PE buffer; per layer PE buffer -> the
                         engine's memory (a WRITE over the node's loopback connection),
                         announced by a LocalArrivals layer source
      read side DECODE:  a LOAD_HIT_KV order: the DE writes each layer's hit blocks into
                         the engine's memory, followed by a RemoteWatch layer source
      per layer: ``await source.ready(l)`` -> compute (the engine's time; miss-token KV
        into the engine's memory) -> WRITE that layer's KV (PE read: hit and miss; DE
        read: miss only) into the DE buffer; with layerwise prefill the next layer's
        transfers run while this layer computes
    -> PrefillDone -> PREFILL_DONE reported (FAILED on any error: requeued)

Every WRITE comes from a :class:`~dualpath.engine.kvplan.Route` between two placements.
Threads: the node's event loop only.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time

from dualpath import clock
from dualpath.engine.assignment import Assignment
from dualpath.engine.emulated import EmulatedEngine, EngineRank
from dualpath.engine.errors import RequestFailed
from dualpath.engine.kvio import write_layers, write_runs
from dualpath.engine.kvplan import Route, block_spans
from dualpath.engine.kvspace import KvSpace
from dualpath.engine.layers import AllReady, LayerSource, LocalArrivals
from dualpath.engine.payload import Payload
from dualpath.engine.peers import LoadOrder, PrefillReport, PrepareJob
from dualpath.engine.resources import NodeResources
from dualpath.engine.roles import RS_DECODE, RS_NONE, RS_PREFILL, RS_SPLIT
from dualpath.v1 import scheduler_pb2

log = logging.getLogger("dualpath.engine")


class PrefillPath:
    """The prefills running on a PE node."""

    def __init__(self, node: NodeResources, space: KvSpace, engine: EmulatedEngine):
        self.node = node
        self.space = space
        self.engine = engine
        self.tasks: dict[str, asyncio.Task] = {}    # request -> its prefill
        self._rr = itertools.count()

    def assign(self, e: EngineRank, a: Assignment) -> None:
        """Start the prefill of ``a`` on engine ``e`` (once per request)."""
        if a.request_id in self.tasks:
            return
        e.tokens[a.request_id] = a.prompt_tokens
        if a.read_side == RS_PREFILL:
            self.space.read_queue.expect(a.request_id, a.hit_tokens)
        self.tasks[a.request_id] = self.node.spawn(self._prefill(e, a))

    def cancel(self, rid: str) -> None:
        t = self.tasks.pop(rid, None)
        if t is not None:
            t.cancel()

    def _read_side(self, p: Payload, a: Assignment) -> int:
        if a.hit_tokens == 0 or p.oracle or p.read_policy == "none":
            return RS_NONE
        if p.read_policy == "prefill":
            return RS_PREFILL
        if p.read_policy == "round_robin":
            return RS_PREFILL if next(self._rr) % 2 == 0 else RS_DECODE
        if a.read_side == RS_SPLIT:
            return RS_DECODE if a.decode_read_tokens >= a.prefill_read_tokens else RS_PREFILL
        return a.read_side if a.read_side in (RS_PREFILL, RS_DECODE) else RS_PREFILL

    async def _prefill(self, e: EngineRank, a: Assignment) -> None:
        n = self.node
        rid = a.request_id
        t0 = time.monotonic()
        try:
            async with e.slots:
                await self.prefill(e, a)
            n.complete(rid, e, scheduler_pb2.COMPLETION_STAGE_PREFILL_DONE)
            n.metrics.phase_s.labels("prefill").observe(time.monotonic() - t0)
        except asyncio.CancelledError:
            raise
        except Exception as err:  # noqa: BLE001 - any failure requeues the request
            log.warning("prefill of %s on %s failed: %s", rid, e.engine_id, err)
            n.metrics.requests.labels("prefill_failed").inc()
            # Free what the DE holds for it, and only then report: the retry's
            # PrepareRequest must not overtake this cancel.
            await n.peers.cancel(a.decode_address, rid)
            n.complete(rid, e, scheduler_pb2.COMPLETION_STAGE_FAILED)
        finally:
            e.tokens.pop(rid, None)
            self.tasks.pop(rid, None)
            self.space.read_queue.forget(rid)

    async def prefill(self, e: EngineRank, a: Assignment) -> None:
        """Prefill ``a`` on ``e`` (see the module docstring); raises on failure, after
        every WRITE it started has finished (none still reads or writes its memory)."""
        n, space, eng = self.node, self.space, self.engine
        fmt = space.fmt
        p = a.payload
        side = self._read_side(p, a)
        if side == RS_PREFILL:
            space.read_queue.expect(a.request_id, a.hit_tokens)
        else:
            space.read_queue.forget(a.request_id)
        T, L = fmt.block_tokens, fmt.layers
        rid, prompt, hit = a.request_id, a.prompt_tokens, a.hit_tokens
        de = a.decode_address
        spans = block_spans(p.token_ids(prompt, n.tokens), T)
        nb, hit_blocks = len(spans), hit // T
        prep = await n.peers.prepare(de, PrepareJob(rid, a.decode_engine_id, n.address,
                                                    prompt, hit, side, a.payload_bytes))
        layer_s = eng.prefill_layer_s(hit, prompt - hit)
        layerwise = p.layerwise and n.cfg.engine.layerwise
        done = PrefillReport(rid, e.engine_id, n.node_id, 0.0, 0, (0.0, 0.0))
        if p.oracle:
            for layer in range(L):
                await eng.forward_layer(e, layer_s, None, spans, layer, 0, 0)
            await self._done(de, done)
            return
        if prep.buffer is None or len(prep.slots) != nb:
            raise RequestFailed(f"{rid}: the DE prepared {len(prep.slots)} blocks, {nb} needed")
        hbm = await e.hbm.reserve(nb)
        units = e.units(fmt, hbm)
        to_de = Route(e.placement(fmt), units, prep.buffer,
                      prep.buffer.units_of_slots(prep.slots))
        pebuf = None
        source: LayerSource = AllReady()
        loading: asyncio.Future | None = None
        pushes: list[asyncio.Future] = []      # engine memory -> DE buffer, per layer
        try:
            if side == RS_PREFILL and hit_blocks:
                pebuf = await space.pool.reserve(hit_blocks)
                got = await space.read(rid, [s.key for s in spans[:hit_blocks]], pebuf)
                n.metrics.read_bytes.inc(got.nbytes)
                if not got.complete:
                    raise RequestFailed(f"{rid}: {got.blocks - got.usable} of {got.blocks} "
                                        "hit blocks missing from storage")
                done = PrefillReport(rid, e.engine_id, n.node_id, 0.0, got.nbytes, got.span)
                arrivals = LocalArrivals()
                loading = asyncio.ensure_future(write_layers(
                    n.transfer, n.address, space.buffer, space.buffer_units(pebuf),
                    e.placement(fmt), units, 0, hit_blocks * T, on_layer=arrivals.landed))
                loading.add_done_callback(
                    lambda f: f.cancelled() or f.exception() is None
                    or arrivals.failed(str(f.exception())))
                source = arrivals
                if not layerwise:
                    await loading
            elif side == RS_DECODE and hit_blocks:
                await n.transfer.connect(de)
                await n.peers.order_load(de, LoadOrder(
                    rid, a.decode_engine_id, e.engine_id, [s.key for s in spans[:hit_blocks]],
                    n.address, e.placement(fmt), units[:hit_blocks * fmt.units]))
                source = n.peers.watch(de, rid)
                if not layerwise:
                    await source.ready(L - 1)
            push_from = hit if side == RS_DECODE else 0
            for layer in range(L):
                await source.ready(layer)
                await eng.forward_layer(e, layer_s, hbm, spans, layer, hit, prompt)
                push = write_runs(n.transfer, de, to_de.runs(layer, push_from, prompt))
                if layerwise:
                    pushes.append(asyncio.ensure_future(push))
                else:
                    await push
            if pushes:
                await asyncio.gather(*pushes)
        finally:
            source.close()
            # On a failure part way, writes of earlier layers may still read from the
            # engine's memory (pushes) or land in it (the load): let each finish or fail
            # (bounded by transfer.timeout_s) before those slots go to another request.
            pending = [f for f in (loading, *pushes) if f is not None and not f.done()]
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)
            hbm.release()
            if pebuf is not None:
                pebuf.release()
        await self._done(de, done)

    async def _done(self, de: str, r: PrefillReport) -> None:
        await self.node.peers.prefill_done(de, PrefillReport(
            r.request_id, r.prefill_engine_id, r.prefill_node_id, clock.unix_now(),
            r.read_bytes, r.read_span))
