"""Storage faults during a 1P2D replay (the harness: conftest.py): every block stored so
far corrupted (a payload byte flipped), truncated or deleted mid-run, and the disk under
the store filling up mid-run.

Degrade, don't fail: a hit block that is missing or corrupt is computed by the PE from
the first bad block on, like miss tokens (either read side), and cached again by the DE;
a block the DE cannot persist (ENOSPC) is skipped and counted, the request unaffected.
Nothing here costs a failed attempt, so the bound is 0, and recovery needs no lease
event at all: no group loses its lease.
"""

from __future__ import annotations

import pytest

from dualpath.cluster.faults import damage_blocks, fill_disk, recached
from tests.faults.conftest import (
    Fault,
    check,
    lapses,
    make_cluster,
    node_logs,
    run_replay,
    scheduler_log,
    small_disk,
)

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("kind", ["corrupt", "truncate", "delete"])
def test_damaged_blocks_are_recomputed(cluster, kind):
    act = damage_blocks(kind)
    fault = Fault(after=5, action=act)
    run = run_replay(cluster, fault)
    logs = node_logs(cluster)
    recomputed = logs.count("missing or corrupt in storage")
    assert act.damaged, "nothing was stored before the fault"
    assert recomputed > 0, "no round met a damaged block"
    assert all(lapses(scheduler_log(cluster), g) == 0 for g in ("p0", "d0", "d1"))
    again = recached(kind, act.damaged)
    assert again > 0, "no recomputed block was cached again"
    fault.notes.update(damaged_blocks=len(act.damaged), requests_recomputing=recomputed,
                       blocks_cached_again=again)
    check(f"blocks {kind}", cluster, run, fault, max_failed=0)


def test_disk_full_under_the_store(tmp_path):
    # The whole cluster runs in a mount namespace whose store is a small tmpfs; at the
    # fault a ballast file fills it, so every persist after that meets ENOSPC.
    with small_disk(tmp_path / "kv", mib=256) as (launcher, seen):
        c = make_cluster(tmp_path, launcher=launcher)
        c.start()
        try:
            filled = {}
            # The replay holds until the ballast is in: filling the tmpfs outlasted the
            # rounds after the fault on a loaded 2-core host (twice: with 8 rounds in
            # stop 29, with 16 in stop 30), so no persist met a full disk.
            fault = Fault(after=3, action=lambda _c: filled.setdefault("bytes",
                                                                       fill_disk(seen)),
                          hold=True)
            run = run_replay(c, fault, rounds=8)
            not_cached = node_logs(c).count("not caching block")
            assert filled["bytes"] > 0 and not_cached > 0, "the disk never ran out"
            assert all(lapses(scheduler_log(c), g) == 0 for g in ("p0", "d0", "d1"))
            fault.notes.update(ballast_mib=filled["bytes"] >> 20,
                               requests_not_caching=not_cached)
            check("disk full", c, run, fault, max_failed=0)
        finally:
            c.stop()
