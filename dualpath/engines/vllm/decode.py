"""The decode step of a DE node whose engine is a vLLM decode instance (``kv_consumer``).

DecodePath (paths/decode.py) prepares the request (DE-buffer slots for its prompt),
runs the DE read path's LOAD_HIT_KV orders, and takes PrefillDone; this is what follows
(docs/vllm.md, "Prefill and decode"):

    the leading ``kv_blocks`` prompt blocks in the DE buffer (hit blocks this node read
    or the PE sent, and the blocks the prefill computed) are adopted by the node's
    VllmEngine as committed saves: lookups hit them, loads copy them from DRAM, and they
    are persisted through the storage-NIC limiter (hits already stored are skipped) ->
    one streamed /v1/completions request to the decode instance: its connector finds
    the prompt's blocks, loads them asynchronously (layer by layer from the shared
    buffer), the partial last one too when the PE sent it (else it computes that
    block), computes the first token and generates exactly
    ``gen_tokens`` tokens, persisting every block that fills -> the DRAM copies are let go
    (once persisted) -> the tokens and their logprobs go with the timings.

Threads: the node's event loop.
"""

from __future__ import annotations

import asyncio
import logging

from dualpath import clock
from dualpath.engines.vllm.engine import VllmEngine
from dualpath.engines.vllm.instance import InstanceError, VllmInstance
from dualpath.errors import DualPathError
from dualpath.paths.errors import RequestFailed
from dualpath.paths.peers import PrefillReport, Timings, Top

log = logging.getLogger("dualpath.node")


class VllmDecoder:
    """A vLLM decode node's :class:`~dualpath.paths.decode.Decoder` (see the module
    docstring)."""

    def __init__(self, node, engine: VllmEngine, instance: VllmInstance):
        self.node = node
        self.engine = engine
        self.instance = instance

    def moves_kv(self, p) -> bool:
        """A real engine's decode needs its prompt's KV in any mode (an oracle request
        only skips storage reads)."""
        return True

    async def run(self, st, done: PrefillReport, timings: Timings) -> None:
        p = st.payload
        prompt = p.prompt_tokens
        ids = [int(t) for t in p.token_ids(prompt, self.node.tokens)]
        T = self.engine.space.fmt.block_tokens
        adopted = None
        if st.buffer is not None:
            # The leading blocks the PE completed here: the full ones, and the partial
            # last one when its tokens came too (then the decode instance computes the
            # first token only, else that block with it). Blocks below ``held`` were not
            # sent (the instance holds them): never adopted.
            full = prompt // T
            n = min(done.kv_blocks, full, len(st.spans))
            tail = n == full and min(done.kv_blocks, len(st.spans)) > full
            held = min(st.held, n)
            keys = [s.key for s in st.spans[held:n + tail]]
            at = held - st.base          # block ``held``'s index in the buffer
            if keys and not at:          # its blocks from ``held`` on: the whole of it
                adopted = self.engine.adopt(st.request_id, keys, st.buffer, tail)
            elif keys:
                adopted = self.engine.adopt(st.request_id, keys,
                                            st.buffer.hand_over_range(at, at + len(keys)),
                                            tail)
            if not keys or at:
                st.buffer.release()
            st.buffer = None            # the engine's now (released once persisted)
        # The blocks its instance loads or computes for this request count under its
        # cache salt (instance_cache.py).
        self.engine.salts[st.request_id] = p.cache_salt
        stream = _Streamer(self.node, st, p.sink) \
            if p.stream and p.sink else None
        # The prefill sampled the first token (as a single instance does at the end of
        # its prefill); the decode instance continues after it.
        head: list[int] = []
        head_lps: list[float] = []
        head_top: list[Top] = []
        stops = False
        if done.first_token is not None:
            stops = done.first_token[2]
            head, head_lps = [done.first_token[0]], [done.first_token[1]]
            head_top = [done.first_top] if done.first_top is not None else []
            timings.first_token_unix_s = done.done_unix_s or clock.unix_now()
            if stream is not None:
                stream.grew(head, head_lps, head_top)

        def on_tokens(got: list[int], lps: list[float], top: list[Top]) -> None:
            now = clock.unix_now()
            n = len(head) + len(got)
            if not timings.first_token_unix_s:
                timings.first_token_unix_s = now
            if n >= 2 and not timings.second_token_unix_s:
                timings.second_token_unix_s = now
            if stream is not None:
                stream.grew(head + got, head_lps + lps, head_top + top)

        rest = p.gen_tokens - len(head)
        # vLLM's finish reason: the prefill's when its first token ended the request.
        finish = "stop" if stops else ("length" if rest <= 0 else "")
        try:
            out_ids, out_lps, out_top = [], [], []
            if rest > 0 and not stops:
                out = await self.instance.complete(
                    ids + head, rest, request_id=st.request_id, ticket="",
                    cache_salt=p.cache_salt, tenant=p.tenant,
                    temperature=p.temperature, top_p=p.top_p, seed=p.seed,
                    ignore_eos=p.ignore_eos, sampling=rest_sampling(p.sampling, len(head)),
                    on_tokens=on_tokens)
                out_ids, out_lps, out_top = out.token_ids, out.logprobs, out.top
                finish = out.finish_reason or finish
        except InstanceError as e:
            if e.unreachable:
                self.instance.mark_down(str(e))
            raise RequestFailed(f"decode instance: {e}") from None
        finally:
            self.engine.salts.pop(st.request_id, None)
            if adopted is not None:
                self.engine.release_adopted(adopted)
            if stream is not None:
                await stream.close()
        timings.output_token_ids = tuple(head + out_ids)
        timings.output_logprobs = tuple(head_lps + out_lps)
        timings.output_top = tuple(head_top + out_top)
        timings.finish_reason = finish

    def held(self, p, spans) -> int:
        """The leading full prompt blocks (of ``spans``) the decode instance likely holds
        in its own prefix cache (0 when it is off, or for an oracle request)."""
        cache = self.engine.instance_cache
        if cache is None or p.oracle:
            return 0
        full = p.prompt_tokens // self.engine.space.fmt.block_tokens
        return cache.leading(p.cache_salt, [s.key for s in spans[:full]])

    def most_held(self) -> int:
        """The hint's keys: it never says more leading blocks than it holds."""
        cache = self.engine.instance_cache
        return 0 if cache is None else len(cache)


