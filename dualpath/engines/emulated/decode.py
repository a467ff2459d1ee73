"""The emulated engine's decode, the :class:`~dualpath.paths.decode.Decoder` of an
emulated DE node: every byte of the assembled prompt KV verified against the generator
(a mismatch fails the request loudly and is counted) -> DE buffer -> DE HBM, DRAM
released -> the tokens after the prefill's first from the engine's decode batch
(decode_batch.py: every request of the engine joins every step, a step's time grows with
the batch's KV) -> every new full block persisted as it fills (dualpath/paths/
writeback.py), the request's last token timed before its last blocks are on disk.

Threads: the node's event loop; verification and copies in ``asyncio.to_thread`` /
the default executor (numpy releases the GIL).
"""

from __future__ import annotations

import asyncio

import numpy as np

from dualpath import clock
from dualpath.aio import to_the_end
from dualpath.buffers.pool import Reservation
from dualpath.engines.emulated.decode_batch import DecodeBatch
from dualpath.engines.emulated.engine import EmulatedEngine
from dualpath.kv.prefix import block_keys
from dualpath.paths.decode import DecodePath, DecodeState
from dualpath.paths.errors import RequestFailed
from dualpath.paths.kvplan import BlockSpan, blocks_for
from dualpath.paths.payload import Payload
from dualpath.paths.peers import PrefillReport, Timings
from dualpath.paths.ranks import EngineRank


async def _off_loop(fn) -> None:
    """Run ``fn`` (a copy) on a worker thread, off the event loop. A cancellation waits
    for it to end before it goes on: the caller frees the memory it writes into as it
    unwinds."""
    await to_the_end(asyncio.get_running_loop().run_in_executor(None, fn))


