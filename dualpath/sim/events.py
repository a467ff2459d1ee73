"""The simulator's clock: a heap of timed callbacks, run in time order (ties in the
order they were scheduled). Pure; single-threaded."""

from __future__ import annotations

import heapq
from collections.abc import Callable


class EventLoop:
    """``at(t, fn, *args)`` runs ``fn(*args)`` when the clock reaches ``t``; ``run()``
    runs until no event is left (or ``until``)."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list = []
        self._seq = 0
        self.events = 0                  # callbacks run so far

    def at(self, t: float, fn: Callable, *args) -> None:
        now = self.now
        t = t if t > now else now  # noqa: FURB136 - max() is a call, on most events
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, fn, args))

    def after(self, dt: float, fn: Callable, *args) -> None:
        t = self.now + dt if dt > 0 else self.now
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, fn, args))

    def run(self, until: float = float("inf")) -> None:
        heap, pop = self._heap, heapq.heappop
        while heap and heap[0][0] <= until:
            t, _, fn, args = pop(heap)
            self.now = t
            self.events += 1
            fn(*args)

    def pending(self) -> int:
        return len(self._heap)
