"""A DE's write-back (paths/writeback.py): blocks reach storage through the storage NIC's
write direction, this node's reads find them meanwhile (KvSpace.read), and a stop leaves
no slot behind. A real BlockStore in a temporary directory; the limiter records what it
was asked."""

import asyncio

import numpy as np

from dualpath.buffers.pool import BlockPool
from dualpath.kv.layout import BlockLayout
from dualpath.kv.prefix import block_keys
from dualpath.kv.profiles import get_profile
from dualpath.paths.kvspace import KvSpace
from dualpath.paths.pending import PendingBlocks
from dualpath.paths.writeback import WriteBack
from dualpath.storage import BlockStore
from dualpath.storage.format import HEADER_BYTES
from dualpath.storage.read_queue import ReadQueue

PROFILE = get_profile("demo", 4)
LAYOUT = BlockLayout.of(PROFILE)
KEYS = block_keys(list(range(40)), 4)


class GatedLimiter:
    """A write direction that lets a write through only when the test says so."""

    unlimited = False

    def __init__(self):
        self.asked = []
        self.gate = asyncio.Event()

    async def acquire_write(self, nbytes):
        self.asked.append(nbytes)
        await self.gate.wait()

    async def acquire(self, nbytes):
        raise AssertionError("a block in the write-back was read from storage")


def _setup(tmp_path, limiter):
    store = BlockStore(tmp_path, PROFILE, read_workers=2)
    pool = BlockPool("de_buffer", np.zeros(16 << 20, np.uint8), LAYOUT)
    space = KvSpace.for_store(store, ReadQueue(store, limiter), pool, "de_buffer")
    space.writeback = WriteBack(store, limiter, space.pending)
    return store, pool, space


def _slot(pool, fill):
    res = pool.try_reserve(1)
    res.flat(0)[:] = fill
    return res


def test_blocks_wait_for_the_write_direction_and_reads_here_find_them_meanwhile(tmp_path):
    async def main():
        lim = GatedLimiter()
        store, pool, space = _setup(tmp_path, lim)
        wb = space.writeback
        for i in range(3):
            wb.add(KEYS[i], _slot(pool, i + 1))
        await asyncio.sleep(0.05)
        assert len(wb) == 3 and not any(store.contains(k) for k in KEYS[:3])
        assert lim.asked and set(lim.asked) == {HEADER_BYTES + LAYOUT.full_bytes}
        # This node's read: copied from the write-back, no storage read (GatedLimiter
        # fails any read acquire), all three usable.
        out = await pool.reserve(3)
        got = await space.read("r", KEYS[:3], out)
        assert got.usable == 3 and got.nbytes == 0
        assert [int(out.flat(i)[0]) for i in range(3)] == [1, 2, 3]
        out.release()
        lim.gate.set()
        assert await wb.drain(5.0)
        assert len(wb) == 0 and all(store.contains(k) for k in KEYS[:3])
        assert pool.free == pool.capacity           # every slot went back
        await wb.close()
        await space.close()

    asyncio.run(main())


def test_a_stop_gives_pending_slots_back_unwritten_after_a_bounded_wait(tmp_path):
    async def main():
        lim = GatedLimiter()
        store, pool, space = _setup(tmp_path, lim)
        wb = space.writeback
        wb.add(KEYS[0], _slot(pool, 7))
        wb.add(KEYS[0], _slot(pool, 8))              # the same block again: dropped
        assert pool.free == pool.capacity - 1
        await wb.close(drain_s=0.05)
        assert pool.free == pool.capacity and not store.contains(KEYS[0])
        wb.add(KEYS[1], _slot(pool, 9))              # after the stop: not taken
        assert pool.free == pool.capacity and len(wb) == 0
        await space.close()

    asyncio.run(main())


def test_a_vllm_decode_nodes_reads_find_its_own_blocks_still_in_write_back(tmp_path):
    """The DE read path's LOAD_HIT_KV reads go through KvSpace.read: a block the node's
    vLLM write-back still holds (an agent's previous round, decoded here) is copied from
    DRAM, not found missing and recomputed."""
    from tests.unit.vllm_engine_rig import small_vllm_engine

    async def main():
        lim = GatedLimiter()
        async with small_vllm_engine(tmp_path, role="decode", limiter=lim) as eng:
            space = eng.space
            held = space.pool.try_reserve(2)
            for i in range(2):
                held.flat(i)[:] = i + 7
            eng.release_adopted(eng.adopt("prev", KEYS[:2], held))
            await asyncio.sleep(0.05)
            assert lim.asked and not space.store.contains(KEYS[0])     # not written yet
            out = await space.pool.reserve(2)
            got = await space.read("next", KEYS[:2], out)
            assert got.usable == 2 and got.nbytes == 0                 # no storage read
            assert [int(out.flat(i)[0]) for i in range(2)] == [7, 8]
            out.release()
            lim.gate.set()

    asyncio.run(main())