class EmulatedDecoder:
    """How an emulated DE decodes a request whose prompt KV is in (``path``'s state)."""

    def __init__(self, path: DecodePath, engine: EmulatedEngine):
        self.path = path
        self.engine = engine
        self.batches: dict[str, DecodeBatch] = {}  # engine -> its decode batch

    def moves_kv(self, p: Payload) -> bool:
        """An emulated oracle moves no KV (its hit is "in HBM")."""
        return not p.oracle

    def held(self, p: Payload, spans: list[BlockSpan]) -> int:
        """An emulated engine keeps no prefix cache of its own: nothing held."""
        return 0

    def most_held(self) -> int:
        return 0

    async def run(self, st: DecodeState, done: PrefillReport, timings: Timings) -> None:
        """Verify every prompt byte, DE buffer -> DE HBM, then the tokens after the
        prefill's first from this engine's decode batch (one per step, a step as long as
        the cost model says for the whole batch). Every new full block goes to the
        node's write-back (paths/writeback.py) as it fills: the prompt's from their
        DE-buffer slots, the generated ones copied into slots of their own. The last
        token is timed at once (the writes are outside the request's latency), and the
        request completes once its blocks are written, so its agent's next round finds
        them stored. The write-back is paced by the storage NIC's write direction, a
        request's blocks ranked by how many it writes (fewest first), so a first round's
        whole prompt does not hold up other agents' next rounds (docs/e2e.md)."""
        path, eng = self.path, self.engine
        n, space = path.node, path.space
        e, p = st.engine, st.payload
        rid = st.request_id
        prompt, gen = p.prompt_tokens, p.gen_tokens
        T = space.fmt.block_tokens
        wb = space.writeback
        hbm = stager = None
        written: list[asyncio.Future] = []      # this request's blocks, once on disk
        try:
            nbytes = prompt * space.layout.layers * space.layout.token_bytes
            if not p.oracle and not eng.verifies(rid):
                n.metrics.unverified.inc(nbytes)       # sampled out (engine.verify_fraction)
            elif not p.oracle:
                bad = await asyncio.to_thread(self._verify, st)
                if bad is not None:
                    n.metrics.mismatched.inc(nbytes)
                    timings.bytes_mismatched = nbytes
                    raise RequestFailed(f"KV MISMATCH in {rid}: {bad}")
                n.metrics.verified.inc(nbytes)
                timings.bytes_verified = nbytes
            hbm = await e.hbm.reserve(blocks_for(prompt + gen, T))
            # Every full block from the first token the PE computed (past the hit, or
            # from its first missing or corrupt block: cached again).
            keys = [] if p.oracle or wb is None else \
                block_keys(p.token_ids(prompt + gen, n.tokens), T, p.key_root)
            nxt = min(done.computed_from_tokens, p.hit_tokens) // T
            rank = max(len(keys) - nxt, 0)      # the blocks this request writes
            if st.buffer is not None:
                buf, spans = st.buffer, len(st.spans)

                def copy_in() -> None:                  # DE buffer -> DE HBM
                    for i in range(spans):
                        np.copyto(hbm.flat(i), buf.flat(i))
                await _off_loop(copy_in)
                # The prompt's own full blocks persist from where they are.
                whole = range(nxt, min(prompt // T, len(keys)))
                for i, slot in zip(whole, buf.hand_over(whole)):
                    written.append(wb.add(keys[i], slot, rank))
                nxt = max(nxt, whole.stop)
                path.release_buffer(st)
            full: asyncio.Queue[int | None] = asyncio.Queue()
            stager = asyncio.ensure_future(self._stage_blocks(hbm, keys, full, written,
                                                               rank))

            def filled(tokens: int) -> None:        # blocks whose every token's KV exists
                nonlocal nxt
                while nxt < len(keys) and (nxt + 1) * T <= tokens:
                    full.put_nowait(nxt)
                    nxt += 1

            def on_token(k: int) -> None:
                if k == 1:
                    timings.second_token_unix_s = clock.unix_now()
                filled(prompt + k)

            filled(prompt)
            # The prefill made the first token (its last layer's output), as a P/D
            # prefill instance does; the decode steps make the rest.
            timings.first_token_unix_s = done.done_unix_s or clock.unix_now()
            await self._batch(e).generate(prompt, gen - 1, on_token)
            timings.finish_unix_s = clock.unix_now()
            filled(len(keys) * T)
            full.put_nowait(None)
            await stager
            hbm.release()
            # The agent's next round reads this KV: the request ends once it is stored.
            await asyncio.gather(*written)
        finally:
            if stager is not None and not stager.done():
                stager.cancel()
                await asyncio.gather(stager, return_exceptions=True)
            if hbm is not None:
                hbm.release()

    def _batch(self, e: EngineRank) -> DecodeBatch:
        """Engine ``e``'s decode batch (made on first use)."""
        b = self.batches.get(e.engine_id)
        if b is None:
            b = self.batches[e.engine_id] = DecodeBatch(self.engine.decode_step_s)
        return b

    def _verify(self, st: DecodeState) -> str | None:
        """Every byte of the assembled prompt KV against the generator; the first bad
        place as text, or None. Runs on a worker thread (numpy releases the GIL)."""
        with self.engine.spent("verify"):
            return self._first_mismatch(st)

    def _first_mismatch(self, st: DecodeState) -> str | None:
        layout, synth = self.path.space.layout, self.engine.synth
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

    async def _stage_blocks(self, hbm: Reservation, keys: list[bytes],
                            full: asyncio.Queue, written: list[asyncio.Future],
                            rank: int) -> None:
        """Blocks of ``hbm`` whose indices arrive on ``full`` (None ends), completed by
        generated tokens: the emulated model's KV for each, copied into a DE-buffer slot
        of its own and handed to the write-back (waiting for a slot, never for the
        disk or the storage NIC)."""
        wb, pool = self.path.space.writeback, self.path.space.pool
        while (b := await full.get()) is not None:
            self.engine.fill_block(hbm.flat(b), keys[b])
            slot = await pool.reserve(1)
            np.copyto(slot.flat(0), hbm.flat(b))
            written.append(wb.add(keys[b], slot, rank))
