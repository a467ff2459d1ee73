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
    -> PrefillDone -> PREFILL_DONE reported (FAILED on any error: requeued, with the
       error and the engine to blame: the DE for what it or the way to it did, this
       engine for the rest)

Degrade, don't fail: hit blocks missing or corrupt in storage (either read side) are
computed here like miss tokens, from the first bad block on; PrefillDone tells the DE
where computing began (``computed_from_tokens``) so it caches those blocks again.

Attempts (docs/reliability.md): every message to the DE names the assignment's attempt;
a newer attempt of a request running here starts once the old one's task ended. A
prefill that ends without PrefillDone tells the DE (Engine.CancelRequest), after its own
writes ended; its engine memory, if a LOAD_HIT_KV order may still be writing into it,
goes back only when the DE answered that (engine/fence.py).

Every WRITE comes from a :class:`~dualpath.engine.kvplan.Route` between two placements.
Threads: the node's event loop only.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import replace

from dualpath import clock
from dualpath.engine.assignment import Assignment, side_of, split_blocks
from dualpath.engine.emulated import EmulatedEngine, EngineRank
from dualpath.engine.errors import PeerUnavailable
from dualpath.engine.kvio import write_layers, write_rows
from dualpath.engine.kvplan import Route, block_spans
from dualpath.engine.kvspace import KvSpace
from dualpath.engine.layers import AllReady, BothReady, LayerSource, LocalArrivals
from dualpath.engine.peers import LoadOrder, PrefillReport, PrepareJob
from dualpath.engine.resources import NodeResources
from dualpath.errors import TransferError
from dualpath.v1 import scheduler_pb2

log = logging.getLogger("dualpath.engine")


