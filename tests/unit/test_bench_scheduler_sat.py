"""bench/scheduler.py's journal-on vs journal-off comparison (issue 12): the sides
alternate, each side's figure is the median over its repetitions, and the ratio is of
those medians."""

from __future__ import annotations

import argparse

from tests.bench_module import load_bench


def test_sides_alternate_and_the_ratio_is_of_the_medians(monkeypatch):
    bench = load_bench("scheduler")
    order = []
    # Plain 10k, 12k, 30k (median 12k); journal 9k, 11k, 1k (median 9k).
    rates = {False: [10e3, 12e3, 30e3], True: [9e3, 11e3, 1e3]}

    def fake_grpc(a):
        assert a.saturate and a.grpc_seconds == 5.0
        order.append(a.journal)
        rps = rates[a.journal].pop(0)
        return {"requests_per_s": rps, "server_cpu_cores": 0.5, "fetch_p99_ms": 1.0,
                "host_other_cpu_cores": 0.0, "journal_calls_per_commit": 2.0,
                "journal_commits_per_s": 100.0}

    monkeypatch.setattr(bench, "run_grpc", fake_grpc)
    args = argparse.Namespace(sat_reps=3, sat_speedup=200.0, sat_fetch_interval_ms=20.0,
                              sat_seconds=5.0)
    out = bench.run_saturated(args)
    assert order == [False, True, True, False, False, True]
    assert out["plain"]["requests_per_s"] == 12e3
    assert out["journal"]["requests_per_s"] == 9e3
    assert out["journal_over_plain"] == 0.75
    assert [r["repetition"] for r in out["runs"]] == [0, 0, 1, 1, 2, 2]
    assert out["plain"]["server_us_per_request"] == 1e6 * 0.5 / 12e3
