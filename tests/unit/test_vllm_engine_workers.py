"""A vLLM worker that takes the place of a dead one (its instance started again) gets
the saves lent to the dead one back at once: they held buffer slots, a P/D prefill's
stage among them, until a 120 s deadline checked only at the next BeginSave (a prefill
instance killed mid-request left 18 of 136 PE-buffer slots taken; the idle invariant)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from dualpath.buffers.region import PinnedRegion
from dualpath.engine.metrics import NodeMetrics
from dualpath.engine.vllm_engine import NotAttached, VllmEngine
from dualpath.kv.placement import KvFormat
from dualpath.storage.config import StorageConfig

KEYS = [bytes([i]) * 16 for i in range(1, 5)]


def test_a_worker_taking_a_dead_ones_place_gets_its_lent_saves_back(tmp_path):
    async def main():
        region = PinnedRegion(8 << 20, huge_pages="off", lock=False)
        eng = VllmEngine(node_id="p0", storage=StorageConfig(dir=str(tmp_path),
                                                             direct_io="off"),
                         transfer=SimpleNamespace(), region=region, region_name="pe_buffer",
                         limiter=None, metrics=NodeMetrics(CollectorRegistry(), "prefill"))
        try:
            eng._open_space("m", KvFormat(2, 4, (64,)))
            pool = eng.space.pool

            def worker(name: str, rank: int = 0):
                return SimpleNamespace(name=name, tp_rank=rank, tp_size=1, model_id="m",
                                       placement=SimpleNamespace(fmt=eng.space.fmt,
                                                                 num_units=8),
                                       prefix_caching=False)
            eng.attach(worker("old"))
            sid, _ = await eng.begin_save("r1", "old", KEYS[:2])
            assert pool.free == pool.capacity - 2
            eng.attach(worker("old"))        # the same worker again: its save stays
            assert pool.free == pool.capacity - 2
            eng.attach(worker("new"))        # its instance was started again
            assert pool.free == pool.capacity and set(eng.workers) == {"new"}
            with pytest.raises(NotAttached):
                eng.end_save(sid, True)      # the dead worker's save is gone
        finally:
            await eng.close()
            region.close()

    asyncio.run(main())
