"""The order modes run in and the pass a mode is reported by (dualpath/cluster/run.py):
pure functions run_modes uses for `dualpath replay --repeats`, the demo and
bench/e2e.py."""

from __future__ import annotations

import pytest

from dualpath.cluster.replay import ReplayRun
from dualpath.cluster.run import median_run, mode_order, run_jct_s
from dualpath.errors import UsageError
from dualpath.trace.report import RequestRecord

MODES = ["basic", "dualpath", "oracle"]


def test_passes_alternate_so_no_mode_is_always_first():
    order = mode_order(MODES, 2)
    assert order == ["basic", "dualpath", "oracle", "oracle", "dualpath", "basic"]
    # over an even number of passes every mode's mean position is the same
    for n in (2, 4):
        o = mode_order(MODES, n)
        pos = {m: sum(i % 3 for i, x in enumerate(o) if x == m) / n for m in MODES}
        assert len(set(pos.values())) == 1, pos
    assert mode_order(MODES, 1) == MODES


@pytest.mark.parametrize("repeats", [0, -1])
def test_bad_repeats_are_a_usage_error(repeats):
    with pytest.raises(UsageError, match="repeats must be >= 1"):
        mode_order(MODES, repeats)
    with pytest.raises(UsageError, match="modes repeat"):
        mode_order(["basic", "basic"], 1)


def _run(mode: str, jct: float, start: float = 100.0) -> ReplayRun:
    recs = [RequestRecord(0, 0, start, start + 0.1, None, start + jct / 2, 64, 0, 1),
            RequestRecord(1, 0, start + 0.2, start + 0.3, None, start + jct, 64, 0, 1)]
    return ReplayRun(mode, recs, [], start, {}, [], 0, 0, 0, 0)


def test_a_mode_is_reported_by_its_median_pass():
    runs = [_run("basic", 9.0), _run("basic", 5.0), _run("basic", 7.0)]
    assert run_jct_s(runs[0]) == 9.0
    assert median_run(runs) is runs[2]                  # not the fastest, not the slowest
    two = [_run("basic", 9.0), _run("basic", 5.0)]
    assert median_run(two) is two[1]                    # the faster of the middle two
    empty = ReplayRun("basic", [], [], 0.0, {}, [], 0, 0, 0, 0)
    assert run_jct_s(empty) == float("inf") and median_run([empty, two[0]]) is two[0]
