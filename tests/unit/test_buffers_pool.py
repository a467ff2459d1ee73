"""Block pools: aligned slots, reservations, FIFO backpressure, clear oversize errors."""

import asyncio

import numpy as np
import pytest

from dualpath.buffers.pool import BlockPool, NodeBuffers, PoolTooSmall, slot_stride
from dualpath.errors import UsageError
from dualpath.kv.layout import BlockLayout
from dualpath.kv.prefix import block_keys
from dualpath.kv.profiles import get_profile
from dualpath.kv.synth import SyntheticKV
from dualpath.storage import BlockStore
from dualpath.storage.store import aligned_bytes

DS = get_profile("ds660b", 4)        # 160064-byte blocks: slots must round up to 4096
LAY = BlockLayout.of(DS)


def _pool(slots):
    mem = aligned_bytes(slots * slot_stride(LAY))
    return BlockPool("test pool", mem, LAY, region_addr=mem.ctypes.data)


async def _settle():
    for _ in range(10):
        await asyncio.sleep(0)


def test_slots_are_page_aligned_disjoint_blocks():
    pool = _pool(3)
    assert slot_stride(LAY) == 40 * 4096 and pool.capacity == 3
    r = pool.try_reserve(3)
    assert [r.addr(i) % 4096 for i in range(3)] == [0, 0, 0]
    blocks = r.blocks()
    assert all(b.shape == LAY.full_shape for b in blocks)
    assert not np.shares_memory(blocks[0], blocks[1])
    assert np.shares_memory(blocks[2], pool.memory)
    assert pool.free == 0
    r.release()
    r.release()                                    # idempotent
    assert pool.free == 3
    with pytest.raises(UsageError, match="released"):
        r.block(0)


def test_a_range_handed_over_is_released_by_its_new_owner_alone():
    pool = _pool(4)
    r = pool.try_reserve(4)
    part = r.hand_over_range(1, 3)
    assert part.slots == r.slots[1:3]
    with pytest.raises(UsageError, match="handed over"):
        r.flat(1)
    with pytest.raises(UsageError, match="cannot be handed over"):
        r.hand_over_range(2, 4)                    # block 2 is part's already
    with pytest.raises(UsageError, match="cannot be handed over"):
        r.hand_over_range(3, 3)                    # empty
    r.release()
    assert pool.free == 2                          # blocks 0 and 3
    part.release()
    assert pool.free == 4


def test_full_pool_makes_callers_wait_until_a_release():
    async def main():
        pool = _pool(4)
        held = await pool.reserve(3)
        waiter = asyncio.create_task(pool.reserve(2))
        await _settle()
        assert not waiter.done() and pool.waiting == 1     # backpressure, no growth
        held.release()
        got = await waiter
        assert len(got) == 2 and pool.free == 2

    asyncio.run(main())


def test_waiters_are_served_first_come_first_served():
    async def main():
        pool = _pool(4)
        held = await pool.reserve(3)
        big = asyncio.create_task(pool.reserve(3))         # first in line, needs 3
        await _settle()
        assert pool.try_reserve(1) is None                 # 1 slot is free, but no barging
        small = asyncio.create_task(pool.reserve(1))
        await _settle()
        assert not big.done() and not small.done()
        held.release()
        await _settle()
        assert big.done() and small.done()                 # 4 free: big, then small
        assert pool.free == 0

    asyncio.run(main())


def test_cancelled_waiter_lets_the_next_one_in():
    async def main():
        pool = _pool(2)
        held = await pool.reserve(1)
        big = asyncio.create_task(pool.reserve(2))
        small = asyncio.create_task(pool.reserve(1))
        await _settle()
        assert not small.done()
        big.cancel()
        await _settle()
        assert small.done() and pool.free == 0
        held.release()
        assert pool.free == 1

    asyncio.run(main())


def test_request_larger_than_the_pool_fails_at_once():
    async def main():
        pool = _pool(2)
        with pytest.raises(PoolTooSmall, match="needs 3 blocks of [0-9]+ bytes but the pool holds 2"):
            await pool.reserve(3)
        with pytest.raises(UsageError):
            await pool.reserve(0)

    asyncio.run(main())


def test_node_buffers_carve_pe_and_de_from_one_registered_region():
    regs = []

    class Reg:
        def __init__(self, a, n):
            regs.append((a, n))

        def close(self):
            regs.append("closed")

    with NodeBuffers(DS, pe_bytes=2 * 160064, de_bytes=3 * 160064, lock=False,
                     register=Reg) as nb:
        assert (nb.pe.capacity, nb.de.capacity) == (2, 3)
        assert regs == [(nb.region.addr, nb.region.nbytes)]
        pe, de = nb.pe.try_reserve(2), nb.de.try_reserve(1)
        assert de.offset(0) == 2 * slot_stride(LAY)                # DE follows PE
        assert not np.shares_memory(pe.flat(1), de.flat(0))
        assert de.addr(0) == nb.region.addr + de.offset(0)
        del pe, de
    assert regs[-1] == "closed"


def test_storage_reads_land_in_a_reserved_slot_without_bouncing(tmp_path):
    keys = block_keys(list(range(8)), 4)
    with BlockStore(tmp_path, DS) as store:
        synth = SyntheticKV(LAY)
        for k in keys:
            store.write(k, synth.full_block(k))
        pool = _pool(2)
        res = pool.try_reserve(2)
        assert store.read_many(keys, [res.flat(0), res.flat(1)]) == [True, True]
        assert all(synth.verify_full(res.block(i), k) is None for i, k in enumerate(keys))
        assert store.stats.bounce_reads == 0
