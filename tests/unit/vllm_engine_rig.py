"""A small VllmEngine over a real pinned region and store, no worker attached: the
model "m" in KV format KvFormat(2, 4, (64,)) opened (unit tests of its buffer and
store bookkeeping)."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

from prometheus_client import CollectorRegistry

from dualpath.buffers.region import PinnedRegion
from dualpath.engines.vllm.engine import VllmEngine
from dualpath.kv.placement import KvFormat
from dualpath.paths.metrics import NodeMetrics
from dualpath.storage.config import StorageConfig

SMALL = KvFormat(2, 4, (64,))


@contextlib.asynccontextmanager
async def small_vllm_engine(tmp_path, *, role: str = "prefill", limiter=None,
                            fmt: KvFormat = SMALL):
    """A prefill (or ``role="decode"``) node's VllmEngine on an 8 MiB region under
    ``tmp_path``, its write-back paced by ``limiter`` (None: unlimited), model "m" in
    ``fmt`` opened; closed after."""
    decode = role == "decode"
    region = PinnedRegion(8 << 20, huge_pages="off", lock=False)
    eng = VllmEngine(node_id="d0" if decode else "p0",
                     storage=StorageConfig(dir=str(tmp_path), direct_io="off"),
                     transfer=SimpleNamespace(), region=region,
                     region_name="de_buffer" if decode else "pe_buffer",
                     limiter=limiter, metrics=NodeMetrics(CollectorRegistry(), role))
    try:
        eng._open_space("m", fmt)
        yield eng
    finally:
        await eng.close()
        region.close()
