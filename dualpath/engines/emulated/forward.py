"""A PE node's forward passes in the emulated engine: batches, HBM a layer at a time, and
the node's engines stepping together (paper §2 "Layerwise Prefill", §6.2).

A request joins its engine's queue once its hit KV is staged in the PE buffer (read by
this node, by its DE, or both: paths/prefill.py). The node's engines step together, as
an expert-parallel group does: a step is one forward pass on every engine that has work,
layer by layer, each layer as long as the slowest engine's attention plus the group's
FFN (:func:`dualpath.kv.cost.group_layer_time`). Each engine's batch is packed by
:func:`dualpath.engines.emulated.batching.pack_batch`: FIFO under the scheduler's compute
quota, predicted by the PE's own estimator (fitted at start-up by profiling the engine:
:func:`dualpath.engines.emulated.batching.fit_attention`), within the HBM the engine has
free; a request too large for the quota is chunked (chunked prefill).

HBM, per member of a step (one request's slice of its engine's batch):

- layerwise prefill: a ring of :data:`DEPTH` layer windows, each the Layer Block slots
  of the member's context up to this slice's end; layer l has window ``l % DEPTH`` from
  the start of its move into HBM until its KV left for the DE buffer, so layer l+1 moves
  in while layer l computes and a member holds DEPTH layers of HBM, not all of them;
- without (``layerwise`` off: the paper's Basic): every layer's window, held for the
  whole step, all moved in before layer 0 computes.

A member's :class:`ForwardJob` (the request's prefill) moves its KV, its steps named as
vLLM's KV connector names them (engines/protocol.py): ``wait_for_layer_load`` (the
context computed so far, staged in the PE buffer, into a window; the layer computes once
it returned), ``write`` (the KV the layer computed: the emulated model's),
``save_kv_layer`` (that layer to the DE buffer, and for a chunk that is not the
request's last, the chunk's KV back into the PE buffer, where the next chunk loads it
from); the step's end awaits every save (``wait_for_save``). A job that fails ends its request only; the step goes on
without it. A job withdrawn (its request cancelled) leaves at the next layer, once the
moves it started ended.

Every step is recorded (:class:`StepRecord`: each engine's attention seconds, requests and
tokens, and the tokens its batch left queued; Node.ForwardSteps) so the attention balance
across engines (the paper's Fig. 14) can be measured, over all steps and over the steps
whose every batch was full.

Threads: the node's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from dualpath import clock
from dualpath.aio import retrieved, waited_out
from dualpath.buffers.pool import Reservation
from dualpath.engines.emulated.batching import (
    BatchSlice,
    Estimator,
    HbmBudget,
    PrefillWork,
    advance,
    pack_batch,
)
from dualpath.kv import cost
from dualpath.kv.placement import KvFormat
from dualpath.kv.profiles import ModelProfile
from dualpath.paths.errors import RequestFailed
from dualpath.paths.ranks import EngineRank

log = logging.getLogger("dualpath.node")

#: Layer windows a member holds with layerwise prefill: the layer computing, the next
#: one moving in, and the one before, whose KV may still be on its way to the DE.
DEPTH = 3
#: Steps remembered for Node.ForwardSteps, and the most one answer carries (a caller
#: pages with ``since_unix_s``; 8192 steps of 8 engines stay far below gRPC's 4 MiB).
STEPS_KEPT = 16384
STEPS_PER_ANSWER = 8192


class ForwardJob(Protocol):
    """One request's side of its forward passes (paths/prefill.py)."""

    request_id: str
    prompt_tokens: int
    moves_kv: bool                  # False: an oracle request (no HBM, nothing moved)

    async def wait_for_layer_load(self, layer: int, window: Sequence[int],
                                  stop: int) -> None:
        """Move layer ``layer`` of tokens [0, stop) from the PE buffer into the HBM
        units ``window`` (unit i holds the request's tokens [i*T, (i+1)*T))."""

    def write(self, layer: int, window: Reservation, first: int, stop: int,
              blocks: Sequence[int]) -> None:
        """The KV layer ``layer`` computed for tokens [first, stop), into the slots
        ``blocks`` (block i's slot index in ``window``)."""

    async def save_kv_layer(self, layer: int, window: Sequence[int], first: int,
                            stop: int, last: bool) -> None:
        """Layer ``layer``'s KV, in HBM units ``window``, on to the DE buffer (what it
        lacks of [0, stop)); unless ``last``, tokens [first, stop) into the PE buffer
        too (the next chunk's context)."""


