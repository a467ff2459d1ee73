"""The read queue: length in tokens (read_q), FIFO, limiter, cancellation safety."""

import asyncio

import pytest

from dualpath.kv.layout import BlockLayout
from dualpath.kv.prefix import block_keys
from dualpath.kv.profiles import get_profile
from dualpath.kv.synth import SyntheticKV
from dualpath.storage import BlockStore, StorageError
from dualpath.storage.ratelimit import RateLimiter
from dualpath.storage.read_queue import ReadQueue
from dualpath.storage.store import aligned_bytes

PROFILE = get_profile("demo", 4)
KEYS = block_keys(list(range(40)), 4)


class GatedStore:
    """A fake store whose reads finish only when the test opens their gate."""

    profile = PROFILE
    layout = BlockLayout.of(PROFILE)
    read_workers = 2
    batched = False           # one block per read; BatchingStore below takes batches
    read_batch_depth = 0

    def __init__(self, hits=None):
        self.started = []
        self.gates = {}
        self.hits = hits or {}
        self.leased = []

    def lease(self, keys):
        self.leased.append(list(keys))

    async def aread(self, key, out):
        self.started.append(key)
        gate = self.gates.setdefault(key, asyncio.Event())
        await gate.wait()
        if self.hits.get(key) == "error":
            raise StorageError(5, "reading", "/fake")
        return self.hits.get(key, True)

    def open(self, key):
        self.gates.setdefault(key, asyncio.Event()).set()

    def contains(self, key):
        return self.hits.get(key, True) is not False

    async def arun(self, fn, *args):
        return fn(*args)


async def _settle():
    for _ in range(10):
        await asyncio.sleep(0)


def test_read_q_counts_queued_and_in_flight_tokens_and_drains_per_block():
    async def main():
        store = GatedStore(hits={KEYS[2]: False})
        q = ReadQueue(store)                      # depth = store.read_workers = 2
        task = asyncio.create_task(q.read(KEYS[:4], [None] * 4))
        await _settle()
        assert q.read_q_tokens == 4 * 4 and q.read_q_blocks == 4
        assert store.started == KEYS[:2]          # FIFO, two in flight
        store.open(KEYS[1])
        await _settle()
        assert q.read_q_tokens == 3 * 4
        assert store.started == KEYS[:3]
        for k in KEYS[:4]:
            store.open(k)
        res = await task
        assert q.read_q_tokens == 0
        assert res.hits == [True, True, False, True]
        assert res.hit_tokens == 8 and not res.all_hit
        await q.close()

    asyncio.run(main())


class BatchingStore(GatedStore):
    """A fake store that takes batches (as the C read loop does), gated by first key."""

    batched = True
    read_batch_depth = 3

    def __init__(self):
        super().__init__()
        self.batches = []

    async def aread_many(self, keys, outs):
        self.batches.append(list(keys))
        gate = self.gates.setdefault(keys[0], asyncio.Event())
        await gate.wait()
        return [True] * len(keys)


@pytest.mark.parametrize("limited", [False, True], ids=["no-limit", "limited"])
def test_blocks_queued_behind_a_read_go_as_one_batch_unless_the_nic_is_limited(limited):
    async def main():
        store = BatchingStore()
        lim = RateLimiter(8.0 if limited else 0)      # 1 GB/s: no wait for 64 KiB
        q = ReadQueue(store, lim, depth=1)
        first = asyncio.create_task(q.read(KEYS[:1], [None]))
        await _settle()
        rest = asyncio.create_task(q.read(KEYS[1:8], [None] * 7))   # queued behind
        await _settle()
        for k in KEYS[:8]:
            store.open(k)
        assert (await first).all_hit and (await rest).all_hit
        assert q.read_q_tokens == 0
        await q.close()
        return store

    store = asyncio.run(main())
    # Each request's blocks are leased (kept from eviction) when it queues them.
    assert store.leased == [KEYS[:1], KEYS[1:8]]
    if limited:      # a batch would wait for all its bytes before its first block
        assert store.batches == [] and store.started == KEYS[:8]
    else:            # the first alone (nothing behind it yet), then up to 3 at a time,
        # the lone ones too to the store's ring reader (which keeps its depth in flight
        # across batches), none to the per-block threads
        assert store.batches == [KEYS[:1], KEYS[1:4], KEYS[4:7], KEYS[7:8]]
        assert store.started == []


def test_blocks_queued_behind_a_requests_miss_are_not_read():
    """Only a leading run of intact blocks is usable: once block 1 is a miss, blocks 2
    and 3 (still queued) report misses without a read."""
    async def main():
        store = GatedStore(hits={KEYS[1]: False})
        q = ReadQueue(store, depth=1)
        task = asyncio.create_task(q.read(KEYS[:4], [None] * 4))
        for k in KEYS[:4]:
            store.open(k)
        res = await task
        assert store.started == KEYS[:2]
        assert res.hits == [True, False, False, False] and res.read_blocks == 2
        assert q.read_q_tokens == 0
        await q.close()

    asyncio.run(main())


def test_cancelled_request_drops_queued_blocks_and_waits_for_in_flight_ones():
    async def main():
        store = GatedStore()
        q = ReadQueue(store, depth=1)
        task = asyncio.create_task(q.read(KEYS[:3], [None] * 3))
        await _settle()
        task.cancel()
        await _settle()
        assert not task.done()                    # block 0 is still being read
        store.open(KEYS[0])
        with pytest.raises(asyncio.CancelledError):
            await task
        await _settle()
        assert store.started == [KEYS[0]]         # blocks 1 and 2 never started
        assert q.read_q_tokens == 0
        await q.close()

    asyncio.run(main())


