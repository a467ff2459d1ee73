"""The DE side of a node: one :class:`DecodeState` per request from PrepareRequest to
DECODE_DONE.

PrepareRequest reserves DE-buffer slots (:meth:`DecodePath.prepare`); with the DE read
side the PE's LOAD_HIT_KV order reads the hit blocks from storage into the DE buffer and
writes them, layer by layer, into the PE's HBM (:meth:`DecodePath.load_hit_kv`);
PrefillDone starts decode: every byte of the assembled prompt KV is verified against the
generator (a mismatch fails the request loudly and is counted) -> DE buffer -> DE HBM,
DRAM released -> tokens at the cost model's decode rate -> every new full block
persisted -> DECODE_DONE reported and timings sent to the replay client's sink.

Threads: the node's event loop owns all state; verification runs in
``asyncio.to_thread`` (numpy releases the GIL).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc
import numpy as np

from dualpath.engine.kvplan import BlockSpan, Payload, block_spans, blocks_for
from dualpath.engine.state import RS_DECODE, Engine, RequestFailed, unix_now
from dualpath.errors import UsageError
from dualpath.kv import cost
from dualpath.kv.prefix import block_keys
from dualpath.v1 import node_pb2, node_pb2_grpc, scheduler_pb2

if TYPE_CHECKING:
    from dualpath.engine.node import NodeDaemon

log = logging.getLogger("dualpath.engine")


@dataclass
class DecodeState:
    """A request on this DE from PrepareRequest to its end."""

    request_id: str
    engine: Engine
    payload: Payload
    spans: list[BlockSpan]
    buffer: object | None                       # DE-buffer Reservation
    pe_address: str
    layers_done: int = 0
    load_error: str = ""
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    read_bytes: int = 0
    read_span: tuple[float, float] = (0.0, 0.0)
    tasks: list[asyncio.Task] = field(default_factory=list)


class DecodePath:
    """The requests a DE node serves; owned by its :class:`NodeDaemon`, whose storage
    reader, buffers, TransferEngine and metrics it uses."""

    def __init__(self, node: NodeDaemon):
        self.node = node
        self.requests: dict[str, DecodeState] = {}
        self._order_ids = itertools.count(1)

    def assign(self, e: Engine, a) -> None:
        """Count assignment ``a`` on engine ``e`` (tokens, HBM promised) until it ends."""
        e.tokens[a.request_id] = a.prompt_tokens
        e.reserved_blocks[a.request_id] = blocks_for(
            a.prompt_tokens + a.max_new_tokens, self.node.layout.tokens)

    def cancel(self, rid: str) -> None:
        st = self.requests.pop(rid, None)
        if st is not None:
            for t in st.tasks:
                t.cancel()
            self._release(st)

    async def prepare(self, req) -> list[int]:
        n = self.node
        e = n.by_id.get(req.decode_engine_id)
        if e is None:
            raise UsageError(f"engine {req.decode_engine_id} is not on node {n.node_id}")
        p = Payload.decode(req.payload)
        old = self.requests.pop(req.request_id, None)
        if old is not None:            # a retry after a failed prefill: start over
            for t in old.tasks:
                t.cancel()
            self._release(old)
        prompt = int(req.prompt_tokens)
        spans = block_spans(p.token_ids(prompt), n.layout.tokens)
        res = None if p.oracle else await n.pool.reserve(len(spans))
        st = DecodeState(req.request_id, e, p, spans, res, req.prefill_control_address)
        self.requests[req.request_id] = st
        if req.read_side == RS_DECODE:
            n.pending_reads[req.request_id] = int(req.hit_tokens)
        e.tokens.setdefault(req.request_id, prompt)
        return [] if res is None else [res.offset(i) for i in range(len(spans))]

    async def accept_order(self, st: DecodeState, order) -> int:
        """Start a LOAD_HIT_KV order for ``st``; its order id."""
        await self.node.transfer.connect(st.pe_address)
        st.tasks.append(self.node.spawn(self.load_hit_kv(st, order)))
        return next(self._order_ids)

    def start_decode(self, st: DecodeState, req) -> None:
        """The PE finished: decode ``st`` (``req`` is its PrefillDone)."""
        st.tasks.append(self.node.spawn(self.decode(st, req)))

    def _release(self, st: DecodeState) -> None:
        self.node.pending_reads.pop(st.request_id, None)
        if st.buffer is not None and not st.buffer.released:
            st.buffer.release()

    async def load_hit_kv(self, st: DecodeState, order) -> None:
        """DE read path: hit Full Blocks storage -> DE buffer; per layer DE buffer -> the
        PE's HBM (the order's target slots), announcing each layer."""
        n = self.node
        LB = n.layout.layer_bytes
        nblocks = len(order.block_keys)
        try:
            if nblocks > len(st.spans) or st.buffer is None:
                raise RequestFailed(f"{st.request_id}: order for {nblocks} blocks does not fit")
            st.read_bytes, st.read_span = await n.read_hit_blocks(
                st.request_id, list(order.block_keys),
                [st.buffer.flat(i) for i in range(nblocks)])
            region = order.target_slots[0].region
            for layer in range(n.layout.layers):
                items = [(st.buffer.offset(i) + layer * LB,
                          order.target_slots[i].offset_bytes + layer * LB, LB)
                         for i in range(nblocks)]
                await n.transfer.write(st.pe_address, items, local="de_buffer",
                                       remote=region)
                st.layers_done = layer + 1
                st.changed.set()
        except BaseException as err:  # reported to the PE through the watch, then re-raised
            st.load_error = f"{type(err).__name__}: {err}"
            log.warning("loading hit KV of %s for %s failed: %s", st.request_id,
                        st.pe_address, st.load_error)
            st.changed.set()
            if not isinstance(err, Exception):
                raise

    async def decode(self, st: DecodeState, req) -> None:
        n = self.node
        e, p = st.engine, st.payload
        rid = st.request_id
        t0 = time.monotonic()
        prompt, gen = p.prompt_tokens, p.gen_tokens
        timings = node_pb2.RequestTimings(
            request_id=rid, decode_engine_id=e.engine_id, prefill_node_id=req.prefill_node_id,
            decode_node_id=n.node_id, prefill_read_bytes=req.prefill_read_bytes,
            decode_read_bytes=st.read_bytes)
        spans = [(req.read_start_unix_s, req.read_end_unix_s), st.read_span]
        spans = [s for s in spans if s[0] > 0]
        if spans:
            timings.read_start_unix_s = min(s[0] for s in spans)
            timings.read_end_unix_s = max(s[1] for s in spans)
        T = n.layout.tokens
        hbm = None
        try:
            verified = 0
            if not p.oracle:
                bad = await asyncio.to_thread(self._verify, st)
                nbytes = prompt * n.profile.kv_bytes_per_token
                if bad is not None:
                    n.metrics.mismatched.inc(nbytes)
                    timings.bytes_mismatched = nbytes
                    raise RequestFailed(f"KV MISMATCH in {rid}: {bad}")
                verified = nbytes
                n.metrics.verified.inc(nbytes)
                timings.bytes_verified = verified
            total_blocks = blocks_for(prompt + gen, T)
            hbm = await e.hbm.reserve(total_blocks)
            if st.buffer is not None:
                for i in range(len(st.spans)):
                    np.copyto(hbm.flat(i), st.buffer.flat(i))   # DE buffer -> DE HBM
                self._release(st)
            step = cost.decode_s(n.profile, 1)
            await asyncio.sleep(step)
            timings.first_token_unix_s = unix_now()
            if gen >= 2:
                await asyncio.sleep(step)
                timings.second_token_unix_s = unix_now()
            if gen > 2:
                await asyncio.sleep(cost.decode_s(n.profile, gen - 2))
            if not p.oracle:
                await self._persist(st, hbm, prompt, gen)
            timings.finish_unix_s = unix_now()
            n.metrics.requests.labels("done").inc()
            n.metrics.phase_s.labels("decode").observe(time.monotonic() - t0)
            n.complete(rid, e, scheduler_pb2.COMPLETION_STAGE_DECODE_DONE)
        except asyncio.CancelledError:
            raise
        except Exception as err:  # noqa: BLE001 - reported, then requeued by the scheduler
            log.error("decode of %s on %s failed: %s", rid, e.engine_id, err)
            n.metrics.requests.labels("decode_failed").inc()
            timings.failed, timings.error = True, str(err)
            timings.finish_unix_s = unix_now()
            n.complete(rid, e, scheduler_pb2.COMPLETION_STAGE_FAILED)
        finally:
            if hbm is not None:
                hbm.release()
            self._release(st)
            self.requests.pop(rid, None)
            e.tokens.pop(rid, None)
            e.reserved_blocks.pop(rid, None)
        if p.sink:
            sink = node_pb2_grpc.ReplaySinkStub(n.channels.channel(p.sink))
            try:
                await sink.Report(timings, timeout=10)
            except grpc.aio.AioRpcError as err:
                log.warning("replay sink %s unreachable for %s: %s", p.sink, rid,
                            err.code().name)

    def _verify(self, st: DecodeState) -> str | None:
        """Every byte of the assembled prompt KV against the generator; the first bad
        place as text, or None. Runs on a worker thread (numpy releases the GIL)."""
        layout, synth = self.node.layout, self.node.synth
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

    async def _persist(self, st: DecodeState, hbm, prompt: int, gen: int) -> None:
        """Every full block past the hit prefix: prompt blocks as verified, blocks that
        generated tokens complete as the emulated model's KV."""
        n = self.node
        T = n.layout.tokens
        p = st.payload
        keys = block_keys(p.token_ids(prompt + gen), T)
        for b in range(p.hit_tokens // T, len(keys)):
            if (b + 1) * T > prompt:
                n.synth.fill_full(hbm.flat(b), keys[b])
            await n.store.awrite(keys[b], hbm.flat(b))
            n.metrics.persisted.inc()