def test_an_adopted_partial_last_block_is_served_and_never_persisted(tmp_path):
    """A P/D request's partial last block, adopted with its full blocks: a lookup finds
    it while the decode instance may load it; only the full blocks reach the store, and
    every slot goes back once the request let go."""
    from tests.unit.vllm_engine_rig import small_vllm_engine

    async def main():
        async with small_vllm_engine(tmp_path, role="decode") as eng:
            space = eng.space
            eng.model_id = "m"
            held = space.pool.try_reserve(3)
            tail = KEYS[5]                             # (any key: the tail's own)
            s = eng.adopt("r", KEYS[:2] + [tail], held, tail=True)
            for _ in range(100):
                if space.store.contains(KEYS[1]):
                    break
                await asyncio.sleep(0.01)
            assert space.store.contains(KEYS[1])
            assert eng.get_num_new_matched_tokens("m", KEYS[:2] + [tail])[0] == 3     # held: found
            assert space.pool.free == space.pool.capacity - 3
            eng.release_adopted(s)
            for _ in range(100):
                if space.pool.free == space.pool.capacity:
                    break
                await asyncio.sleep(0.01)
            assert space.pool.free == space.pool.capacity
            assert not space.store.contains(tail)
            assert eng.get_num_new_matched_tokens("m", KEYS[:2] + [tail])[0] == 2     # let go: gone

    asyncio.run(main())


def test_a_request_with_fewer_blocks_to_write_goes_first(tmp_path):
    """The emulated DE ranks each request's blocks by how many it writes (engines/
    emulated/decode.py): paced by the write direction, a first round's whole prompt does not
    hold up the next rounds of agents that wrote one block (shortest first)."""
    async def main():
        lim = GatedLimiter()
        store = BlockStore(tmp_path, PROFILE, read_workers=2)
        pool = BlockPool("de_buffer", np.zeros(16 << 20, np.uint8), LAYOUT)
        order = []
        awrite = store.awrite

        async def recorded(key, data):
            order.append(KEYS.index(key))
            return await awrite(key, data)
        store.awrite = recorded
        wb = WriteBack(store, lim, PendingBlocks(), writers=1)
        for i in range(4):                             # a first round: 4 blocks
            wb.add(KEYS[i], _slot(pool, i + 1), rank=4)
        await asyncio.sleep(0.05)                      # the writer holds KEYS[0]'s turn
        wb.add(KEYS[9], _slot(pool, 10), rank=1)       # a later round's one block
        lim.gate.set()
        assert await wb.drain(5.0)
        assert order == [0, 9, 1, 2, 3]
        assert all(store.contains(KEYS[i]) for i in (0, 1, 2, 3, 9))
        await wb.close()
        store.close()

    asyncio.run(main())


def test_a_cancelled_layered_read_ends_its_pool_reads_before_it_returns(tmp_path):
    """A vLLM load's layer reads run on the store's pool threads. Cancelling the read
    task (a load abandoned, the worker's stream broken) used to return at once while a
    pool thread still read into the request's slots (and from a descriptor the task
    closed): the slots were then given back with a write still landing in them. Now the
    task returns only once every read in flight has ended."""
    import threading
    import time

    from dualpath.paths.layers import LocalArrivals
    from tests.unit.vllm_engine_rig import small_vllm_engine

    async def main():
        async with small_vllm_engine(tmp_path) as eng:
            space = eng.space
            store = space.store
            assert store.layered()
            for i, k in enumerate(KEYS[:2]):
                store.write(k, np.full(space.layout.full_bytes, i + 1, np.uint8))
            lock, reading, started = threading.Lock(), [0], threading.Event()
            real = store.read_layer

            def slow(block, layer, dst):
                with lock:
                    reading[0] += 1
                started.set()
                time.sleep(0.3)
                try:
                    return real(block, layer, dst)
                finally:
                    with lock:
                        reading[0] -= 1

            store.read_layer = slow
            res = await space.pool.reserve(2)
            ok, task = await eng.read_layered("r", KEYS[:2], res, LocalArrivals())
            assert ok == 2
            assert await asyncio.to_thread(started.wait, 5.0)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            assert reading[0] == 0            # nothing still writes into res's slots
            res.release()

    asyncio.run(main())


def test_a_second_cancel_does_not_end_the_wait_for_pool_reads():
    """A load cancelled again while its reader waits for its pool reads (the load's own
    cleanup awaits the reader) must still not return before those reads end."""
    import threading
    import time

    from dualpath.aio import all_landed

    async def main():
        running = threading.Event()
        ended = threading.Event()

        def read():
            running.set()
            time.sleep(0.3)
            ended.set()

        loop = asyncio.get_running_loop()
        task = asyncio.ensure_future(all_landed([loop.run_in_executor(None, read)]))
        assert await asyncio.to_thread(running.wait, 5.0)
        task.cancel()
        await asyncio.sleep(0.05)
        task.cancel()                     # the second one
        await asyncio.gather(task, return_exceptions=True)
        assert ended.is_set()

    asyncio.run(main())
