"""A vLLM worker that takes the place of a dead one (its instance started again) gets
the saves lent to the dead one back at once: they held buffer slots, a P/D prefill's
stage among them, until a 120 s deadline checked only at the next BeginSave (a prefill
instance killed mid-request left 18 of 136 PE-buffer slots taken; the idle invariant)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from dualpath.engines.vllm.engine import NotAttached, Worker
from tests.unit.vllm_engine_rig import small_vllm_engine

KEYS = [bytes([i]) * 16 for i in range(1, 5)]


def test_a_worker_taking_a_dead_ones_place_gets_its_lent_saves_back(tmp_path):
    async def main():
        async with small_vllm_engine(tmp_path) as eng:
            pool = eng.space.pool

            def worker(name: str, rank: int = 0):
                return Worker(name, "m", rank, 1,
                              SimpleNamespace(fmt=eng.space.fmt, num_units=8))
            eng.attach(worker("old"))
            sid, _ = await eng.begin_save("r1", "old", KEYS[:2])
            assert pool.free == pool.capacity - 2
            eng.attach(worker("old"))        # the same worker again: its save stays
            assert pool.free == pool.capacity - 2
            eng.attach(worker("new"))        # its instance was started again
            assert pool.free == pool.capacity and set(eng.workers) == {"new"}
            with pytest.raises(NotAttached):
                eng.end_save(sid, True)      # the dead worker's save is gone

    asyncio.run(main())