class PrefillPath:
    """The prefills running on a PE node: one task per (request, attempt); the newest
    attempt of each request is ``tasks[rid]``."""

    def __init__(self, node: NodeResources, space: KvSpace, engine: EmulatedEngine):
        self.node = node
        self.space = space
        self.engine = engine
        self.tasks: dict[str, asyncio.Task] = {}    # request -> its newest prefill
        self.current: dict[str, tuple[int, EngineRank]] = {}   # request -> attempt, engine
        self.runs: dict[tuple[str, int], asyncio.Task] = {}    # every live prefill
        self._rr = itertools.count()

    def assign(self, e: EngineRank, a: Assignment) -> None:
        """Start the prefill of ``a`` on engine ``e``: once per attempt; a newer attempt
        of a request running here starts once the old task ended."""
        rid = a.request_id
        old = self.tasks.get(rid)
        if old is not None:
            attempt, old_e = self.current[rid]
            if a.attempt <= attempt:
                return
            _cancel_once(old)
            old_e.tokens.pop(rid, None)
        e.tokens[rid] = a.prompt_tokens
        tokens = self._assigned_read_tokens(a)
        if tokens:                  # (an older attempt's expectation ends either way)
            self.space.read_queue.expect(rid, tokens)
        else:
            self.space.read_queue.forget(rid)
        t = self.node.spawn(self._prefill(e, a, old))
        self.tasks[rid] = self.runs[(rid, a.attempt)] = t
        self.current[rid] = (a.attempt, e)

    def cancel(self, rid: str) -> None:
        """Stop every attempt of ``rid`` here (the scheduler cancelled it)."""
        for (r, _), t in list(self.runs.items()):
            if r == rid:
                _cancel_once(t)

    async def stop(self, rid: str, attempt: int) -> bool:
        """Engine.CancelRequest from the DE: stop the attempts of ``rid`` up to
        ``attempt`` (0 = all) and return once their tasks ended, so none of their writes
        is on its way any more. A newer attempt running here is left alone. True when
        there was one to stop."""
        ts = [t for (r, att), t in self.runs.items()
              if r == rid and (not attempt or att <= attempt)]
        for t in ts:
            _cancel_once(t)
        if ts:
            await asyncio.wait(ts)
        return bool(ts)

    def claims(self) -> list[tuple[str, EngineRank, bool]]:
        """What this node's engines run, for a registration: (request, engine, False)."""
        return [(rid, e, False) for rid, (_, e) in self.current.items()]

    def _parts(self, a: Assignment) -> tuple[int, int]:
        """(blocks this PE reads, blocks the DE reads) of ``a``'s hit: its full blocks
        short of the last prompt token, none for an oracle request; a split read
        (the scheduler's, or the "split" policy's halves) reads a part on each side."""
        p, T = a.payload, self.space.fmt.block_tokens
        hit = 0 if p.oracle else min(a.hit_tokens // T, (a.prompt_tokens - 1) // T)
        return split_blocks(p.read_policy, a.read_side, hit, a.prefill_read_tokens,
                            a.decode_read_tokens, T)

    def _assigned_read_tokens(self, a: Assignment) -> int:
        """Hit tokens of ``a`` this node reads: its read queue counts them from the
        assignment on (prefill() sets them again for a round-robin one)."""
        return self._parts(a)[0] * self.space.fmt.block_tokens

    async def _prefill(self, e: EngineRank, a: Assignment, after: asyncio.Task | None) -> None:
        n = self.node
        rid = a.request_id
        me = asyncio.current_task()
        t0 = time.monotonic()
        try:
            if after is not None:         # the older attempt's writes end first
                await asyncio.wait([after])
            async with e.slots:
                await self.prefill(e, a)
            n.complete(rid, e, scheduler_pb2.COMPLETION_STAGE_PREFILL_DONE)
            n.metrics.phase_s.labels("prefill").observe(time.monotonic() - t0)
        except asyncio.CancelledError:
            raise
        except Exception as err:  # noqa: BLE001 - any failure requeues the request
            log.warning("prefill of %s (attempt %d) on %s failed: %s", rid, a.attempt,
                        e.engine_id, err)
            n.metrics.requests.labels("prefill_failed").inc()
            n.complete(rid, e, scheduler_pb2.COMPLETION_STAGE_FAILED, error=str(err),
                       suspect=a.decode_engine_id if isinstance(err, PeerUnavailable)
                       else e.engine_id)
        finally:
            self.runs.pop((rid, a.attempt), None)
            if self.tasks.get(rid) is me:
                del self.tasks[rid], self.current[rid]
                e.tokens.pop(rid, None)
                self.space.read_queue.forget(rid)

    async def prefill(self, e: EngineRank, a: Assignment) -> None:
        """Prefill ``a`` on ``e`` (see the module docstring); raises on failure, after
        every WRITE it started has finished (none still reads or writes its memory, or
        the memory is fenced until the DE says its writes ended)."""
        n, space, eng = self.node, self.space, self.engine
        fmt = space.fmt
        p = a.payload
        local, remote = self._parts(a)
        if p.read_policy == "round_robin" and remote + local:
            both = local + remote
            local, remote = (both, 0) if next(self._rr) % 2 == 0 else (0, both)
        T, L, k = fmt.block_tokens, fmt.layers, fmt.units
        rid, prompt, hit = a.request_id, a.prompt_tokens, a.hit_tokens
        if local:
            space.read_queue.expect(rid, local * T)
        else:
            space.read_queue.forget(rid)
        de = a.decode_address
        spans = block_spans(p.token_ids(prompt, n.tokens), T)
        keys = [s.key for s in spans]
        nb, hit_blocks = len(spans), local + remote
        prep = watch = None
        hbm = pebuf = None
        source: LayerSource = AllReady()
        loading: asyncio.Future | None = None
        pushes: list[asyncio.Future] = []      # engine memory -> DE buffer, per layer
        finished = False                       # PrefillDone answered
        try:
            prep = await n.peers.prepare(de, PrepareJob(rid, a.decode_engine_id, n.address,
                                                        prompt, hit, side_of(local, remote),
                                                        a.payload_bytes, a.attempt,
                                                        remote * T))
            layer_s = eng.prefill_layer_s(hit, prompt - hit)
            layerwise = p.layerwise and n.cfg.engine.layerwise
            report = PrefillReport(rid, e.engine_id, n.node_id, 0.0, 0, (0.0, 0.0),
                                   a.attempt, hit)
            if p.oracle:
                for layer in range(L):
                    await eng.forward_layer(e, layer_s, None, spans, layer, 0, 0)
                await self._done(de, report)
                finished = True
                return
            if prep.buffer is None or len(prep.slots) != nb:
                raise PeerUnavailable(f"{rid}: the DE prepared {len(prep.slots)} blocks, "
                                      f"{nb} needed")
            hbm = await e.hbm.reserve(nb)
            units = e.units(fmt, hbm)
            to_de = Route(e.placement(fmt), units, prep.buffer,
                          prep.buffer.units_of_slots(prep.slots))
            # Tokens before it come from storage: whole blocks only (a hit's tail short
            # of a block, or a "none" policy's hit, is computed).
            computed_from = hit_blocks * T
            report = replace(report, computed_from_tokens=computed_from)
            sources: list[LayerSource] = []
            if remote:                         # the DE's part: blocks [local, hit)
                await n.transfer.connect(de)
                watch = n.peers.watch(de, rid, a.attempt)
                await n.peers.order_load(de, LoadOrder(
                    rid, a.decode_engine_id, e.engine_id, keys[local:hit_blocks],
                    n.address, e.placement(fmt), units[local * k:hit_blocks * k],
                    a.attempt, first_block=local))
            own = local                        # our part's leading intact blocks
            if local:                          # ours: blocks [0, local), meanwhile
                pebuf = await space.pool.reserve(local)
                got = await space.read(rid, keys[:local], pebuf)
                n.metrics.read_bytes.inc(got.nbytes)
                own = min(got.usable, local)
                report = PrefillReport(rid, e.engine_id, n.node_id, 0.0, got.nbytes,
                                       got.span, a.attempt, hit)
                arrivals = LocalArrivals()
                loading = asyncio.ensure_future(write_layers(
                    n.transfer, n.address, space.buffer, space.buffer_units(pebuf),
                    e.placement(fmt), units, 0, own * T, on_layer=arrivals.landed))
                loading.add_done_callback(
                    lambda f: f.cancelled() or f.exception() is None
                    or arrivals.failed(str(f.exception())))
                sources.append(arrivals)
            if watch is not None:
                sources.append(watch)
                # Layer 0 tells how many blocks the DE read intact; when our own part
                # ended short, its writes end before we compute over the blocks it wrote.
                await watch.ready(L - 1 if own < local or not layerwise else 0)
            if hit_blocks:
                intact = own if own < local or not remote else local + watch.loaded_blocks
                computed_from = self._usable(rid, intact, hit_blocks, T)
                report = replace(report, computed_from_tokens=computed_from)
            source = (BothReady(sources) if len(sources) > 1 else
                      sources[0] if sources else AllReady())
            # Hit KV to wait for: timed once (all of it) without layerwise loading, per
            # layer with it; a request with nothing to load is not a sample.
            waited = n.metrics.layer_wait_s if sources else None
            if not layerwise:
                t = time.monotonic()
                await source.ready(L - 1)
                if waited is not None:
                    waited.observe(time.monotonic() - t)
                waited = None
            if computed_from != hit:
                layer_s = eng.prefill_layer_s(computed_from, prompt - computed_from)
            # The DE holds the blocks it read intact in its own buffer (when they are
            # used); every other prompt block goes to it from here.
            sent = ([(0, local * T), (computed_from, prompt)]
                    if remote and computed_from >= local * T else [(0, prompt)])
            for layer in range(L):
                t = time.monotonic()
                await source.ready(layer)
                if waited is not None:
                    waited.observe(time.monotonic() - t)
                await eng.forward_layer(e, layer_s, hbm, spans, layer, computed_from, prompt)
                _raise_failed(pushes, de)      # an earlier layer's push failed: stop here
                push = self._push(de, *to_de.arrays(layer, sent), layer)
                if layerwise:
                    pushes.append(asyncio.ensure_future(push))
                else:
                    await push
            if pushes:
                await asyncio.gather(*pushes)
            await self._done(de, report)
            finished = True
        finally:
            source.close()
            if watch is not None:              # before it joined ``source``, too
                watch.close()
            # On a failure part way, writes of earlier layers may still read from the
            # engine's memory (pushes) or land in it (the local load): let each finish or
            # fail (bounded by transfer.timeout_s) before those slots go to another request.
            pending = [f for f in (loading, *pushes) if f is not None and not f.done()]
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)
            for f in pushes:
                if f.done() and not f.cancelled():
                    f.exception()              # retrieved (raised above, or moot)
            told = True
            if prep is not None and not finished:
                # The DE drops its state (its slots: our writes ended) and its load into
                # our memory, answering once that load ended.
                told = await n.peers.cancel(de, rid, a.attempt)
            if hbm is not None:
                if watch is not None and not watch.complete and not told:
                    n.fences.hold(de, rid, a.attempt, hbm)
                else:
                    hbm.release()
            if pebuf is not None:
                pebuf.release()

    def _usable(self, rid: str, usable: int, hit_blocks: int, T: int) -> int:
        """The first token to compute: the hit, or where its first bad block begins."""
        usable = min(usable, hit_blocks)
        if usable < hit_blocks:
            log.warning("%s: %d of %d hit blocks missing or corrupt in storage; computing "
                        "them", rid, hit_blocks - usable, hit_blocks)
            self.node.metrics.recomputed_blocks.inc(hit_blocks - usable)
        return usable * T

    async def _push(self, de: str, src: str, dst: str, rows, layer: int) -> int:
        try:
            return await write_rows(self.node.transfer, de, src, dst, rows)
        except TransferError as e:
            raise PeerUnavailable(f"push of layer {layer} to {de}: {e}") from e

    async def _done(self, de: str, r: PrefillReport) -> None:
        await self.node.peers.prefill_done(de, replace(r, done_unix_s=clock.unix_now()))


def _cancel_once(t: asyncio.Task) -> None:
    """Cancel ``t`` unless it is being cancelled already: a second cancel would cut its
    clean-up short (the wait for its writes in flight)."""
    if not t.cancelling():
        t.cancel()


def _raise_failed(pushes: list[asyncio.Future], de: str) -> None:
    for f in pushes:
        if f.done() and not f.cancelled() and f.exception() is not None:
            raise f.exception()
