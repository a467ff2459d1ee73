"""One DE engine's decode batch (the emulated engine; paper §6.2: a DE needs no intra-engine
scheduling, "all its requests join every decode step").

Continuous batching: a request joins at the next step boundary and leaves after its last
token; each step lasts ``step_s`` of the contexts of the requests it ran with (the cost
model's :func:`dualpath.kv.cost.decode_step_s`), so a DE holding more, or longer,
requests steps more slowly, and the scheduler's DE placement (Z rule, min seq_e) shows
in TPOT. The step loop runs while the batch has members and ends when it is empty
(a request cancelled at a node's stop leaves it, so the loop ends one step later).

Threads: the node's event loop.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass


@dataclass(slots=True)
class _Member:
    context: int                    # tokens whose KV the request holds
    tokens: int                     # tokens to generate
    on_token: Callable[[int], None] | None
    done: asyncio.Future
    made: int = 0                   # tokens generated so far


class DecodeBatch:
    """See the module docstring. ``sleep`` is injectable (tests drive steps by hand)."""

    def __init__(self, step_s: Callable[[Sequence[int]], float],
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep):
        self._step_s = step_s
        self._sleep = sleep
        self._members: dict[int, _Member] = {}
        self._ids = itertools.count()
        self._loop: asyncio.Task | None = None
        self.steps = 0                  # steps run so far
        self.largest = 0                # most requests one step ran with

    def __len__(self) -> int:
        return len(self._members)

    async def generate(self, context: int, tokens: int,
                       on_token: Callable[[int], None] | None = None) -> None:
        """Generate ``tokens`` tokens for a request holding ``context`` tokens of KV:
        returns after the step that made its last one; ``on_token(k)`` runs at the end
        of the step that made its k-th (it must not raise). Cancelling it leaves the
        batch at the next step."""
        if tokens <= 0:
            return
        m = _Member(context, tokens, on_token, asyncio.get_running_loop().create_future())
        mid = next(self._ids)
        self._members[mid] = m
        if self._loop is None or self._loop.done():
            self._loop = asyncio.ensure_future(self._run())
        try:
            await m.done
        finally:
            self._members.pop(mid, None)

    async def _run(self) -> None:
        try:
            while True:
                # A request done, or whose caller was cancelled, is out of the next step.
                for mid in [k for k, m in self._members.items() if m.done.done()]:
                    del self._members[mid]
                if not self._members:
                    break
                batch = list(self._members.values())
                self.largest = max(self.largest, len(batch))
                await self._sleep(self._step_s([m.context for m in batch]))
                self.steps += 1
                for m in batch:
                    if m.done.done():       # its caller was cancelled during the step
                        continue
                    m.context += 1
                    m.made += 1
                    if m.on_token is not None:
                        m.on_token(m.made)
                    if m.made == m.tokens:
                        m.done.set_result(None)
        finally:
            for m in self._members.values():
                if not m.done.done():
                    m.done.cancel()
