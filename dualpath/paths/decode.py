"""The DE side of a node: one :class:`DecodeState` per request from PrepareRequest to
DECODE_DONE.

PrepareRequest reserves DE-buffer slots (:meth:`DecodePath.prepare`); with the DE read
side the PE's LOAD_HIT_KV order reads the hit blocks from storage into the DE buffer and
writes them, layer by layer, into the PE's engine memory (:meth:`DecodePath.load_hit_kv`,
the order's target placement); PrefillDone starts decode: the engine's
:class:`Decoder` (dualpath/engines/emulated/decode.py verifies every byte against the
generator and runs the cost model's decode batch; dualpath/engines/vllm/decode.py drives
the decode instance), every new full block persisted as it fills (a block that cannot be
written is skipped and counted, never failing the request) ->
DECODE_DONE reported; the timings go to the replay
client's sink only once the scheduler recorded that DECODE_DONE (:meth:`DecodePath.
send_result`, called by the leader), so a result is never reported twice; those one
acknowledgement recorded go in one call per sink (a gRPC call costs ~0.3 ms of CPU).

Attempts (docs/reliability.md): a request's state here is one attempt's. Anything of an
older attempt than the one held (the DE-only assignment's, or the PrepareRequest's) is
refused (:class:`~dualpath.paths.errors.StaleAttempt`, ABORTED on the wire); a newer
PrepareRequest replaces the old state. Dropping a state while its PE may still push
into its DE-buffer slots (prepared, PrefillDone not come, and not the PE's own cancel)
fences those slots until that PE says its writes ended (paths/fence.py). A hit block
missing or corrupt in storage on the DE read path is not a failure: the order writes the
leading intact blocks and says how many (``loaded_blocks``); the PE computes the rest.

Threads: the node's event loop owns all state.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from dualpath import clock
from dualpath.aio import waited_out
from dualpath.buffers.pool import Reservation
from dualpath.errors import DualPathError, UsageError
from dualpath.kv.placement import KvPlacement
from dualpath.kv.prefix import KEY_BYTES
from dualpath.paths.errors import NotYours, StaleAttempt
from dualpath.paths.kvplan import BlockSpan, DecodePlan, block_spans, blocks_for, decode_plan
from dualpath.paths.kvspace import KvSpace
from dualpath.paths.payload import Payload
from dualpath.paths.peers import LoadOrder, PrefillReport, Timings, report_calls
from dualpath.paths.ranks import EngineRank
from dualpath.paths.resources import NodeResources
from dualpath.roles import CompletionStage
from dualpath.tls import Identity
from dualpath.transfer import Grant
from dualpath.transfer.kvio import write_layers

log = logging.getLogger("dualpath.node")


@dataclass
class DecodeState:
    """One attempt of a request on this DE, from PrepareRequest to its end."""

    request_id: str
    engine: EngineRank
    payload: Payload
    plan: DecodePlan                            # its blocks, held and slotted (kvplan.py)
    buffer: Reservation | None                  # DE-buffer slots (None: oracle)
    pe_address: str
    attempt: int = 0
    decoding: bool = False                      # PrefillDone came: the PE writes no more
    layers_done: int = 0
    loaded_blocks: int = 0                      # DE read path: leading hit blocks read intact
    load_error: str = ""
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    read_bytes: int = 0
    read_span: tuple[float, float] = (0.0, 0.0)
    tasks: list[asyncio.Task] = field(default_factory=list)
    loads: list[asyncio.Task] = field(default_factory=list)   # its loads into the PE
    owner: Identity | None = None               # the node that prepared it (mutual TLS)
    # Its submitter, once the scheduler assigned the request here (``assigned_here``):
    # who its sink must be. Nothing goes to a sink before (a prepare the scheduler never
    # made here must not stream into anyone's request).
    sink_identity: str = ""
    assigned_here: bool = False
    ended: asyncio.Event = field(default_factory=asyncio.Event)   # dropped, released
    # Where its PE may WRITE in our buffer: its slots, until the PE is done or the
    # attempt ends (the transfer engine refuses its other WRITEs there).
    grant: Grant | None = None

    @property
    def spans(self) -> tuple[BlockSpan, ...]:
        return self.plan.spans

    @property
    def held(self) -> int:
        """vLLM: leading prompt blocks the decode instance likely holds (the PE sends
        none of them: node.proto PrepareRequestResponse.held_blocks)."""
        return self.plan.held

    @property
    def base(self) -> int:
        """The first block with a slot (``buffer`` block i is prompt block base + i)."""
        return self.plan.base


#: Bounds on what a PrepareRequest may ask the DE to allocate for.
MAX_PROMPT_TOKENS = 1 << 24
#: Requests whose cancelled attempt a DE remembers (a PrepareRequest of it that arrives
#: late, after the cancel, is refused): the oldest are forgotten first.
CANCELLED_REMEMBERED = 16384


@dataclass(frozen=True)
class PrepareCall:
    """Node.PrepareRequest as the DE path takes it."""

    request_id: str
    decode_engine_id: str
    prefill_address: str
    prompt_tokens: int
    hit_tokens: int
    payload: Payload
    owner: Identity | None = None
    attempt: int = 0
    decode_read_tokens: int = 0     # this node's part of the hit (node.proto)


@dataclass
class _Result:
    """A finished (or failed) attempt's timings, waiting for the scheduler to record it."""

    attempt: int
    timings: Timings
    sink: str
    expect: str = ""                 # who the sink must be (the request's submitter)


