"""Storage-NIC emulation: token bucket arithmetic with an injected clock (no real sleeps)."""

import asyncio

import pytest

from dualpath.errors import UsageError
from dualpath.storage.ratelimit import RateLimiter, TokenBucket, gbit_to_bytes_per_s


def test_burst_goes_at_once_then_callers_queue_fifo():
    b = TokenBucket(rate_bytes_per_s=1000, burst_bytes=500, now=0.0)
    assert b.reserve(500, now=0.0) == 0.0          # the banked burst
    assert b.reserve(100, now=0.0) == pytest.approx(0.1)    # 100 B of debt at 1000 B/s
    assert b.reserve(100, now=0.0) == pytest.approx(0.2)    # waits behind the first
    assert b.reserve(0, now=0.3) == 0.0            # debt repaid by t = 0.2


def test_refill_is_capped_at_burst():
    b = TokenBucket(1000, 500, now=0.0)
    b.reserve(500, 0.0)
    assert b.reserve(500, now=100.0) == 0.0        # idle for long: only 500 B banked
    assert b.reserve(1, now=100.0) == pytest.approx(0.001)


def test_gbit_conversion():
    assert gbit_to_bytes_per_s(8) == 1e9
    with pytest.raises(UsageError):
        TokenBucket(0, 1, 0.0)


class FakeTime:
    def __init__(self):
        self.t = 0.0
        self.slept = []

    def now(self):
        return self.t

    async def sleep(self, s):
        self.slept.append(s)
        self.t += s

    def sleep_blocking(self, s):
        self.slept.append(s)
        self.t += s


def test_limiter_paces_reads_to_the_configured_rate():
    ft = FakeTime()
    lim = RateLimiter(8.0, burst_bytes=1_000_000, now=ft.now, sleep=ft.sleep,
                      sleep_blocking=ft.sleep_blocking)  # 8 Gbit/s = 1 GB/s

    async def main():
        for _ in range(10):
            await lim.acquire(1_000_000)

    asyncio.run(main())
    # 10 MB at 1 GB/s with 1 MB banked: 9 MB must wait = 9 ms of (fake) time.
    assert ft.t == pytest.approx(0.009)
    lim.acquire_blocking(1_000_000)
    assert ft.t == pytest.approx(0.010)
    assert RateLimiter(0).unlimited


def test_default_burst_is_ten_ms():
    ft = FakeTime()
    lim = RateLimiter(8.0, now=ft.now, sleep=ft.sleep, sleep_blocking=ft.sleep_blocking)
    lim.acquire_blocking(10_000_000)   # 10 ms at 1 GB/s: exactly the bucket
    assert ft.slept == []
    lim.acquire_blocking(1_000_000)
    assert ft.slept == [pytest.approx(0.001)]