def rest_sampling(s: dict, head: int) -> dict:
    """The request's sampling for the decode instance, which continues after the ``head``
    tokens the prefill sampled: min_tokens counts them. (vLLM's presence and frequency
    penalties count output tokens: the decode instance sees the first token as prompt.)"""
    if s.get("min_tokens"):
        return {**s, "min_tokens": max(0, s["min_tokens"] - head)}
    return s


class _Streamer:
    """Sends a request's tokens to its sink as they grow (ReplaySink.Partial), one call
    at a time, coalescing what arrived meanwhile; best effort (Report has them all)."""

    def __init__(self, node, st, sink: str):
        self.node, self.request_id, self.attempt, self.sink = node, st.request_id, \
            st.attempt, sink
        self.st = st                        # its sink_identity: who the sink must be
        self.ids: list[int] = []
        self.lps: list[float] = []
        self.top: list[Top] = []
        self.sent = 0
        self.more = asyncio.Event()
        self.done = False
        self.task = asyncio.ensure_future(self._run())

    def grew(self, ids: list[int], lps: list[float], top: list[Top]) -> None:
        self.ids, self.lps, self.top = ids, lps, top
        self.more.set()

    async def _run(self) -> None:
        warned = False
        while True:
            await self.more.wait()
            self.more.clear()
            n = len(self.ids)
            if not self.st.assigned_here:   # not assigned here (yet): nothing is sent
                if self.done:
                    return
                await asyncio.sleep(0.05)
                self.more.set()
                continue
            if n > self.sent:
                try:
                    await self.node.peers.partial(self.sink, self.request_id, self.attempt,
                                                  self.sent, self.ids[self.sent:n],
                                                  self.lps[self.sent:n],
                                                  self.top[self.sent:n],
                                                  expect=self.st.sink_identity)
                except DualPathError as e:
                    if not warned:
                        warned = True
                        log.warning("streaming %s to %s: %s", self.request_id, self.sink, e)
                self.sent = n
            if self.done and self.sent >= len(self.ids):
                return

    async def close(self) -> None:
        self.done = True
        self.more.set()
        try:
            await asyncio.wait_for(asyncio.shield(self.task), 10)
        except TimeoutError:
            self.task.cancel()
        except asyncio.CancelledError:
            self.task.cancel()
            raise