class Decoder(Protocol):
    """An engine's decode of a request whose prompt KV is in its DE-buffer slots."""

    def moves_kv(self, p: Payload) -> bool:
        """Whether ``p``'s prompt KV comes to this node (DE-buffer slots reserved)."""

    def held(self, p: Payload, spans: list[BlockSpan]) -> int:
        """Leading prompt blocks the engine likely holds already (none is sent)."""

    def most_held(self) -> int:
        """A bound on :meth:`held` for any prompt now (a size check before the spans)."""

    async def run(self, st: DecodeState, done: PrefillReport, timings: Timings) -> None:
        """Decode ``st`` (its PE's PrefillDone: ``done``), filling ``timings``; raises
        on failure."""


class DecodePath:
    """The requests a DE node serves."""

    def __init__(self, node: NodeResources, space: KvSpace | None,
                 ranks: dict[str, EngineRank], decoder: Callable[[DecodePath], Decoder]):
        self.node = node
        self.space = space             # a vLLM node's: set once its worker attached
        self.ranks = ranks
        # How a prepared request is decoded once its prompt KV is in: the engine's.
        self.decoder = decoder(self)
        self.requests: dict[str, DecodeState] = {}
        self.assigned: dict[str, int] = {}      # request -> its DE-only assignment's attempt
        # request -> who submitted it (the assignment's word): the identity its sink must
        # answer as when its tokens and results go there ("": the host name is checked)
        self.submitters: dict[str, str] = {}
        self.results: dict[str, _Result] = {}   # waiting for the scheduler's record
        self.reports: set[asyncio.Task] = set()  # sink reports on their way
        self.outbox: dict[str, list[Timings]] = {}   # sink -> reports of this loop turn
        # Dropped states whose tasks have not ended yet (a load may still be writing into
        # its PE's memory): Engine.CancelRequest waits for them, found or not.
        self.ending: dict[str, list[DecodeState]] = {}
        # request -> (the newest attempt a PE cancelled here, that PE's identity): a
        # PrepareRequest of that attempt or an older one from the same PE that arrives
        # after the cancel (it was on its way through a partition, or the PE gave up
        # waiting for its answer) must not prepare a state nobody ends (bounded:
        # CANCELLED_REMEMBERED). Another caller's cancel never refuses a PE's prepare.
        self.cancelled: OrderedDict[str, tuple[int, Identity | None]] = OrderedDict()

    def assign(self, e: EngineRank, a) -> None:
        """Count assignment ``a`` on engine ``e`` (tokens, HBM promised) until it ends; a
        state of an older attempt is dropped."""
        rid = a.request_id
        self.assigned[rid] = max(a.attempt, self.assigned.get(rid, 0))
        self.submitters[rid] = a.submitter_identity
        old = self.requests.get(rid)
        if old is not None and old.attempt <= a.attempt:
            old.sink_identity, old.assigned_here = a.submitter_identity, True
        if old is not None and old.attempt < a.attempt:
            del self.requests[rid]
            self.node.spawn(self._end(old, fence=not old.decoding))
        e.tokens[rid] = a.prompt_tokens
        e.reserved_blocks[rid] = blocks_for(
            a.prompt_tokens + a.max_new_tokens, self.space.fmt.block_tokens)

    def cancel(self, rid: str) -> None:
        """The scheduler cancelled ``rid`` here (or this node lost it): drop its state;
        its PE may still be pushing, so its slots are fenced unless PrefillDone came."""
        self.assigned.pop(rid, None)
        self.submitters.pop(rid, None)
        st = self.requests.pop(rid, None)
        if st is not None:
            self.node.spawn(self._end(st, fence=not st.decoding))

    async def stop(self, rid: str, attempt: int, caller: Identity | None) -> bool:
        """Engine.CancelRequest from the PE that prepared ``rid`` (the servicer checked):
        its writes for ``attempt`` (0 = any) ended; return once this node's writes into
        the PE's memory for it (its loads) ended, whatever became of the state: "not
        known" is never said while a load of a dropped state still writes.

        - held and decoding (PrefillDone came): it is the PE's fence asking about a load
          still writing; the decode goes on, the answer waits for the loads;
        - held otherwise (that attempt or an older one): dropped without a fence, its
          tasks ended;
        - a newer attempt held: left alone;
        - states dropped earlier whose tasks are ending (the scheduler's cancel, a newer
          attempt's PrepareRequest): waited for until released.
        A fence left by an earlier drop of that PE's attempt is released. True when it
        was here (held or still ending). That attempt (when said) is remembered as
        cancelled: its PrepareRequest, should it come later, is refused."""
        self.node.fences.settled(rid, attempt, caller)
        if attempt:
            self._cancelled(rid, attempt, caller)
        st = self.requests.get(rid)
        if st is not None and st.decoding and attempt in (0, st.attempt):
            live = [t for t in st.loads if not t.done()]
            if live:
                await asyncio.wait(live)
            return True
        held = st is not None and (not attempt or attempt >= st.attempt)
        if held:
            del self.requests[rid]
            await self._end(st, fence=False)
        ending = [s for s in self.ending.get(rid, ()) if not attempt or s.attempt <= attempt]
        for s in ending:
            await s.ended.wait()
        if ending:      # an earlier drop fenced its slots once its tasks ended: ours now
            self.node.fences.settled(rid, attempt, caller)
        return held or bool(ending)

    def _cancelled(self, rid: str, attempt: int, caller: Identity | None) -> None:
        old = self.cancelled.pop(rid, None)
        if old is not None and old[1] == caller:
            attempt = max(attempt, old[0])
        self.cancelled[rid] = (attempt, caller)
        while len(self.cancelled) > CANCELLED_REMEMBERED:
            self.cancelled.popitem(last=False)

    def _was_cancelled(self, req: PrepareCall) -> bool:
        """Whether ``req``'s attempt was cancelled here already by the PE asking now."""
        got = self.cancelled.get(req.request_id)
        return bool(req.attempt) and got is not None and req.attempt <= got[0] \
            and got[1] == req.owner

    def state(self, rid: str, attempt: int) -> DecodeState:
        """The state of ``rid`` for a message of ``attempt`` (0 = unsaid): KeyError when
        it was not prepared here, StaleAttempt for an older attempt than the one held."""
        st = self.requests.get(rid)
        held = max(st.attempt if st is not None else 0, self.assigned.get(rid, 0))
        if attempt and attempt < held:
            raise StaleAttempt(f"{rid}: a message of attempt {attempt}; attempt {held} is "
                               "held here")
        if st is None or (attempt and attempt != st.attempt):
            raise KeyError(rid)
        return st

    def claims(self) -> list[tuple[str, EngineRank, bool]]:
        """What this node's engines run, for a registration: (request, engine, whether
        all its prompt KV arrived)."""
        out = []
        for e in self.ranks.values():
            for rid in e.tokens:
                st = self.requests.get(rid)
                out.append((rid, e, st is not None and st.decoding))
        return out

    async def _end(self, st: DecodeState, fence: bool) -> None:
        """Stop ``st``'s tasks; its buffer goes back (or is fenced) once they ended (a
        load's WRITEs still reading the buffer finish first: see kvio.write_layers). A
        cancel of this wait (the node closing) does not cut it short: the release runs
        on every exit, after the tasks."""
        if not st.load_error and not st.decoding:
            st.load_error = "the request was dropped here"    # a watch stops waiting
            st.changed.set()
        live = [t for t in st.tasks if not t.done()]
        for t in live:
            if not t.cancelling():
                t.cancel()
        cancelled = False
        mine = self.ending.setdefault(st.request_id, [])
        mine.append(st)
        try:
            if live:
                cancelled = await waited_out(*live)
            self.release_buffer(st, fence)
        finally:
            mine.remove(st)
            if not mine and self.ending.get(st.request_id) is mine:
                del self.ending[st.request_id]
            st.ended.set()
        if cancelled:
            raise asyncio.CancelledError

    async def prepare(self, req: PrepareCall
                      ) -> tuple[KvPlacement | None, list[int], int, int]:
        """Reserve DE-buffer slots for ``req``'s prompt: the buffer's placement, the
        slots (None, [] for an oracle request), the leading prompt blocks the decode
        instance likely holds already (vLLM's prefix cache; the PE sends none of them)
        and the first block with a slot (those held get none unless this node reads
        part of the hit for the PE: its reads land in its slots)."""
        n = self.node
        e = self.ranks.get(req.decode_engine_id)
        if e is None:
            raise UsageError(f"engine {req.decode_engine_id} is not on node {n.node_id}")
        if not 0 <= req.hit_tokens < req.prompt_tokens <= MAX_PROMPT_TOKENS:
            raise UsageError(f"PrepareRequest: need 0 <= hit_tokens < prompt_tokens <= "
                             f"{MAX_PROMPT_TOKENS}, got {req.hit_tokens}, {req.prompt_tokens}")
        if req.decode_read_tokens > req.hit_tokens:
            raise UsageError(f"PrepareRequest: decode_read_tokens {req.decode_read_tokens} "
                             f"exceeds hit_tokens {req.hit_tokens}")
        if req.prompt_tokens != req.payload.prompt_tokens:
            raise UsageError(f"PrepareRequest: {req.prompt_tokens} prompt tokens but the "
                             f"payload says {req.payload.prompt_tokens}")
        rid = req.request_id
        old = self.requests.get(rid)
        if old is not None and old.owner is not None and old.owner != req.owner:
            raise NotYours(f"request {rid} is prepared here by {old.owner}, not {req.owner}")
        held = max(old.attempt if old is not None else 0, self.assigned.get(rid, 0))
        if req.attempt and req.attempt < held:
            raise StaleAttempt(f"PrepareRequest of {rid} for attempt {req.attempt}; attempt "
                               f"{held} is held here")
        if self._was_cancelled(req):
            raise StaleAttempt(f"PrepareRequest of {rid} for attempt {req.attempt}: its "
                               "prefill node cancelled that attempt here already")
        if old is not None:            # a newer attempt (or the same one again): start over
            del self.requests[rid]
            n.spawn(self._end(old, fence=not old.decoding))
        p = req.payload
        T = self.space.fmt.block_tokens
        moves_kv = self.decoder.moves_kv(p)
        if moves_kv:        # before any per-token work (a 2^24-token prompt's ids, keys)
            nb = blocks_for(req.prompt_tokens, T)
            self.space.pool.check_size(nb if req.decode_read_tokens
                                       else max(1, nb - self.decoder.most_held()))
        spans = block_spans(p.token_ids(req.prompt_tokens, n.tokens), T, p.key_root)
        plan = decode_plan(rid, req.attempt, req.prompt_tokens, T, spans, moves_kv,
                           self.decoder.held(p, spans) if moves_kv else 0,
                           req.decode_read_tokens)
        res = await self.space.pool.reserve(plan.slots) if moves_kv else None
        if self.requests.get(rid) is not None or \
                (req.attempt and req.attempt < self.assigned.get(rid, 0)) or \
                self._was_cancelled(req):
            # Overtaken while waiting for slots (a newer attempt, or a cancel of it).
            if res is not None:
                res.release()
            raise StaleAttempt(f"PrepareRequest of {rid} (attempt {req.attempt}) was "
                               "overtaken while it waited for buffer slots")
        st = DecodeState(rid, e, p, plan, res, req.prefill_address, attempt=req.attempt,
                         owner=req.owner, sink_identity=self.submitters.get(rid, ""),
                         assigned_here=rid in self.submitters)
        if res is not None:
            try:
                st.grant = self.space.grant(n.transfer, str(req.owner or ""), res)
            except BaseException:
                res.release()           # nothing else holds it yet
                raise
        n.metrics.held_by_instance.inc(plan.held)
        self.requests[rid] = st
        if req.decode_read_tokens:  # (an older attempt's expectation ends either way)
            self.space.read_queue.expect(rid, req.decode_read_tokens)
        else:
            self.space.read_queue.forget(rid)
        e.tokens.setdefault(rid, req.prompt_tokens)
        if rid not in self.assigned:
            n.spawn(self._expire_unassigned(st))
        if res is None:
            return None, [], 0, 0
        return self.space.buffer, list(res.slots), plan.held, plan.base

    async def _expire_unassigned(self, st: DecodeState) -> None:
        """A state prepared before the scheduler assigned its request here is dropped
        once ``engine.prepare_ttl_s`` passed with no assignment: a PrepareRequest the
        scheduler never made (a node preparing requests of its own choosing held every
        slot for ever). Its slots are fenced like any drop's until the preparer says its
        writes ended (one whose control port refuses connections is gone)."""
        await asyncio.sleep(self.node.cfg.engine.prepare_ttl_s)
        rid = st.request_id
        if self.requests.get(rid) is not st or rid in self.assigned or st.decoding:
            return
        log.warning("%s: prepared by %s %.0f s ago and never assigned here by the "
                    "scheduler; dropping it", rid, st.owner or st.pe_address,
                    self.node.cfg.engine.prepare_ttl_s)
        self.node.metrics.requests.labels("prepare_expired").inc()
        del self.requests[rid]
        st.engine.tokens.pop(rid, None)
        self.space.read_queue.forget(rid)
        await self._end(st, fence=True)

    async def accept_order(self, order: LoadOrder) -> None:
        """Start a LOAD_HIT_KV order (the DE read path)."""
        st = self.state(order.request_id, order.attempt)
        k = self.space.fmt.units
        if any(len(key) != KEY_BYTES for key in order.keys):
            raise UsageError(f"order for {order.request_id}: block keys are {KEY_BYTES} bytes")
        if len(order.target_units) != len(order.keys) * k:
            raise UsageError(f"order for {len(order.keys)} blocks names "
                             f"{len(order.target_units)} target units, not {len(order.keys) * k}")
        if st.buffer is None or order.first_block + len(order.keys) > len(st.spans):
            raise UsageError(f"{st.request_id}: order for {len(order.keys)} blocks does not fit")
        if st.base:
            raise UsageError(f"{st.request_id}: a read order, but it was prepared with no "
                             f"read here: its first {st.base} blocks have no slots")
        if order.target.fmt != self.space.fmt:
            raise UsageError(f"{st.request_id}: target KV format {order.target.fmt.signature()}"
                             f" is not ours ({self.space.fmt.signature()})")
        # Only into the memory of the node that prepared it: the server at the order's
        # address must be that identity (a node naming another node's address would
        # have this one write into that node's memory, with this node's grants there).
        await self.node.transfer.connect(order.target_peer,
                                         expect=str(st.owner) if st.owner else "")
        # A first connect waits: meanwhile the request may have been dropped here (its PE
        # cancelled it: the PE's memory may already serve another request) or overtaken
        # by a newer attempt. Its load must not start then; checked with no await before
        # the spawn, so a later drop finds the task and waits for it.
        if self.requests.get(order.request_id) is not st or st.load_error:
            raise StaleAttempt(f"{order.request_id} (attempt {st.attempt}) was dropped here "
                               f"while connecting to {order.target_peer}; its load order "
                               "is not carried out")
        t = self.node.spawn(self.load_hit_kv(st, order))
        st.tasks.append(t)
        st.loads.append(t)

    def start_decode(self, st: DecodeState, done: PrefillReport) -> None:
        """The PE finished: decode ``st`` (once)."""
        if st.decoding:
            return
        st.decoding = True
        if st.grant is not None:
            st.grant.close()            # its PE wrote every byte it had to
        if st.request_id in self.submitters:
            st.sink_identity = self.submitters[st.request_id]
            st.assigned_here = True
        st.tasks.append(self.node.spawn(self.decode(st, done)))

    def release_buffer(self, st: DecodeState, fence: bool = False) -> None:
        """``st``'s DE-buffer slots back (or fenced while its PE may still write)."""
        if self.requests.get(st.request_id) in (None, st):
            self.space.read_queue.forget(st.request_id)
        if st.grant is not None:
            st.grant.close()            # a late WRITE of its PE is refused from here
        if st.buffer is None or st.buffer.released:
            return
        if fence:
            self.node.fences.hold(st.pe_address, st.request_id, st.attempt, st.buffer,
                                  writer=st.owner)
        else:
            st.buffer.release()

    def _progress(self, st: DecodeState, layers: int) -> None:
        st.layers_done = layers
        st.changed.set()

    async def load_hit_kv(self, st: DecodeState, order: LoadOrder) -> None:
        """DE read path: hit Full Blocks storage -> DE buffer; per layer DE buffer -> the
        order's target (the PE's engine memory), announcing each layer. Only the leading
        blocks read intact are written (``st.loaded_blocks``); the PE computes the rest."""
        n, space = self.node, self.space
        try:
            first = order.first_block
            got = await space.read(st.request_id, list(order.keys), st.buffer,
                                   list(range(first, first + len(order.keys))))
            n.metrics.read_bytes.inc(got.nbytes)
            usable = min(got.usable, len(order.keys))
            if usable < len(order.keys):
                log.warning("%s: %d of %d hit blocks missing or corrupt in storage; the PE "
                            "computes them", st.request_id, len(order.keys) - usable,
                            len(order.keys))
            st.loaded_blocks = usable
            st.read_bytes, st.read_span = got.nbytes, got.span
            k = space.fmt.units
            await write_layers(n.transfer, order.target_peer, space.buffer,
                               space.buffer_units(st.buffer)[first * k:(first + usable) * k],
                               order.target,
                               order.target_units[:usable * k], 0,
                               usable * space.fmt.block_tokens,
                               on_layer=lambda layers: self._progress(st, layers))
        except BaseException as err:  # reported to the PE through the watch, then re-raised
            st.load_error = f"{type(err).__name__}: {err}"
            log.warning("loading hit KV of %s for %s failed: %s", st.request_id,
                        order.target_peer, st.load_error)
            st.changed.set()
            if not isinstance(err, Exception):
                raise

    async def decode(self, st: DecodeState, done: PrefillReport) -> None:
        n = self.node
        e, p = st.engine, st.payload
        rid = st.request_id
        t0 = time.monotonic()
        spans = [s for s in (done.read_span, st.read_span) if s[0] > 0]
        timings = Timings(rid, e.engine_id, done.prefill_node_id, n.node_id,
                          prefill_read_bytes=done.read_bytes, decode_read_bytes=st.read_bytes,
                          read_span=(min(s[0] for s in spans), max(s[1] for s in spans))
                          if spans else (0.0, 0.0), attempt=st.attempt,
                          phases=done.phases)
        try:
            await self.decoder.run(st, done, timings)
            timings.finish_unix_s = timings.finish_unix_s or clock.unix_now()
            n.metrics.requests.labels("done").inc()
            n.metrics.phase_s.labels("decode").observe(time.monotonic() - t0)
            stage, error = CompletionStage.DECODE_DONE, ""
        except asyncio.CancelledError:
            raise
        except Exception as err:  # noqa: BLE001 - reported, then requeued by the scheduler
            log.error("decode of %s (attempt %d) on %s failed: %s", rid, st.attempt,
                      e.engine_id, err)
            n.metrics.requests.labels("decode_failed").inc()
            timings.failed, timings.error = True, str(err)
            timings.finish_unix_s = clock.unix_now()
            stage, error = CompletionStage.FAILED, str(err)
        finally:
            self.release_buffer(st)
            if self.requests.get(rid) is st:
                del self.requests[rid]
            if self.assigned.get(rid, 0) <= st.attempt:
                self.assigned.pop(rid, None)
                e.tokens.pop(rid, None)
                e.reserved_blocks.pop(rid, None)
        if p.sink:
            self.results[rid] = _Result(st.attempt, timings, p.sink,
                                        self.submitters.get(rid, st.sink_identity))
        if rid not in self.assigned:
            self.submitters.pop(rid, None)
        # A mismatch may be the PE's bytes or our read: no side is blamed alone.
        n.complete(rid, e, stage, error=error,
                   suspect="" if timings.bytes_mismatched else e.engine_id)

    def send_result(self, rid: str, attempt: int) -> None:
        """The scheduler recorded ``attempt`` of ``rid`` (its completion was accepted):
        send its timings to the replay client's sink, in one call with the others
        recorded in this turn of the loop (the leader settles an acknowledgement's
        completions in one go)."""
        r = self.results.pop(rid, None)
        if r is None or (attempt and r.attempt != attempt):
            return
        if not self.outbox:
            asyncio.get_running_loop().call_soon(self._send_reports)
        self.outbox.setdefault((r.sink, r.expect), []).append(r.timings)

    def drop_result(self, rid: str) -> None:
        """The scheduler did not record that completion (a stale attempt): no report."""
        self.results.pop(rid, None)

    def held_requests(self) -> int:
        """States held or still ending here (the idle invariant: none once idle)."""
        return len(self.requests) + sum(map(len, self.ending.values()))

    def dump(self, log_: logging.Logger) -> None:
        """SIGUSR1: each request held here, how far it got."""
        for st in self.requests.values():
            log_.info("request %s: layers_done %d, load_error %r, tasks %s", st.request_id,
                      st.layers_done, st.load_error,
                      [(t.get_name(), t.done()) for t in st.tasks])

    async def flush(self, timeout_s: float) -> None:
        """Wait (bounded) for the sink reports on their way (a graceful stop)."""
        self._send_reports()
        if self.reports:
            await asyncio.wait(list(self.reports), timeout=timeout_s)

    def _send_reports(self) -> None:
        outbox, self.outbox = self.outbox, {}
        for (sink, expect), timings in outbox.items():
            for call in report_calls(timings):
                t = self.node.spawn(self._report(sink, call, expect))
                self.reports.add(t)
                t.add_done_callback(self.reports.discard)

    async def _report(self, sink: str, timings: list[Timings], expect: str = "") -> None:
        try:
            await self.node.peers.report(sink, timings, expect=expect)
        except DualPathError as err:
            log.warning("replay sink %s unreachable for %d results (%s, ...): %s", sink,
                        len(timings), timings[0].request_id, err)
