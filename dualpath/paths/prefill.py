"""The PE side of a node: one prefill per assigned request, whatever the engine.

The skeleton every engine's prefill runs in (an engine's :meth:`PrefillPath.prefill`:
dualpath/engines/emulated/prefill.py, dualpath/engines/vllm/prefill.py):

    assigned -> the request's read queue expectation (the hit tokens this node reads)
    -> one task per (request, attempt), under the engine's concurrent-prefill slots:
       the engine's prefill (DE prepared, the hit staged in PE-buffer slots, the
       forward, the prompt's KV on to the DE buffer, PrefillDone)
    -> PREFILL_DONE reported (FAILED on any error: requeued, with the error and the
       engine to blame: the DE for what it or the way to it did, this engine for the
       rest)

Attempts (docs/reliability.md): every message to the DE names the assignment's attempt;
a newer attempt of a request running here starts once the old one's task ended. A
prefill that ends without PrefillDone tells the DE (Engine.CancelRequest), after its own
writes ended; its PE-buffer slots, if a LOAD_HIT_KV order may still be writing into
them, go back only when the DE answered that (paths/fence.py).

Degrade, don't fail: hit blocks missing or corrupt in storage are computed like miss
tokens, from the first bad block on (:meth:`PrefillPath._usable`).

Threads: the node's event loop only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace

from dualpath import clock
from dualpath.aio import to_the_end
from dualpath.buffers.pool import PoolTooSmall
from dualpath.paths.assignment import Assignment, split_blocks
from dualpath.paths.errors import NeverFits, NotYours, PeerUnavailable
from dualpath.paths.kvplan import PrefillPlan, block_spans
from dualpath.paths.kvspace import KvSpace
from dualpath.paths.peers import PrefillReport
from dualpath.paths.ranks import EngineRank
from dualpath.paths.resources import NodeResources
from dualpath.roles import CompletionStage

log = logging.getLogger("dualpath.node")


class PrefillPath:
    """The prefills running on a PE node: one task per (request, attempt); the newest
    attempt of each request is ``tasks[rid]``. An engine subclasses it with its
    :meth:`prefill`."""

    def __init__(self, node: NodeResources, space: KvSpace | None):
        self.node = node
        self.space = space             # a vLLM node's: set once its worker attached
        self.tasks: dict[str, asyncio.Task] = {}    # request -> its newest prefill
        self.current: dict[str, tuple[int, EngineRank]] = {}   # request -> attempt, engine
        # (request, attempt) -> the identity of its DE's node: the only peer that may
        # stop that attempt here (Engine.CancelRequest; "": plaintext)
        self.decoders: dict[tuple[str, int], str] = {}
        self.runs: dict[tuple[str, int], asyncio.Task] = {}    # every live prefill

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
        # Whoever answers at the DE's address must be the node that registered its group.
        self.node.peers.expect(a.decode_address, a.decode_identity)
        # The read queue counts this node's part from the assignment on (the plan, with
        # the prompt's blocks, is made when the attempt runs).
        tokens = self._parts(a)[0] * self.space.fmt.block_tokens
        if tokens:                  # (an older attempt's expectation ends either way)
            self.space.read_queue.expect(rid, tokens)
        else:
            self.space.read_queue.forget(rid)
        t = self.node.spawn(self._prefill(e, a, old))
        self.tasks[rid] = self.runs[(rid, a.attempt)] = t
        self.current[rid] = (a.attempt, e)
        self.decoders[(rid, a.attempt)] = a.decode_identity

    def cancel(self, rid: str) -> None:
        """Stop every attempt of ``rid`` here (the scheduler cancelled it)."""
        for (r, _), t in list(self.runs.items()):
            if r == rid:
                _cancel_once(t)

    async def stop(self, rid: str, attempt: int, caller=None) -> bool:
        """Engine.CancelRequest from the DE: stop the attempts of ``rid`` up to
        ``attempt`` (0 = all) and return once their tasks ended, so none of their writes
        is on its way any more. A newer attempt running here is left alone. True when
        there was one to stop. ``caller`` must be the DE node the scheduler assigned
        the request to (NotYours otherwise: another node cannot stop it)."""
        ts = [(att, t) for (r, att), t in self.runs.items()
              if r == rid and (not attempt or att <= attempt)]
        for att, _ in ts:
            want = self.decoders.get((rid, att), "")
            if caller is not None and want and str(caller) != want:
                raise NotYours(f"request {rid} (attempt {att}) is decoded by {want}; "
                               f"{caller} may not stop its prefill")
        ts = [t for _, t in ts]
        for t in ts:
            _cancel_once(t)
        if ts:
            await asyncio.wait(ts)
        return bool(ts)

    def claims(self) -> list[tuple[str, EngineRank, bool]]:
        """What this node's engines run, for a registration: (request, engine, False)."""
        return [(rid, e, False) for rid, (_, e) in self.current.items()]

    def held_requests(self) -> int:
        """Attempts running here (the idle invariant: none once idle)."""
        return len(self.runs)

    async def flush(self, timeout_s: float) -> None:
        """A graceful stop: nothing of a prefill waits to be sent (its reports go to
        the DE inside the attempt)."""

    def dump(self, log_: logging.Logger) -> None:
        """SIGUSR1: the attempts running here."""
        for (rid, attempt), t in self.runs.items():
            log_.info("prefill %s (attempt %d): done %s", rid, attempt, t.done())

    def _parts(self, a: Assignment) -> tuple[int, int]:
        """(blocks this PE reads, blocks the DE reads) of ``a``'s hit: its full blocks
        short of the last prompt token, none for an oracle request; a split read
        (the scheduler's, or the "split" policy's halves) reads a part on each side."""
        p, T = a.payload, self.space.fmt.block_tokens
        hit = 0 if p.oracle else min(a.hit_tokens // T, (a.prompt_tokens - 1) // T)
        return split_blocks(p.read_policy, a.read_side, hit, a.prefill_read_tokens,
                            a.decode_read_tokens, T)

    def plan(self, a: Assignment) -> PrefillPlan:
        """``a``'s KV plan here (pure; once per attempt, when it runs)."""
        T = self.space.fmt.block_tokens
        local, remote = self._parts(a)
        ids = a.payload.token_ids(a.prompt_tokens, self.node.tokens)
        spans = tuple(block_spans(ids, T, a.payload.key_root))
        return PrefillPlan(a.request_id, a.prompt_tokens, T, spans,
                           local, remote, ids)

    async def _prefill(self, e: EngineRank, a: Assignment,
                       after: asyncio.Task | None) -> None:
        n = self.node
        rid = a.request_id
        me = asyncio.current_task()
        t0 = time.monotonic()
        try:
            if after is not None:         # the older attempt's writes end first
                await asyncio.wait([after])
            async with e.slots:
                await self.prefill(e, a, self.plan(a))
            n.complete(rid, e, CompletionStage.PREFILL_DONE)
            n.metrics.phase_s.labels("prefill").observe(time.monotonic() - t0)
        except asyncio.CancelledError:
            raise
        except Exception as err:  # noqa: BLE001 - any failure requeues the request
            log.warning("prefill of %s (attempt %d) on %s failed: %s", rid, a.attempt,
                        e.engine_id, err)
            n.metrics.requests.labels("prefill_failed").inc()
            n.complete(rid, e, CompletionStage.FAILED, error=str(err),
                       suspect=a.decode_engine_id if isinstance(err, PeerUnavailable)
                       else e.engine_id, final=isinstance(err, (NeverFits, PoolTooSmall)))
        finally:
            self.runs.pop((rid, a.attempt), None)
            self.decoders.pop((rid, a.attempt), None)
            if self.tasks.get(rid) is me:
                del self.tasks[rid], self.current[rid]
                e.tokens.pop(rid, None)
                self.space.read_queue.forget(rid)

    async def prefill(self, e: EngineRank, a: Assignment, plan: PrefillPlan) -> None:
        """Prefill ``a`` on ``e`` by ``plan`` (the engine's: dualpath/engines/); raises on failure,
        after every WRITE it started has finished (none still reads or writes its
        memory, or the memory is fenced until the DE says its writes ended)."""
        raise NotImplementedError

    async def _end_attempt(self, de: str, rid: str, attempt: int, prepared: bool,
                           finished: bool, request_finished) -> None:
        """The end of an attempt, whatever cancels it meanwhile: ``request_finished``
        (the engine's release of what the attempt held, told whether the DE must hear
        it did not finish) runs to its end (a scheduler cancel landing while the DE is told would
        leak the slots for good). A PrepareRequest that never answered (it failed, or
        we were cancelled while it was on its way) may still reach the DE and prepare a
        state nobody ends: the DE refuses it once it knows the attempt cancelled, told
        in the background (nothing here waits for it)."""
        n = self.node
        if not prepared and not finished:
            n.spawn(n.peers.cancel_until_answered(de, rid, attempt))
        await to_the_end(request_finished(prepared and not finished))

    def _usable(self, rid: str, usable: int, hit_blocks: int, T: int) -> int:
        """The first token to compute: the hit, or where its first bad block begins."""
        usable = min(usable, hit_blocks)
        if usable < hit_blocks:
            log.warning("%s: %d of %d hit blocks missing or corrupt in storage; computing "
                        "them", rid, hit_blocks - usable, hit_blocks)
            self.node.metrics.recomputed_blocks.inc(hit_blocks - usable)
        return usable * T

    async def _done(self, de: str, r: PrefillReport) -> None:
        await self.node.peers.prefill_done(de, replace(r, done_unix_s=clock.unix_now()))


def _cancel_once(t: asyncio.Task) -> None:
    """Cancel ``t`` unless it is being cancelled already: a second cancel would cut its
    clean-up short (the wait for its writes in flight)."""
    if not t.cancelling():
        t.cancel()
