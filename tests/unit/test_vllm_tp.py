"""Tensor parallelism at the node (issue 39 item 1): a rank's KV heads placed in the
canonical block (every head, the TP=1 order), so the bytes stored at TP=2 are those
stored at TP=1; and a save that completes only once every rank's heads landed."""

from __future__ import annotations

import asyncio
import contextlib
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from dualpath.engines.vllm.engine import NotAttached, Worker
from dualpath.errors import UsageError
from dualpath.kv.placement import KvFormat, KvPlacement, runs
from dualpath.vllm.kv_tensors import canonical_segments, describe_kv_caches, rank_heads
from tests.unit.vllm_engine_rig import small_vllm_engine

BS, HS, H, BLOCKS, LAYERS = 3, 8, 4, 6, 2  # BS unlike any head count: 5-D shapes tell NHD from HND by it


def _cpu_caches(heads: list[int], full: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """vLLM CPU_ATTN tensors of a rank holding ``heads`` of the full tensors."""
    return {f"l{i}": t[:, heads].contiguous() for i, t in enumerate(full)}


def _hnd_caches(heads: list[int], full: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    return {f"l{i}": t[:, :, heads].contiguous() for i, t in enumerate(full)}


def _copy(src_mem: dict, src: KvPlacement, su, dst_mem: dict, dst: KvPlacement, du):
    """Every layer of units ``su`` -> ``du`` by the WRITE runs, as a NIC would."""
    for layer in range(src.fmt.layers):
        for r in runs(src, su, dst, du, layer, 0, BS * len(su)):
            dst_mem[r.dst_region][r.dst_offset:r.dst_offset + r.length] = \
                src_mem[r.src_region][r.src_offset:r.src_offset + r.length]


def _memory(kv) -> dict[str, np.ndarray]:
    """A described rank's registered ranges as byte arrays (by range name)."""
    import ctypes
    return {r.name: np.ctypeslib.as_array((ctypes.c_uint8 * r.length).from_address(r.addr))
            for r in kv.ranges}


@pytest.mark.parametrize("layout", ["cpu", "hnd"])
@pytest.mark.parametrize("tp", [2, 4])
def test_a_ranks_heads_land_where_tp1_puts_them(layout, tp):
    """Saving every rank's tensors into the canonical buffer gives the bytes the TP=1
    tensors give; loading a rank from it gives that rank's tensors."""
    torch.manual_seed(0)
    if layout == "cpu":
        full = [torch.randn(BLOCKS, H, BS, 2 * HS) for _ in range(LAYERS)]
        make = _cpu_caches
    else:
        full = [torch.randn(2, BLOCKS, H, BS, HS) for _ in range(LAYERS)]
        make = _hnd_caches
    alive = [make(list(range(H)), full)]        # the described memory stays allocated
    whole = describe_kv_caches(alive[0], BS, HS, H)
    assert whole.canonical == ()
    fmt = whole.placement.fmt
    slot = fmt.layers * fmt.unit_bytes
    buf_tp1 = {"buf": np.zeros(BLOCKS * slot, np.uint8)}
    buf_tp = {"buf": np.zeros(BLOCKS * slot, np.uint8)}
    buffer = KvPlacement.full_blocks(fmt, "buf", slot, BLOCKS)
    units = list(range(BLOCKS))
    _copy(_memory(whole), whole.placement, units, buf_tp1, buffer, units)
    ranks = []
    for r in range(tp):
        heads = rank_heads(r, tp, H, H // tp)
        alive.append(make(heads, full))
        kv = describe_kv_caches(alive[-1], BS, HS, H // tp, tp_rank=r, tp_size=tp,
                                total_kv_heads=H)
        assert kv.canonical_rows == fmt.row_bytes
        w = Worker(f"w{r}", "m", r, tp, kv.placement, canonical=kv.canonical,
                   canonical_rows=kv.canonical_rows)
        assert w.canonical_format() == fmt
        view = buffer.select(kv.canonical)
        _copy(_memory(kv), kv.placement, units, buf_tp, view, units)
        ranks.append((kv, view))
    assert np.array_equal(buf_tp["buf"], buf_tp1["buf"])
    for kv, view in ranks:                       # and back: a load of each rank
        mem = _memory(kv)
        before = {n: m.copy() for n, m in mem.items()}
        for m in mem.values():
            m[:] = 0
        _copy(buf_tp, view, units, mem, kv.placement, units)
        assert all(np.array_equal(mem[n], before[n]) for n in mem)


def test_heads_fewer_than_ranks_are_repeated_and_odd_splits_refused():
    assert rank_heads(1, 2, 4, 2) == [2, 3]
    assert [rank_heads(r, 4, 2, 1) for r in range(4)] == [[0], [0], [1], [1]]
    assert rank_heads(0, 2, 1, 1) == [0]              # one head on both ranks: whole
    assert canonical_segments("cpu", [0], 1, 32, 2) == ((), ())
    for bad in ((0, 2, 3, 1), (0, 3, 4, 1), (2, 2, 4, 2)):
        with pytest.raises(UsageError):
            rank_heads(*bad)
    with pytest.raises(UsageError, match="NHD"):
        canonical_segments("nhd", [2, 3], 4, 64, 2)


def test_a_worker_whose_segments_do_not_place_its_format_is_refused():
    fmt = KvFormat(2, 4, (32, 32))
    pl = SimpleNamespace(fmt=fmt, num_units=8)
    for canon, rows in (((0, 5), (32,) * 4),       # past the canonical block
                        ((0, 0), (32,) * 4),       # one segment twice
                        ((0, 1), (32, 16, 32, 32))):   # a row of another size
        with pytest.raises(UsageError, match="do not place"):
            Worker("w", "m", 0, 2, pl, canonical=canon, canonical_rows=rows).canonical_format()


CANON = KvFormat(2, 4, (32, 32))                 # two heads' segments; rank r holds r


def _rank(r: int, tp: int = 2) -> Worker:
    return Worker(f"w{r}", "m", r, tp, SimpleNamespace(fmt=KvFormat(2, 4, (32,)),
                                                       num_units=8),
                  canonical=(r,), canonical_rows=(32, 32))


KEYS = [bytes([i]) * 16 for i in range(1, 4)]


@contextlib.asynccontextmanager
async def _tp2(tmp_path):
    """A node's engine in the canonical format with both ranks of a TP=2 instance."""
    async with small_vllm_engine(tmp_path, fmt=CANON) as eng:
        for r in range(2):
            eng.attach(_rank(r))
        yield eng


def test_a_save_commits_once_every_rank_committed(tmp_path):
    async def main():
        async with small_vllm_engine(tmp_path, fmt=CANON) as eng:
            views = [eng.attach(_rank(r)) for r in range(2)]
            assert [v.segment_offsets for v in views] == [(0,), (4 * 32,)]
            assert all(v.fmt == KvFormat(2, 4, (32,)) for v in views)
            pool = eng.space.pool
            s0, slots0 = await eng.begin_save("r1", "w0", KEYS)
            s1, slots1 = await eng.begin_save("r1", "w1", KEYS)
            assert s0 != s1 and slots0 == slots1            # one set of slots, joined
            assert pool.free == pool.capacity - 3
            assert eng.end_save(s0, True) == 0               # rank 1's heads not in yet
            assert not any(k in eng._pending for k in KEYS)
            assert eng.end_save(s1, True) == 3
            assert all(k in eng._pending for k in KEYS)
            # Another request: a rank that drops its part drops the save.
            d0, _ = await eng.begin_save("r2", "w0", KEYS[:1])
            d1, _ = await eng.begin_save("r2", "w1", KEYS[:1])
            eng.end_save(d1, False)
            assert eng.end_save(d0, True) == 0
            await asyncio.gather(*eng._persists)
            assert pool.free == pool.capacity
            assert all(eng.space.store.contains(k) for k in KEYS)
            # The same rank twice begins a second save, never joins its own.
            a, sa = await eng.begin_save("r3", "w0", KEYS[:1])
            b, sb = await eng.begin_save("r3", "w0", KEYS[:1])
            assert sa != sb
            for sid in (a, b):
                eng.end_save(sid, False)

    asyncio.run(main())


def test_ranks_that_begin_a_save_together_share_it_even_while_it_waits_for_room(tmp_path):
    """The ranks' BeginSaves arrive together: the second must join the first while the
    first still waits for slots (a second set of slots would never commit)."""
    async def main():
        async with _tp2(tmp_path) as eng:
            pool = eng.space.pool
            (a, sa), (b, sb) = await asyncio.gather(eng.begin_save("r1", "w0", KEYS),
                                                    eng.begin_save("r1", "w1", KEYS))
            assert sa == sb and pool.free == pool.capacity - 3
            eng.end_save(a, True)
            assert eng.end_save(b, True) == 3
            # A full pool: rank 0 waits for room, rank 1 joins the wait, both get the
            # slots once another save's go back.
            await asyncio.gather(*eng._persists)        # r1's slots are back
            hog = await pool.reserve(pool.free)
            first = asyncio.ensure_future(eng.begin_save("r2", "w0", KEYS[:1], wait_s=5))
            second = asyncio.ensure_future(eng.begin_save("r2", "w1", KEYS[:1], wait_s=5))
            await asyncio.sleep(0.05)
            assert not first.done() and not second.done()
            hog.release()
            (c, sc), (d, sd) = await asyncio.gather(first, second)
            assert sc == sd
            for sid in (c, d):
                eng.end_save(sid, False)
            await asyncio.gather(*eng._persists)
            assert pool.free == pool.capacity

    asyncio.run(main())


def test_a_rank_whose_instance_restarted_drops_the_saves_it_began(tmp_path):
    """Rank 1 ended its part, then its instance restarted (a new rank 1 attached): the
    save it began will never get a consistent set of ranks and gives its slots back."""
    async def main():
        async with _tp2(tmp_path) as eng:
            pool = eng.space.pool
            s0, _ = await eng.begin_save("r1", "w0", KEYS)
            s1, _ = await eng.begin_save("r1", "w1", KEYS)
            eng.end_save(s1, True)
            assert pool.free == pool.capacity - 3
            w = _rank(1)
            eng.attach(Worker("w1-new", "m", 1, 2, w.placement, canonical=w.canonical,
                              canonical_rows=w.canonical_rows))
            assert pool.free == pool.capacity and not eng._joining
            with pytest.raises(NotAttached):
                eng.end_save(s0, True)

    asyncio.run(main())


def test_a_save_a_rank_never_joined_gives_its_slots_back_at_its_deadline(tmp_path):
    async def main():
        async with _tp2(tmp_path) as eng:
            pool = eng.space.pool
            sid, _ = await eng.begin_save("r1", "w0", KEYS)
            assert eng.end_save(sid, True) == 0              # waits for rank 1
            assert pool.free == pool.capacity - 3
            for s in eng._joining.values():
                s.deadline = time.monotonic() - 1
            await eng.begin_save("r9", "w0", KEYS[:1])       # expires the late one
            assert pool.free == pool.capacity - 1 and not any(k in eng._pending
                                                              for k in KEYS)

    asyncio.run(main())


def test_an_instance_started_again_at_another_tp_replaces_every_old_rank(tmp_path):
    """The operator restarts the instance at TP=1: its worker takes the place of both
    TP=2 ranks, and their open saves give their slots back."""
    async def main():
        async with _tp2(tmp_path) as eng:
            await eng.begin_save("r1", "w1", KEYS)
            pool = eng.space.pool
            assert pool.free == pool.capacity - 3
            view = eng.attach(Worker("one", "m", 0, 1, SimpleNamespace(fmt=CANON,
                                                                       num_units=8)))
            assert set(eng.workers) == {"one"} and view == eng.space.buffer
            assert pool.free == pool.capacity

    asyncio.run(main())
