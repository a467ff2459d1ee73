"""A token-bucket rate limit, used to emulate each node's storage NIC on one machine.

In the paper every node reads storage through its own storage NIC (SNIC), and that
NIC's bandwidth is the bottleneck DualPath spreads load across. On a single machine all
"nodes" share one disk, so each node's read queue may take a limiter set to its SNIC's
rate (Gbit/s) to give each node its own bottleneck.

:class:`TokenBucket` is the pure core (no clock, no sleeping): callers pass ``now`` and
get back how long to wait. Reservations are FIFO by construction: the bucket may go
into debt, so a later caller waits behind an earlier one. :class:`RateLimiter` wraps it
with an injectable clock and sleep so tests never sleep for real.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable

from dualpath import clock
from dualpath.errors import UsageError


def gbit_to_bytes_per_s(gbit_per_s: float) -> float:
    return gbit_per_s * 1e9 / 8


class TokenBucket:
    """``rate`` bytes/s refill, at most ``burst`` bytes banked. Not thread-safe by itself."""

    def __init__(self, rate_bytes_per_s: float, burst_bytes: float, now: float):
        if rate_bytes_per_s <= 0 or burst_bytes <= 0:
            raise UsageError("token bucket rate and burst must be > 0")
        self.rate = float(rate_bytes_per_s)
        self.burst = float(burst_bytes)
        self.level = self.burst      # bytes that may go now; negative = debt
        self.last = now

    def reserve(self, nbytes: int, now: float) -> float:
        """Take ``nbytes``; returns the seconds to wait before sending them (0 = go)."""
        if nbytes < 0:
            raise UsageError(f"cannot reserve {nbytes} bytes")
        if now > self.last:
            self.level = min(self.burst, self.level + (now - self.last) * self.rate)
            self.last = now
        self.level -= nbytes
        return 0.0 if self.level >= 0 else -self.level / self.rate

    def debt_s(self, now: float) -> float:
        """Seconds until every byte granted so far has had its turn (0: none waits)."""
        level = self.level + max(0.0, now - self.last) * self.rate
        return 0.0 if level >= 0 else -level / self.rate


class RateLimiter:
    """Storage-NIC emulation: ``await acquire(n)`` returns once ``n`` bytes may go.

    ``gbit_per_s <= 0`` means unlimited. ``burst_bytes`` defaults to 10 ms at full rate.
    Safe to call from asyncio tasks and from threads (``acquire_blocking``) at once.

    Two classes share the one bucket: foreground (reads a request waits for) and
    background (``acquire(n, background=True)``: write-back, outside any request's
    latency). A background acquire yields: it takes its bytes only once every byte
    granted before has had its turn (so no foreground caller is waiting either), so
    write-back fills the NIC's idle time instead of delaying reads queued behind it; a
    read that arrives after it waits for its bytes only. It yields for at most
    ``max_defer_s``, so reads that saturate the NIC for ever cannot starve it.
    """

    def __init__(self, gbit_per_s: float, burst_bytes: int | None = None, *,
                 now: Callable[[], float] = clock.now,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                 sleep_blocking: Callable[[float], None] = time.sleep,
                 max_defer_s: float = 5.0):
        if max_defer_s < 0:
            raise UsageError(f"max_defer_s must be >= 0, got {max_defer_s}")
        self.gbit_per_s = gbit_per_s
        self.max_defer_s = max_defer_s
        self._now = now
        self._sleep = sleep
        self._sleep_blocking = sleep_blocking
        self._lock = threading.Lock()
        self._bucket: TokenBucket | None = None
        if gbit_per_s > 0:
            rate = gbit_to_bytes_per_s(gbit_per_s)
            self._bucket = TokenBucket(rate, burst_bytes or rate * 0.010, now())

    @property
    def unlimited(self) -> bool:
        return self._bucket is None

    def _delay(self, nbytes: int) -> float:
        if self._bucket is None:
            return 0.0
        with self._lock:
            return self._bucket.reserve(nbytes, self._now())

    def _debt_s(self) -> float:
        with self._lock:
            return self._bucket.debt_s(self._now())

    async def acquire(self, nbytes: int, *, background: bool = False) -> None:
        if background and self._bucket is not None:
            deadline = self._now() + self.max_defer_s
            while (debt := self._debt_s()) > 0 and (left := deadline - self._now()) > 0:
                await self._sleep(min(debt, left))
        delay = self._delay(nbytes)
        if delay > 0:
            await self._sleep(delay)

    def acquire_blocking(self, nbytes: int) -> None:
        delay = self._delay(nbytes)
        if delay > 0:
            self._sleep_blocking(delay)
