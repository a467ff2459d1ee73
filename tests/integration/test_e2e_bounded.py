"""End to end with a bounded store: a 1P2D cluster of real daemons whose shared store
holds half of what three replays write. One node process becomes the store's evictor;
every prompt byte a DE receives is still checked against the generator, and the store
never holds more than its bound (docs/storage.md, "A bounded store")."""

from __future__ import annotations

import pytest

from dualpath.cluster.local import LocalCluster
from dualpath.cluster.replay import replay_local
from dualpath.cluster.run import make_trace
from dualpath.kv.profiles import get_profile
from dualpath.storage.format import HEADER_BYTES
from dualpath.storage.store import SUFFIX

pytestmark = pytest.mark.slow

PROFILE = get_profile("demo")
TRACE = make_trace(4, context_scale=0.05, max_rounds=3, seed=1)   # 16 blocks a replay
ROUNDS = sum(len(t.rounds) for t in TRACE.trajectories)
BLOCK_ON_DISK = HEADER_BYTES + PROFILE.layers * PROFILE.kv_bytes_per_token_layer * \
    PROFILE.block_tokens
CAP_BYTES = 24 * BLOCK_ON_DISK                                     # three replays: 48


@pytest.fixture(scope="module")
def bounded(tmp_path_factory):
    c = LocalCluster(1, 2, work_dir=str(tmp_path_factory.mktemp("bounded")),
                     settings={"transport": {"kind": "tcp"},
                               "storage": {"capacity_gib": CAP_BYTES / 2**30,
                                           "upkeep_interval_s": 0.1,
                                           "low_watermark": 0.6}})
    c.start()
    yield c
    c.stop()


def usage(kv) -> int:
    """Bytes of the block files under store directory ``kv`` (a scan, as `du` would)."""
    return sum(p.stat().st_size for p in kv.glob(f"*/*/*/*{SUFFIX}"))


def replays_verified(cluster, kv, n: int = 3, **opts) -> tuple[list, int]:
    """``n`` replays of TRACE on ``cluster``, each verified whole; (runs, the most bytes
    the store held after any of them)."""
    runs, peak = [], 0
    for _ in range(n):
        run = replay_local(cluster, TRACE, PROFILE, **{"timeout_s": 120, **opts})
        assert len(run.records) == ROUNDS
        assert run.bytes_mismatched == 0
        prompt = sum(r.prompt_tokens for r in run.records)
        assert run.bytes_verified == prompt * PROFILE.kv_bytes_per_token
        runs.append(run)
        peak = max(peak, usage(kv))
    return runs, peak


def test_replays_through_a_bounded_store_evict_and_verify_every_byte(bounded):
    runs, peak = replays_verified(bounded, bounded.dir / "kv")
    assert peak <= CAP_BYTES, (peak, CAP_BYTES)
    assert sum(r.hit_bytes for r in runs) > 0            # hits still served
    m = {n: bounded.node_metrics(n) for n in bounded.node_ids()}
    evictors = [n for n in m if m[n]["dualpath_node_store_evictor"] == 1]
    assert len(evictors) == 1, m                         # one evictor for the store
    ev = m[evictors[0]]
    assert ev["dualpath_node_store_evictions_total"] > 0
    assert 0 < ev["dualpath_node_store_usage_bytes"] <= CAP_BYTES
    assert ev["dualpath_node_store_capacity_bytes"] == CAP_BYTES
    # Every node's writes reached the evictor's accounting: its usage is the disk's
    # (give or take the writes of its last round).
    assert abs(ev["dualpath_node_store_usage_bytes"] - usage(bounded.dir / "kv")) <= 4 * BLOCK_ON_DISK
