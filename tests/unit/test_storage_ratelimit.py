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


class VirtualClock:
    """Time that moves only when every task is asleep: to the earliest wake-up."""

    def __init__(self):
        self.t = 0.0
        self._wakeups = []
        self._seq = 0

    def now(self):
        return self.t

    async def sleep(self, s):
        import heapq

        fut = asyncio.get_running_loop().create_future()
        self._seq += 1
        heapq.heappush(self._wakeups, (self.t + s, self._seq, fut))
        await fut

    async def run(self, *coros):
        import heapq

        tasks = [asyncio.ensure_future(c) for c in coros]
        while not all(t.done() for t in tasks):
            for _ in range(20):
                await asyncio.sleep(0)
            if self._wakeups:
                when, _, fut = heapq.heappop(self._wakeups)
                self.t = max(self.t, when)
                fut.set_result(None)
        return [t.result() for t in tasks]


def _limiter(vc, **kw):
    # 1000 B/s (8e-6 Gbit/s), 100 B banked.
    return RateLimiter(8e-6, burst_bytes=100, now=vc.now, sleep=vc.sleep, **kw)


def test_the_nic_is_full_duplex_writes_never_delay_reads():
    vc = VirtualClock()
    lim = _limiter(vc)
    done = {}

    async def read(name, n, at=0.0):
        await vc.sleep(at)
        await lim.acquire(n)
        done[name] = vc.t

    async def write(name, n, at=0.0):
        await vc.sleep(at)
        await lim.acquire_write(n)
        done[name] = vc.t

    # 1000 B of write-back asked first, then two reads: each direction has its own
    # 1000 B/s (100 B banked), so the reads wait only for each other, FIFO.
    asyncio.run(vc.run(write("w1", 1000), read("r1", 1000, at=0.1),
                       read("r2", 100, at=0.5), write("w2", 100, at=0.2)))
    assert done["w1"] == pytest.approx(0.9)
    assert done["r1"] == pytest.approx(1.0)          # 0.1 + 0.9, not behind w1
    assert done["r2"] == pytest.approx(1.1)          # FIFO behind r1
    assert done["w2"] == pytest.approx(1.0)          # FIFO behind w1, not behind reads


def test_each_direction_is_paced_to_the_rate():
    vc = VirtualClock()
    lim = _limiter(vc)
    done = {}

    async def writes():
        for _ in range(50):                 # 5,000 B of write-back back to back
            await lim.acquire_write(100)
        done["w"] = vc.t

    async def reads():
        for _ in range(20):                 # 2,000 B of reads at the same time
            await lim.acquire(100)
        done["r"] = vc.t

    asyncio.run(vc.run(writes(), reads()))
    assert done["w"] == pytest.approx(4.9)  # 100 B banked, the rest at 1000 B/s
    assert done["r"] == pytest.approx(1.9)
    assert RateLimiter(0).unlimited