def test_error_in_one_block_reaches_the_request_after_its_other_reads_finish():
    async def main():
        store = GatedStore(hits={KEYS[0]: "error"})
        q = ReadQueue(store)
        task = asyncio.create_task(q.read(KEYS[:2], [None] * 2))
        await _settle()
        store.open(KEYS[0])
        await _settle()
        assert not task.done()                    # block 1 still in flight
        store.open(KEYS[1])
        with pytest.raises(StorageError):
            await task
        await q.close()

    asyncio.run(main())


def test_real_store_through_a_rate_limited_queue(tmp_path):
    slept = []

    async def fake_sleep(s):
        slept.append(s)

    async def main(store):
        synth = SyntheticKV(store.layout)
        buf = aligned_bytes(store.layout.full_bytes)
        for k in KEYS[:3]:
            synth.fill_full(buf, k)
            store.write(k, buf)
        lim = RateLimiter(1.0, burst_bytes=1, now=lambda: 0.0, sleep=fake_sleep)
        q = ReadQueue(store, limiter=lim)
        outs = [aligned_bytes(store.layout.full_bytes) for _ in range(4)]
        res = await q.read(KEYS[:4], outs)
        assert res.hits == [True, True, True, False] and res.hit_tokens == 12
        assert res.read_blocks == 3
        assert all(synth.verify_full(o, k) is None for o, k in zip(outs[:3], KEYS))
        # Each block there took its file's bytes (4096 header + payload) from a 1 Gbit/s
        # bucket holding 1 byte; the missing fourth took none (it was looked up first:
        # a block still in write-back elsewhere costs this NIC nothing).
        assert len(slept) == 3
        assert slept[-1] == pytest.approx((3 * (4096 + store.layout.full_bytes) - 1) * 8 / 1e9,
                                          rel=1e-6)
        await q.close()

    with BlockStore(tmp_path, PROFILE) as store:
        asyncio.run(main(store))


# ------------------------------------------------------------------ layer by layer

def _stored(tmp_path, n):
    store = BlockStore(tmp_path, PROFILE, read_workers=2)
    layout = store.layout
    for k in KEYS[:n]:
        buf = aligned_bytes(layout.full_bytes)
        SyntheticKV(layout).fill_full(buf, k)
        assert store.write(k, buf)
    return store


class CountingLimiter(RateLimiter):
    def __init__(self):
        super().__init__(0)
        self.taken = []

    async def acquire(self, nbytes):
        self.taken.append(nbytes)
        await super().acquire(nbytes)


def test_a_layered_read_counts_in_read_q_takes_the_limiter_and_lands_in_order(tmp_path):
    """A layered read (a vLLM node's own part of a hit) goes through the read queue:
    its blocks in read_q from open until read, a layer of all of them from the limiter
    at a time, layer l of every block in place when landed(l + 1) is said, and each
    block verified against its checksum."""
    async def main():
        store = _stored(tmp_path, 3)
        lim = CountingLimiter()
        q = ReadQueue(store, lim)
        q.expect("r1", 99)
        lay = store.layout
        read = await q.open_layers(KEYS[:3] + [KEYS[8]] + [KEYS[1]], request_id="r1")
        assert read.found == 3                       # the missing 4th ends the hit
        assert q.read_q_tokens == 3 * q.block_tokens  # the expectation became the queue
        outs = [aligned_bytes(lay.full_bytes) for _ in range(3)]
        seen = []

        def landed(done):
            # every block's layers [0, done) are in, none past them
            for i, k in enumerate(KEYS[:3]):
                want = aligned_bytes(lay.full_bytes)
                SyntheticKV(lay).fill_full(want, k)
                lb = lay.layer_bytes
                assert (outs[i][:done * lb] == want[:done * lb]).all()
                assert not outs[i][done * lb:].any()
            seen.append(done)
        ok = await read.run(outs, lay.layers, lay.layer_bytes, landed)
        assert ok == [True, True, True]
        assert seen == list(range(1, lay.layers + 1))
        assert lim.taken == [3 * lay.layer_bytes] * lay.layers
        assert q.read_q_tokens == 0 and q.read_q_blocks == 0
        read.close()                                 # idempotent
        assert q.read_q_tokens == 0
        store.close()
    asyncio.run(main())


def test_a_layered_read_closed_unread_leaves_read_q(tmp_path):
    async def main():
        store = _stored(tmp_path, 2)
        q = ReadQueue(store)
        read = await q.open_layers(KEYS[:2])
        assert q.read_q_tokens == 2 * q.block_tokens
        read.close()
        read.close()
        assert q.read_q_tokens == 0 and all(b.fd < 0 for b in read.blocks)
        store.close()
    asyncio.run(main())


def test_a_corrupt_block_fails_its_verification_only(tmp_path):
    async def main():
        store = _stored(tmp_path, 2)
        q = ReadQueue(store)
        lay = store.layout
        read = await q.open_layers(KEYS[:2])
        outs = [aligned_bytes(lay.full_bytes) for _ in range(2)]

        def flip(i, full):          # block 1 as if a byte changed on the way
            if i == 1:
                full = full.copy()
                full[5] ^= 1
            return full
        ok = await read.run(outs, lay.layers, lay.layer_bytes, lambda d: None, flip)
        assert ok == [True, False]
        store.close()
    asyncio.run(main())
