"""The DE side of a node: one :class:`DecodeState` per request from PrepareRequest to
DECODE_DONE.

PrepareRequest reserves DE-buffer slots (:meth:`DecodePath.prepare`); with the DE read
side the PE's LOAD_HIT_KV order reads the hit blocks from storage into the DE buffer and
writes them, layer by layer, into the PE's engine memory (:meth:`DecodePath.load_hit_kv`,
the order's target placement); PrefillDone starts decode: every byte of the assembled
prompt KV is verified against the generator (a mismatch fails the request loudly and is
counted) -> DE buffer -> DE HBM, DRAM released -> tokens at the cost model's decode rate
-> every new full block persisted -> DECODE_DONE reported and timings sent to the replay
client's sink.

Threads: the node's event loop owns all state; verification runs in
``asyncio.to_thread`` (numpy releases the GIL).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import numpy as np

from dualpath import clock
from dualpath.buffers.pool import Reservation
from dualpath.engine.emulated import EmulatedEngine, EngineRank
from dualpath.engine.errors import RequestFailed
from dualpath.engine.kvio import write_layers
from dualpath.engine.kvplan import BlockSpan, block_spans, blocks_for
from dualpath.engine.kvspace import KvSpace
from dualpath.engine.payload import Payload
from dualpath.engine.peers import LoadOrder, PrefillReport, Timings
from dualpath.engine.resources import NodeResources
from dualpath.engine.roles import RS_DECODE
from dualpath.errors import DualPathError, UsageError
from dualpath.kv.placement import KvPlacement
from dualpath.kv.prefix import KEY_BYTES, block_keys
from dualpath.tls import Identity
from dualpath.v1 import scheduler_pb2

log = logging.getLogger("dualpath.engine")


@dataclass
class DecodeState:
    """A request on this DE from PrepareRequest to its end."""

    request_id: str
    engine: EngineRank
    payload: Payload
    spans: list[BlockSpan]
    buffer: Reservation | None                  # DE-buffer slots (None: oracle)
    pe_address: str
    layers_done: int = 0
    load_error: str = ""
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    read_bytes: int = 0
    read_span: tuple[float, float] = (0.0, 0.0)
    tasks: list[asyncio.Task] = field(default_factory=list)
    owner: Identity | None = None               # the node that prepared it (mutual TLS)


class NotYours(RequestFailed):
    """A request prepared here by one node, touched by another (PERMISSION_DENIED)."""


#: Bounds on what a PrepareRequest may ask the DE to allocate for.
MAX_PROMPT_TOKENS = 1 << 24


@dataclass(frozen=True)
class PrepareCall:
    """Node.PrepareRequest as the DE path takes it."""

    request_id: str
    decode_engine_id: str
    prefill_address: str
    prompt_tokens: int
    hit_tokens: int
    read_side: int
    payload: Payload
    owner: Identity | None = None


class DecodePath:
    """The requests a DE node serves."""

    def __init__(self, node: NodeResources, space: KvSpace, engine: EmulatedEngine,
                 ranks: dict[str, EngineRank]):
        self.node = node
        self.space = space
        self.engine = engine
        self.ranks = ranks
        self.requests: dict[str, DecodeState] = {}

    def assign(self, e: EngineRank, a) -> None:
        """Count assignment ``a`` on engine ``e`` (tokens, HBM promised) until it ends."""
        e.tokens[a.request_id] = a.prompt_tokens
        e.reserved_blocks[a.request_id] = blocks_for(
            a.prompt_tokens + a.max_new_tokens, self.space.fmt.block_tokens)

    def cancel(self, rid: str) -> None:
        st = self.requests.pop(rid, None)
        if st is not None:
            self._drop(st)

    def _drop(self, st: DecodeState) -> None:
        """Stop ``st``'s tasks; its buffer goes back once they have ended (a load's
        WRITEs still reading the buffer finish first: see kvio.write_layers)."""
        live = [t for t in st.tasks if not t.done()]
        for t in live:
            t.cancel()
        if not live:
            self._release(st)
            return

        async def release_after() -> None:
            await asyncio.gather(*live, return_exceptions=True)
            self._release(st)
        self.node.spawn(release_after())

    async def prepare(self, req: PrepareCall) -> tuple[KvPlacement | None, list[int]]:
        """Reserve DE-buffer slots for ``req``'s prompt: the buffer's placement and the
        slots (None, [] for an oracle request)."""
        n = self.node
        e = self.ranks.get(req.decode_engine_id)
        if e is None:
            raise UsageError(f"engine {req.decode_engine_id} is not on node {n.node_id}")
        if not 0 <= req.hit_tokens < req.prompt_tokens <= MAX_PROMPT_TOKENS:
            raise UsageError(f"PrepareRequest: need 0 <= hit_tokens < prompt_tokens <= "
                             f"{MAX_PROMPT_TOKENS}, got {req.hit_tokens}, {req.prompt_tokens}")
        if req.prompt_tokens != req.payload.prompt_tokens:
            raise UsageError(f"PrepareRequest: {req.prompt_tokens} prompt tokens but the "
                             f"payload says {req.payload.prompt_tokens}")
        old = self.requests.get(req.request_id)
        if old is not None and old.owner is not None and old.owner != req.owner:
            raise NotYours(f"request {req.request_id} is prepared here by {old.owner}, "
                           f"not {req.owner}")
        if old is not None:            # a retry after a failed prefill: start over
            del self.requests[req.request_id]
            self._drop(old)
        p = req.payload
        spans = block_spans(p.token_ids(req.prompt_tokens, n.tokens),
                            self.space.fmt.block_tokens)
        res = None if p.oracle else await self.space.pool.reserve(len(spans))
        st = DecodeState(req.request_id, e, p, spans, res, req.prefill_address,
                         owner=req.owner)
        self.requests[req.request_id] = st
        if req.read_side == RS_DECODE:
            self.space.read_queue.expect(req.request_id, req.hit_tokens)
        e.tokens.setdefault(req.request_id, req.prompt_tokens)
        if res is None:
            return None, []
        return self.space.buffer, list(res.slots)

    async def accept_order(self, order: LoadOrder) -> None:
        """Start a LOAD_HIT_KV order (the DE read path)."""
        st = self.requests.get(order.request_id)
        if st is None:
            raise KeyError(order.request_id)
        k = self.space.fmt.units
        if any(len(key) != KEY_BYTES for key in order.keys):
            raise UsageError(f"order for {order.request_id}: block keys are {KEY_BYTES} bytes")
        if len(order.target_units) != len(order.keys) * k:
            raise UsageError(f"order for {len(order.keys)} blocks names "
                             f"{len(order.target_units)} target units, not {len(order.keys) * k}")
        if st.buffer is None or len(order.keys) > len(st.spans):
            raise UsageError(f"{st.request_id}: order for {len(order.keys)} blocks does not fit")
        if order.target.fmt != self.space.fmt:
            raise UsageError(f"{st.request_id}: target KV format {order.target.fmt.signature()}"
                             f" is not ours ({self.space.fmt.signature()})")
        await self.node.transfer.connect(order.target_peer)
        st.tasks.append(self.node.spawn(self.load_hit_kv(st, order)))

    def start_decode(self, st: DecodeState, done: PrefillReport) -> None:
        """The PE finished: decode ``st``."""
        st.tasks.append(self.node.spawn(self.decode(st, done)))

    def _release(self, st: DecodeState) -> None:
        self.space.read_queue.forget(st.request_id)
        if st.buffer is not None and not st.buffer.released:
            st.buffer.release()

    def _progress(self, st: DecodeState, layers: int) -> None:
        st.layers_done = layers
        st.changed.set()

    async def load_hit_kv(self, st: DecodeState, order: LoadOrder) -> None:
        """DE read path: hit Full Blocks storage -> DE buffer; per layer DE buffer -> the
        order's target (the PE's engine memory), announcing each layer."""
        n, space = self.node, self.space
        nblocks = len(order.keys)
        try:
            got = await space.read(st.request_id, list(order.keys), st.buffer)
            n.metrics.read_bytes.inc(got.nbytes)
            if not got.complete:
                raise RequestFailed(f"{st.request_id}: {got.blocks - got.usable} of "
                                    f"{got.blocks} hit blocks missing from storage")
            st.read_bytes, st.read_span = got.nbytes, got.span
            k = space.fmt.units
            await write_layers(n.transfer, order.target_peer, space.buffer,
                               space.buffer_units(st.buffer)[:nblocks * k], order.target,
                               order.target_units, 0, nblocks * space.fmt.block_tokens,
                               on_layer=lambda layers: self._progress(st, layers))
        except BaseException as err:  # reported to the PE through the watch, then re-raised
            st.load_error = f"{type(err).__name__}: {err}"
            log.warning("loading hit KV of %s for %s failed: %s", st.request_id,
                        order.target_peer, st.load_error)
            st.changed.set()
            if not isinstance(err, Exception):
                raise

    async def decode(self, st: DecodeState, done: PrefillReport) -> None:
        n, eng = self.node, self.engine
        e, p = st.engine, st.payload
        rid = st.request_id
        t0 = time.monotonic()
        prompt, gen = p.prompt_tokens, p.gen_tokens
        spans = [s for s in (done.read_span, st.read_span) if s[0] > 0]
        timings = Timings(rid, e.engine_id, done.prefill_node_id, n.node_id,
                          prefill_read_bytes=done.read_bytes, decode_read_bytes=st.read_bytes,
                          read_span=(min(s[0] for s in spans), max(s[1] for s in spans))
                          if spans else (0.0, 0.0))
        T = self.space.fmt.block_tokens
        hbm = None
        try:
            if not p.oracle:
                bad = await asyncio.to_thread(self._verify, st)
                nbytes = prompt * self.space.layout.layers * self.space.layout.token_bytes
                if bad is not None:
                    n.metrics.mismatched.inc(nbytes)
                    timings.bytes_mismatched = nbytes
                    raise RequestFailed(f"KV MISMATCH in {rid}: {bad}")
                n.metrics.verified.inc(nbytes)
                timings.bytes_verified = nbytes
            hbm = await e.hbm.reserve(blocks_for(prompt + gen, T))
            if st.buffer is not None:
                for i in range(len(st.spans)):
                    np.copyto(hbm.flat(i), st.buffer.flat(i))   # DE buffer -> DE HBM
                self._release(st)
            step = eng.decode_s(1)
            await asyncio.sleep(step)
            timings.first_token_unix_s = clock.unix_now()
            if gen >= 2:
                await asyncio.sleep(step)
                timings.second_token_unix_s = clock.unix_now()
            if gen > 2:
                await asyncio.sleep(eng.decode_s(gen - 2))
            if not p.oracle:
                await self._persist(st, hbm, prompt, gen)
            timings.finish_unix_s = clock.unix_now()
            n.metrics.requests.labels("done").inc()
            n.metrics.phase_s.labels("decode").observe(time.monotonic() - t0)
            n.complete(rid, e, scheduler_pb2.COMPLETION_STAGE_DECODE_DONE)
        except asyncio.CancelledError:
            raise
        except Exception as err:  # noqa: BLE001 - reported, then requeued by the scheduler
            log.error("decode of %s on %s failed: %s", rid, e.engine_id, err)
            n.metrics.requests.labels("decode_failed").inc()
            timings.failed, timings.error = True, str(err)
            timings.finish_unix_s = clock.unix_now()
            n.complete(rid, e, scheduler_pb2.COMPLETION_STAGE_FAILED)
        finally:
            if hbm is not None:
                hbm.release()
            self._release(st)
            self.requests.pop(rid, None)
            e.tokens.pop(rid, None)
            e.reserved_blocks.pop(rid, None)
        if p.sink:
            try:
                await n.peers.report(p.sink, timings)
            except DualPathError as err:
                log.warning("replay sink %s unreachable for %s: %s", p.sink, rid, err)

    def _verify(self, st: DecodeState) -> str | None:
        """Every byte of the assembled prompt KV against the generator; the first bad
        place as text, or None. Runs on a worker thread (numpy releases the GIL)."""
        layout, synth = self.space.layout, self.engine.synth
        LB, TB = layout.layer_bytes, layout.token_bytes
        for i, span in enumerate(st.spans):
            flat = st.buffer.flat(i)
            if span.tokens == layout.tokens:
                m = synth.verify_full(flat, span.key)
                if m is not None:
                    return f"block {i}: {m}"
                continue
            for layer in range(layout.layers):
                m = synth.verify_layer(flat[layer * LB: layer * LB + span.tokens * TB],
                                       span.key, layer, 0)
                if m is not None:
                    return f"block {i} (partial, {span.tokens} tokens): {m}"
        return None

    async def _persist(self, st: DecodeState, hbm: Reservation, prompt: int, gen: int) -> None:
        """Every full block past the hit prefix: prompt blocks as verified, blocks that
        generated tokens complete as the emulated model's KV."""
        T = self.space.fmt.block_tokens
        p = st.payload
        keys = block_keys(p.token_ids(prompt + gen, self.node.tokens), T)
        for b in range(p.hit_tokens // T, len(keys)):
            if (b + 1) * T > prompt:
                self.engine.fill_block(hbm.flat(b), keys[b])
            await self.space.store.awrite(keys[b], hbm.flat(b))
            self.node.metrics.persisted.inc()
