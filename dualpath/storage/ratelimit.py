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

#: What an unlimited storage NIC counts as where a rate must be a number (the scheduler's
#: alpha, a report's utilisation): 800 Gbit/s.
UNLIMITED_BYTES_PER_S = 100e9


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


class RateLimiter:
    """Storage-NIC emulation: ``await acquire(n)`` returns once ``n`` bytes may be read,
    ``await acquire_write(n)`` once ``n`` bytes may be written.

    ``gbit_per_s <= 0`` means unlimited. ``burst_bytes`` defaults to 10 ms at full rate.
    Safe to call from asyncio tasks and from threads (``acquire_blocking``) at once.

    A NIC is full duplex: reads come in and writes go out on separate directions of the
    link, each at the NIC's rate (the paper's bandwidth analysis counts a NIC's read and
    write traffic apart; only DRAM is half duplex). So reads and writes each have their
    own bucket at ``gbit_per_s``, FIFO within a direction: write-back (outside any
    request's latency) never delays a read, and reads never starve write-back.
    """

    def __init__(self, gbit_per_s: float, burst_bytes: int | None = None, *,
                 now: Callable[[], float] = clock.now,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                 sleep_blocking: Callable[[float], None] = time.sleep):
        self.gbit_per_s = gbit_per_s
        self._now = now
        self._sleep = sleep
        self._sleep_blocking = sleep_blocking
        self._lock = threading.Lock()
        self._read: TokenBucket | None = None
        self._write: TokenBucket | None = None
        if gbit_per_s > 0:
            rate = gbit_to_bytes_per_s(gbit_per_s)
            burst = burst_bytes or rate * 0.010
            self._read = TokenBucket(rate, burst, now())
            self._write = TokenBucket(rate, burst, now())

    @property
    def unlimited(self) -> bool:
        return self._read is None

    def _delay(self, bucket: TokenBucket | None, nbytes: int) -> float:
        if bucket is None:
            return 0.0
        with self._lock:
            return bucket.reserve(nbytes, self._now())

    async def acquire(self, nbytes: int) -> None:
        delay = self._delay(self._read, nbytes)
        if delay > 0:
            await self._sleep(delay)

    async def acquire_write(self, nbytes: int) -> None:
        delay = self._delay(self._write, nbytes)
        if delay > 0:
            await self._sleep(delay)

    def acquire_blocking(self, nbytes: int) -> None:
        delay = self._delay(self._read, nbytes)
        if delay > 0:
            self._sleep_blocking(delay)
