"""fig10's capacity search: the highest rate within the SLO, bisected on a log scale,
probes driven by the caller (two searches take turns on one cluster)."""

import pytest

from dualpath.errors import UsageError
from dualpath.repro.figures import capacity_search


def _run(search, within):
    probed = []
    try:
        rate = next(search)
        while True:
            probed.append(rate)
            rate = search.send(within(rate))
    except StopIteration as done:
        return done.value, probed


def test_bisection_finds_the_edge_within_a_factor_of_the_last_step():
    cap, probed = _run(capacity_search(0.25, 8.0, 5), lambda aps: aps <= 1.5)
    assert probed[:2] == [8.0, 0.25]          # the top first, then the bottom
    assert cap <= 1.5 < cap * (8.0 / 0.25) ** (1 / 2 ** 5)
    assert len(probed) == 2 + 5


def test_the_ends_of_the_range():
    assert _run(capacity_search(0.25, 8.0, 3), lambda aps: True) == (8.0, [8.0])
    assert _run(capacity_search(0.25, 8.0, 3), lambda aps: False) == (None, [8.0, 0.25])


@pytest.mark.parametrize("lo,hi,steps", [(0, 1, 1), (2, 1, 1), (1, 2, -1)])
def test_a_bad_range_is_refused(lo, hi, steps):
    with pytest.raises(UsageError):
        next(capacity_search(lo, hi, steps))


def test_a_fig10_record_plots(tmp_path):
    from dualpath.repro import plot

    pts = [{"mode": m, "aps": a, "slo_attainment": s, "ttft_p50_s": 0.3, "ttft_p99_s": 1.0,
            "ttst_p50_s": 0.01, "tpot_p50_s": 0.002, "tpot_p99_s": 0.003}
           for m, a, s in (("basic", 8.0, 0.6), ("basic", 1.0, 1.0), ("dualpath", 8.0, 1.0))]
    rec = {"figure": "fig10", "title": "t", "points": pts,
           "summary": {"capacity_aps_basic": 1.0, "capacity_aps_dualpath": 8.0},
           "scale": {"described": "a scale"}}
    plot.write(rec, str(tmp_path / "fig10.png"))
    assert (tmp_path / "fig10.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