def layer_slots(tokens: int, block_tokens: int, layers: int, layerwise: bool,
                moves_kv: bool = True) -> int:
    """HBM Layer Block slots a request computing up to ``tokens`` of context holds in a
    step: DEPTH layer windows with layerwise prefill, every layer's without (pure: the
    simulator and fig12's ablation size HBM with it too)."""
    if not moves_kv:
        return 0
    return -(-tokens // block_tokens) * (min(DEPTH, layers) if layerwise else layers)


@dataclass(frozen=True)
class StepRecord:
    """One forward step of the node's engines."""

    start_unix_s: float
    duration_s: float
    attention_s: tuple[float, ...]       # per engine (rank order), all layers
    requests: tuple[int, ...]
    tokens: tuple[int, ...]              # new tokens per engine
    left_tokens: tuple[int, ...] = ()    # per engine, new tokens queued that its batch
                                         # left for later (> 0: the batch was full)


@dataclass
class _Entry:
    """A request in its engine's queue, from submit to its last chunk's end."""

    rank: EngineRank
    job: ForwardJob
    work: PrefillWork
    layerwise: bool
    done: asyncio.Future
    settled: asyncio.Future                   # it left the forward, its moves ended
    previous: asyncio.Future | None = None    # the last chunk's moves, until they ended
    in_step: bool = False
    withdrawn: bool = False


@dataclass
class _Member:
    """An entry's slice of one step, with the HBM it holds there."""

    entry: _Entry
    slice: BatchSlice
    res: Reservation | None
    windows: int
    blocks: int                              # Layer Block slots per window
    units_of: Callable[[Sequence[int]], list[int]]
    loads: dict[int, asyncio.Future] = field(default_factory=dict)
    sends: dict[int, asyncio.Future] = field(default_factory=dict)
    error: BaseException | None = None

    @property
    def alive(self) -> bool:
        return self.error is None and not self.entry.withdrawn

    @property
    def start(self) -> int:
        return self.slice.cached_tokens

    @property
    def stop(self) -> int:
        return self.slice.cached_tokens + self.slice.tokens

    def slots(self, layer: int) -> list[int]:
        """The window slots (indices into ``res``) of ``layer``."""
        w = layer % self.windows
        return list(range(w * self.blocks, (w + 1) * self.blocks))

    def window(self, layer: int) -> list[int]:
        return self.units_of([self.res.slots[i] for i in self.slots(layer)])


class PrefillForward:
    """The forward steps of a PE node's engines (see the module docstring). ``sleep``
    is injectable (tests step by hand)."""

    def __init__(self, profile: ModelProfile, fmt: KvFormat, ranks: Sequence[EngineRank],
                 estimate: Estimator, *, quota_s: float = 0.3, metrics=None,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep):
        self.profile, self.fmt = profile, fmt
        self.ranks = list(ranks)
        self.estimate = estimate
        self.quota_s = quota_s
        self.metrics = metrics
        self._sleep = sleep
        self.queues: dict[str, deque[_Entry]] = {e.engine_id: deque() for e in self.ranks}
        self.entries: dict[str, _Entry] = {}
        self.steps: deque[StepRecord] = deque(maxlen=STEPS_KEPT)
        self._wake = asyncio.Event()
        self._loop: asyncio.Task | None = None
        self._finishing: set[asyncio.Task] = set()

    # ------------------------------------------------------------ the request side

    def set_quota(self, quota_s: float) -> None:
        """The compute quota the scheduler sent (FetchResponse.compute_quota_ms)."""
        if quota_s > 0:
            self.quota_s = quota_s

    def blocks(self, tokens: int) -> int:
        return -(-tokens // self.fmt.block_tokens)

    def hbm_need(self, layerwise: bool, moves_kv: bool, tokens: int) -> int:
        """Layer Block slots a member computing up to ``tokens`` of context holds."""
        return layer_slots(tokens, self.fmt.block_tokens, self.fmt.layers, layerwise,
                           moves_kv)

    def submit(self, rank: EngineRank, job: ForwardJob, cached: int, layerwise: bool
               ) -> asyncio.Future:
        """Queue ``job`` on ``rank``: tokens [0, cached) have KV (staged in the PE
        buffer), the rest of its prompt is computed. The future resolves once its last
        chunk's KV has gone where it goes, or fails with the job's error."""
        rid = job.request_id
        if rid in self.entries:
            raise RequestFailed(f"{rid} is already queued on this PE's forward")
        if not 0 <= cached < job.prompt_tokens:
            raise RequestFailed(f"{rid}: cached tokens {cached} outside [0, "
                                f"{job.prompt_tokens})")
        need = self.hbm_need(layerwise, job.moves_kv, job.prompt_tokens)
        if need > rank.hbm.capacity:
            raise RequestFailed(f"{rid}: its KV needs {need} HBM Layer Block slots at once "
                                f"({'per ' + str(DEPTH) + ' layers' if layerwise else 'all layers'}); "
                                f"{rank.engine_id} has {rank.hbm.capacity}")
        loop = asyncio.get_running_loop()
        # ``done`` retrieved: a request whose prefill went away first (withdrawn, the
        # node stopping) may still be failed by its step's push (bench/faults.py).
        e = _Entry(rank, job, PrefillWork(rid, cached, job.prompt_tokens - cached),
                   layerwise, retrieved(loop.create_future()), loop.create_future())
        self.entries[rid] = e
        self.queues[rank.engine_id].append(e)
        self._kick()
        return e.done

    async def compute(self, rank: EngineRank, job: ForwardJob, cached: int,
                      layerwise: bool) -> None:
        """:meth:`submit` and wait for it; cancelled, ``job`` is withdrawn first, so
        once this returns or raises nothing of the forward reads or writes its memory."""
        done = self.submit(rank, job, cached, layerwise)
        e = self.entries[job.request_id]
        try:
            await asyncio.shield(done)
        except asyncio.CancelledError:
            e.withdrawn = True
            if not e.in_step:
                self._drop(e, None)
            await waited_out(*(f for f in (e.settled, e.previous) if f is not None))
            raise

    def _drop(self, e: _Entry, error: BaseException | None) -> None:
        """``e`` leaves the forward (done, failed or withdrawn)."""
        if self.entries.get(e.work.request_id) is e:
            del self.entries[e.work.request_id]
        q = self.queues[e.rank.engine_id]
        if e in q:
            q.remove(e)
        if not e.done.done():
            if error is not None:
                e.done.set_exception(error)
            elif e.withdrawn:
                e.done.cancel()
            else:
                e.done.set_result(None)
        if not e.settled.done():
            e.settled.set_result(None)
        self._kick()

    def _kick(self) -> None:
        self._wake.set()
        if self._loop is None or self._loop.done():
            self._loop = asyncio.ensure_future(self._run())

    async def close(self) -> None:
        """Stop stepping (idempotent); queued requests fail."""
        if self._loop is not None:
            self._loop.cancel()
            await asyncio.gather(self._loop, return_exceptions=True)
        if self._finishing:
            await asyncio.gather(*self._finishing, return_exceptions=True)
        for e in list(self.entries.values()):
            self._drop(e, RequestFailed("the node is stopping"))

    # ------------------------------------------------------------ the loop

    async def _run(self) -> None:
        while self.entries:
            self._wake.clear()
            plan, left = self._pack()
            if not any(plan.values()):
                self._fail_unfittable()
                if not self.entries:
                    break
                await self._wake.wait()       # a submit, a release of HBM, a withdraw
                continue
            await self._step(plan, left)

    def _pack(self) -> tuple[dict[str, list[_Member]], dict[str, int]]:
        """Each engine's members of the next step, and the new tokens its queue holds
        beyond them (what the quota or the HBM left for later)."""
        plan: dict[str, list[_Member]] = {}
        left: dict[str, int] = {}
        for e in self.ranks:
            q = self.queues[e.engine_id]
            if not q:
                continue
            by_id = {x.work.request_id: x for x in q}

            def need(w: PrefillWork, tokens: int, by_id=by_id) -> int:
                x = by_id[w.request_id]
                return self.hbm_need(x.layerwise, x.job.moves_kv, tokens)
            batch = pack_batch([x.work for x in q], self.estimate, self.quota_s,
                               hbm=HbmBudget(e.hbm.free, need))
            members = []
            for s in batch:
                x = by_id[s.request_id]
                stop = s.cached_tokens + s.tokens
                n = need(x.work, stop)
                res = e.hbm.try_reserve(n) if n else None
                if n and res is None:         # (only this loop reserves PE HBM)
                    break
                windows = (min(DEPTH, self.fmt.layers) if x.layerwise else self.fmt.layers)
                placement = e.placement(self.fmt)
                members.append(_Member(x, s, res, windows, self.blocks(stop),
                                       placement.units_of_slots))
                x.in_step = True
            plan[e.engine_id] = members
            left[e.engine_id] = (sum(x.work.remaining_tokens for x in q)
                                 - sum(m.slice.tokens for m in members))
        return plan, left

    def _fail_unfittable(self) -> None:
        """A queue's head that cannot fit even an empty engine's HBM never will."""
        for e in self.ranks:
            head = next((x for x in self.queues[e.engine_id]
                         if x.work.remaining_tokens > 0), None)
            if head is not None and e.hbm.free == e.hbm.capacity and (
                    head.previous is None or head.previous.done()):
                x = head
                self._drop(x, RequestFailed(
                    f"{x.work.request_id}: its next chunk does not fit {e.engine_id}'s "
                    f"HBM ({e.hbm.capacity} Layer Block slots)"))

    async def _step(self, plan: dict[str, list[_Member]], left: dict[str, int]) -> None:
        L = self.fmt.layers
        members = [m for ms in plan.values() for m in ms]
        t0, w0 = time.monotonic(), clock.unix_now()
        attention = {eid: 0.0 for eid in self.queues}
        for m in members:
            for layer in (range(1) if m.entry.layerwise else range(L)):
                self._start_load(m, layer)
        for layer in range(L):
            for m in members:
                # Without layerwise prefill every layer is in HBM before layer 0 computes.
                waits = [layer] if m.entry.layerwise else range(L) if layer == 0 else ()
                t = time.monotonic()
                for w in waits:
                    if not m.alive:
                        break
                    try:
                        await asyncio.shield(m.loads[w])
                    except Exception as err:  # noqa: BLE001 - that request fails alone
                        m.error = err
                if waits and m.start and m.entry.job.moves_kv and self.metrics is not None:
                    self.metrics.layer_wait_s.observe(time.monotonic() - t)
            for m in members:
                if m.alive and m.entry.layerwise and layer + 1 < L:
                    self._start_load(m, layer + 1)
            ranks = [eid for eid, ms in plan.items() if any(m.alive for m in ms)]
            if not ranks:
                break
            pairs = [[(m.start, m.slice.tokens) for m in plan[eid] if m.alive]
                     for eid in ranks]
            seconds, attn = cost.group_layer_time(self.profile, pairs)
            await self._sleep(seconds)
            for eid, a in zip(ranks, attn):
                attention[eid] += a
            for m in members:
                if not m.alive:
                    continue
                if m.res is not None:
                    try:
                        m.entry.job.write(layer, m.res, m.start, m.stop, m.slots(layer))
                    except Exception as err:  # noqa: BLE001 - that request fails alone
                        m.error = err
                        continue
                m.sends[layer] = retrieved(asyncio.ensure_future(self._send(m, layer)))
        self._record(plan, left, attention, w0, time.monotonic() - t0)
        for eid, ms in plan.items():
            q = self.queues[eid]
            works = deque(x.work for x in q)
            advance(works, [m.slice for m in ms])
            for m in ms:
                t = asyncio.ensure_future(self._finish(m))
                self._finishing.add(t)
                t.add_done_callback(self._finishing.discard)
                m.entry.previous = t
                m.entry.in_step = False

    def _start_load(self, m: _Member, layer: int) -> None:
        async def go() -> None:
            prev = m.entry.previous
            if prev is not None and layer == 0:
                await asyncio.shield(prev)        # the last chunk's KV is in the PE buffer
                if m.entry.done.done():           # ...or that chunk failed
                    raise RequestFailed(f"{m.entry.work.request_id}: its last chunk failed")
            if not m.entry.job.moves_kv:
                return
            reuse = layer - m.windows             # the layer that had this window before
            if reuse >= 0 and reuse in m.sends:
                await asyncio.gather(m.sends[reuse], return_exceptions=True)
            if m.start:
                await m.entry.job.wait_for_layer_load(layer, m.window(layer), m.start)
        m.loads[layer] = retrieved(asyncio.ensure_future(go()))

    async def _send(self, m: _Member, layer: int) -> None:
        if not m.entry.job.moves_kv:
            return
        await m.entry.job.save_kv_layer(layer, m.window(layer), m.start, m.stop,
                               m.stop >= m.entry.job.prompt_tokens)

    async def _finish(self, m: _Member) -> None:
        """After ``m``'s step: its moves end, its HBM goes back, and its request is
        done (its last chunk), failed, withdrawn, or back in the queue for its next."""
        ops = [*m.loads.values(), *m.sends.values()]
        got = await asyncio.gather(*ops, return_exceptions=True)
        if m.error is None:
            m.error = next((g for g in got if isinstance(g, Exception)), None)
        if m.res is not None:
            m.res.release()
        e = m.entry
        if m.error is not None or e.withdrawn:
            self._drop(e, m.error)
        elif m.stop >= e.job.prompt_tokens:
            self._drop(e, None)
        else:
            self._kick()

    def _record(self, plan: dict[str, list[_Member]], left: dict[str, int],
                attention: dict[str, float], start_unix_s: float, duration_s: float) -> None:
        ids = [e.engine_id for e in self.ranks]
        rec = StepRecord(start_unix_s, duration_s, tuple(attention[i] for i in ids),
                         tuple(len(plan.get(i, ())) for i in ids),
                         tuple(sum(m.slice.tokens for m in plan.get(i, ())) for i in ids),
                         tuple(left.get(i, 0) for i in ids))
        self.steps.append(rec)
        mt = self.metrics
        if mt is None:
            return
        mt.forward_steps.inc()
        for i, a, r, t in zip(ids, rec.attention_s, rec.requests, rec.tokens):
            if r:
                mt.attention_s.labels(i).inc(a)
                mt.batch_requests.observe(r)
                mt.batch_tokens.observe(t)
        mean = sum(rec.attention_s) / len(ids)
        if mean > 0:
            mt.attention_max_avg.observe(max(rec.attention_s) / mean)
