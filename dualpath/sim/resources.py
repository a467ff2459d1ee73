"""What a node spends time or memory on, as simple queueing models (pure).

- :class:`Link`: a FIFO server of ``rate`` bytes/s (a storage NIC's read or write
  direction, a node's compute-network ingress or egress, the host CPU in CPU-seconds).
  A job that arrives at ``t`` starts when the jobs before it ended; its bytes are
  counted into time windows as they move (the report's per-window balance).
- :class:`Pool`: units of a DRAM buffer handed out FIFO with backpressure, as
  ``buffers/pool.py``'s reservations are.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from dualpath.errors import UsageError


class Link:
    """A FIFO server; ``rate`` 0 or inf: infinitely fast."""

    def __init__(self, name: str, rate: float, window_s: float = 0.0):
        if rate < 0:
            raise UsageError(f"link {name}: rate must be >= 0, got {rate}")
        self.name = name
        self.rate = rate if rate and rate != float("inf") else 0.0
        self.busy_until = 0.0
        self.total = 0.0                 # bytes (or work units) served, ever
        self.busy_s = 0.0
        self.window_s = window_s
        self.windows: dict[int, float] = {}

    def reserve(self, now: float, amount: float) -> float:
        """Queue ``amount`` at ``now``; returns when it has been served."""
        if amount <= 0:
            return now
        self.total += amount
        if not self.rate:
            self._count(now, now, amount)
            return now
        start = max(now, self.busy_until)
        dur = amount / self.rate
        end = start + dur
        self.busy_until = end
        self.busy_s += dur
        self._count(start, end, amount)
        return end

    def backlog(self, now: float) -> float:
        """Amount queued or in service at ``now``."""
        return max(0.0, self.busy_until - now) * self.rate if self.rate else 0.0

    def _count(self, start: float, end: float, amount: float) -> None:
        w = self.window_s
        if w <= 0:
            return
        i, j = int(start // w), int(end // w)
        if i == j or end <= start:
            self.windows[i] = self.windows.get(i, 0.0) + amount
            return
        per_s = amount / (end - start)
        for k in range(i, j + 1):
            lo, hi = max(start, k * w), min(end, (k + 1) * w)
            if hi > lo:
                self.windows[k] = self.windows.get(k, 0.0) + per_s * (hi - lo)


class Pool:
    """``capacity`` units; ``acquire(n, cb)`` calls ``cb()`` once ``n`` units are held
    (FIFO: a waiter blocks those behind it, as the buffer pool's reservations do)."""

    def __init__(self, name: str, capacity: int):
        if capacity < 1:
            raise UsageError(f"pool {name}: capacity must be >= 1, got {capacity}")
        self.name = name
        self.capacity = capacity
        self.free = capacity
        self.low = capacity              # the least ever free (report)
        self._waiting: deque[tuple[int, Callable[[], None]]] = deque()

    def acquire(self, n: int, cb: Callable[[], None]) -> None:
        if n > self.capacity:
            raise UsageError(f"pool {self.name}: {n} units asked, capacity "
                             f"{self.capacity}")
        if not self._waiting and n <= self.free:
            self.free -= n
            self.low = min(self.low, self.free)
            cb()
        else:
            self._waiting.append((n, cb))

    def release(self, n: int) -> None:
        self.free += n
        w = self._waiting
        while w and w[0][0] <= self.free:
            k, cb = w.popleft()
            self.free -= k
            self.low = min(self.low, self.free)
            cb()
