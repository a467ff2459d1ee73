"""Report math on hand-made records, the comparison across modes, storage-NIC load, the
three outputs (table, JSON, PNG) and the progress bar."""

import io
import json

import pytest

from dualpath.errors import UsageError
from dualpath.trace.progress import Progress
from dualpath.trace.report import (
    ModeResult,
    RequestRecord,
    attention_balance,
    build_report,
    compare,
    format_table,
    io_lower_bound_s,
    snic_usage,
    summarize,
    to_json,
    ttft_breakdown,
    write_plot,
)


def rec(agent, rnd, submit, first, second, finish, prompt, hit, gen):
    return RequestRecord(agent, rnd, submit, first, second, finish, prompt, hit, gen)


# TTFT, TTST, TPOT per record (TPOT = (finish - second) / (gen - 2)):
R = [
    rec(0, 0, 0.0, 1.0, 1.2, 2.2, 100, 0, 12),    # 1.0, 0.2,  (2.2-1.2)/10 = 0.1
    rec(0, 1, 2.2, 2.7, 2.8, 3.2, 200, 128, 6),   # 0.5, 0.1,  (3.2-2.8)/4  = 0.1
    rec(1, 0, 0.0, 5.0, None, 5.0, 50, 0, 1),     # 5.0, -,    -
    rec(1, 1, 5.0, 5.5, 5.52, 5.53, 80, 64, 2),   # 0.5, 0.02, - (gen 2)
]


def test_summary_by_hand():
    s = summarize(R)
    assert s["jct_s"] == pytest.approx(5.53)  # last finish 5.53 - first submit 0.0
    assert (s["requests"], s["agents"]) == (4, 2)
    assert (s["prompt_tokens"], s["hit_tokens"], s["gen_tokens"]) == (430, 192, 21)
    # TTFT [1.0, 0.5, 5.0, 0.5]: mean 7/4; sorted [0.5, 0.5, 1.0, 5.0] -> p50 = 0.75;
    # p99 at rank 0.99 x 3 = 2.97 -> 1.0 + 0.97 x (5.0 - 1.0) = 4.88.
    assert s["ttft_s"] == pytest.approx({"count": 4, "mean": 1.75, "p50": 0.75, "p99": 4.88})
    # TTST [0.2, 0.1, 0.02]: mean 0.32 / 3, p50 0.1. TPOT [0.1, 0.1].
    assert s["ttst_s"]["count"] == 3
    assert s["ttst_s"]["mean"] == pytest.approx(0.32 / 3)
    assert s["ttst_s"]["p50"] == pytest.approx(0.1)
    assert s["tpot_s"] == pytest.approx({"count": 2, "mean": 0.1, "p50": 0.1, "p99": 0.1})
    # throughput over the JCT: 21 generated tokens, 430 prompt tokens, 4 requests
    assert s["throughput"]["gen_tokens_per_s"] == pytest.approx(21 / 5.53)
    assert s["throughput"]["prompt_tokens_per_s"] == pytest.approx(430 / 5.53)
    assert s["throughput"]["requests_per_s"] == pytest.approx(4 / 5.53)
    assert summarize(R, start_s=-1.0)["jct_s"] == pytest.approx(6.53)


@pytest.mark.parametrize("scale, attained", [
    # 4 s / 50 ms: only record 4 passes (1, 2 have TPOT 100 ms; 3 has TTFT 5 s).
    (1.0, 0.25),
    # 6 s / 75 ms: record 3 passes now (TTFT 5 s), 1 and 2 still fail on TPOT.
    (1.5, 0.5),
    # 10 s / 125 ms: everything passes.
    (2.5, 1.0),
])
def test_slo_attainment_scales_with_the_model(scale, attained):
    s = summarize(R, slo_scale=scale)
    assert s["slo"]["attainment"] == attained
    assert s["slo"]["ttft_limit_s"] == pytest.approx(4.0 * scale)
    assert s["slo"]["tpot_limit_s"] == pytest.approx(0.05 * scale)


def test_record_checks():
    with pytest.raises(UsageError, match="second_token_s must be given"):
        rec(0, 0, 0.0, 1.0, None, 2.0, 10, 0, 5)
    with pytest.raises(UsageError, match="must not decrease"):
        rec(0, 0, 1.0, 0.5, 0.6, 2.0, 10, 0, 5)
    with pytest.raises(UsageError, match="hit_tokens"):
        rec(0, 0, 0.0, 1.0, 1.1, 2.0, 10, 11, 5)


def test_comparison_by_hand():
    rows = compare({"oracle": {"jct_s": 12.0}, "basic": {"jct_s": 30.0},
                    "dualpath": {"jct_s": 15.0}}, {"dualpath": 14.0})
    by = {r["mode"]: r for r in rows}
    assert [r["mode"] for r in rows] == ["basic", "dualpath", "oracle"]
    # speedup = 30 / JCT: 1, 2, 2.5
    assert [r["speedup_vs_basic"] for r in rows] == [1.0, 2.0, 2.5]
    # efficiency = max(I/O lower bound, oracle JCT) / JCT: basic 12/30, dualpath
    # max(14, 12)/15, oracle 12/12
    assert by["basic"]["efficiency"] == pytest.approx(0.4)
    assert by["dualpath"]["efficiency"] == pytest.approx(14 / 15)
    assert by["oracle"]["efficiency"] == 1.0
    # gain captured = (speedup - 1) / (2.5 - 1): 0, 1/1.5, 1
    assert by["dualpath"]["gain_captured"] == pytest.approx(2 / 3)
    assert (by["basic"]["gain_captured"], by["oracle"]["gain_captured"]) == (0.0, 1.0)
    # without basic or oracle the relative figures are absent, not invented
    (only,) = compare({"dualpath": {"jct_s": 15.0}})
    assert (only["speedup_vs_basic"], only["efficiency"], only["gain_captured"]) == \
        (None, None, None)


def test_snic_usage_by_hand():
    u = snic_usage({"p0": 300_000_000, "d0": 150_000_000, "d1": 150_000_000},
                   rate_bytes_per_s=100e6, duration_s=5.0,
                   windows=[{"p0": 10, "d0": 10, "d1": 10}, {"p0": 30}, {}])
    # utilisation = bytes / (100 MB/s x 5 s = 500 MB)
    assert {n: v["utilisation"] for n, v in u["nodes"].items()} == \
        pytest.approx({"p0": 0.6, "d0": 0.3, "d1": 0.3})
    assert u["max_avg"] == pytest.approx(1.5)  # 300 / mean(300, 150, 150) = 300 / 200
    # windows: 10/10 = 1.0; 30 / mean(30, 0, 0) = 3.0; the idle window is skipped
    assert u["window_max_avg"] == pytest.approx(2.0)
    # weighted by bytes: (1.0 x 30 + 3.0 x 30) / 60 = 2.0; a light straggler window
    # weighs little: (1.0 x 300 + 3.0 x 30) / 330 = 390 / 330
    assert u["window_max_avg_bytes_weighted"] == pytest.approx(2.0)
    w = snic_usage({"p0": 1, "d0": 1, "d1": 1}, rate_bytes_per_s=1, duration_s=1,
                   windows=[{"p0": 100, "d0": 100, "d1": 100}, {"p0": 30}])
    assert w["window_max_avg"] == pytest.approx(2.0)
    assert w["window_max_avg_bytes_weighted"] == pytest.approx(390 / 330)
    with pytest.raises(UsageError, match="unknown node 'x'"):
        snic_usage({"p0": 1}, rate_bytes_per_s=1, duration_s=1, windows=[{"x": 1}])
    # 600 MB over 3 NICs of 100 MB/s = 2 s
    assert io_lower_bound_s(600_000_000, 3, 100e6) == pytest.approx(2.0)


def _report(replay_mode="offline"):
    fast = [rec(0, 0, 0.0, 0.4, 0.5, 1.0, 100, 0, 12), rec(1, 0, 0.0, 0.5, 0.6, 1.5, 80, 0, 3)]
    slow = [rec(0, 0, 0.0, 1.0, 1.2, 2.2, 100, 0, 12), rec(1, 0, 0.0, 2.0, 2.1, 3.0, 80, 0, 3)]
    results = [
        ModeResult("basic", slow, {"p0": 200_000_000, "d0": 0, "d1": 0}),
        ModeResult("dualpath", fast, {"p0": 70_000_000, "d0": 65_000_000, "d1": 65_000_000},
                   io_lower_bound_s=0.9, extra={"bytes_verified": 123}),
        ModeResult("oracle", [rec(0, 0, 0.0, 0.3, 0.4, 1.2, 100, 0, 12)], {"p0": 0, "d0": 0,
                                                                            "d1": 0}),
    ]
    return build_report(results, replay_mode=replay_mode, rate_bytes_per_s=100e6,
                        context_scale=0.01, trace={"trajectories": 2, "turns": 1.0,
                                                   "append_tokens": 90.0, "gen_tokens": 7.5,
                                                   "total_tokens": 97.5,
                                                   "context_tokens": 90.0})


def test_report_table_and_json():
    rep = _report()
    assert rep["settings"]["context_scale"] == 0.01
    assert rep["settings"]["model_execution"].startswith("emulated")
    assert rep["modes"]["dualpath"]["bytes_verified"] == 123
    # basic JCT 3.0 s, dualpath 1.5 s -> speedup 2.00; basic p0 reads 200 MB in 3 s at
    # 100 MB/s -> 66.7%; basic's max/avg = 200 / (200/3) = 3.00
    by = {c["mode"]: c for c in rep["comparison"]}
    assert by["dualpath"]["speedup_vs_basic"] == pytest.approx(2.0)
    assert rep["modes"]["basic"]["snic"]["nodes"]["p0"]["utilisation"] == pytest.approx(2 / 3)
    assert rep["modes"]["basic"]["snic"]["max_avg"] == pytest.approx(3.0)
    assert rep["modes"]["oracle"]["snic"]["max_avg"] is None  # no traffic at all
    table = format_table(rep)
    for needle in ("context_scale 0.01", "emulated", "JCT(s)", "speedup(x)", "TPOT p50(ms)",
                   "util(%)", "read(MB)", "max/avg"):
        assert needle in table, needle
    dual_line = next(ln for ln in table.splitlines() if ln.startswith("dualpath "))
    assert "2.00" in dual_line and "1.500" in dual_line
    assert json.loads(to_json(rep)) == json.loads(json.dumps(rep))


@pytest.mark.parametrize("replay_mode", ["offline", "online"])
def test_plot_is_a_png(tmp_path, replay_mode):
    path = tmp_path / "replay.png"
    write_plot(_report(replay_mode), str(path))
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 5000  # two labelled panels; an empty canvas would be far smaller


class TTY(io.StringIO):
    def isatty(self):
        return True


def test_progress_draws_on_a_tty_and_is_silent_otherwise():
    t = [0.0]
    out = TTY()
    with Progress(4, "rounds", stream=out, clock=lambda: t[0], min_interval_s=1.0) as bar:
        bar.advance()           # drawn (first)
        bar.advance()           # throttled: same instant
        t[0] = 2.0
        bar.advance(2)          # drawn (last)
    text = out.getvalue()
    assert text.count("\r") == 3 and text.endswith("\n")  # two draws plus the closing one
    assert "[" + "#" * 30 + "] 4/4 rounds 100.0%" in text
    quiet = io.StringIO()  # not a TTY
    with Progress(4, stream=quiet) as bar:
        bar.advance(4)
    assert quiet.getvalue() == ""
    off = TTY()
    with Progress(4, stream=off, enabled=False) as bar:
        bar.advance(4)
    assert off.getvalue() == ""


def test_ttft_breakdown_splits_the_wait_at_each_mark_and_skips_rows_without_one():
    rows = [(10.0, 10.5, 10.6, 12.6, 13.0),      # 0.5 scheduling, 0.1, 2.0 reading, 0.4
            (20.0, 21.5, 21.6, 21.6, 22.0),      # 1.5, 0.1, 0.0, 0.4
            (30.0, 0.0, 0.0, 0.0, 31.0)]         # a vLLM prefill: no breakdown
    b = ttft_breakdown(rows)
    assert b == pytest.approx({"scheduling": 1.0, "allocating": 0.1, "reading": 1.0,
                               "prefill": 0.4})
    assert ttft_breakdown(rows[2:]) is None


def test_attention_balance_weights_steps_by_time_and_counts_an_idle_engine():
    steps = [(1.0, [1.0, 1.0]),                  # balanced
             (3.0, [2.0, 0.0]),                  # one engine idle: max/avg 2
             (1.0, [0.0, 0.0])]                  # no attention: left out
    b = attention_balance(steps)
    assert b["steps"] == 2
    assert b["max_avg_mean"] == pytest.approx((1.0 * 1 + 2.0 * 3) / 4)
    assert b["max_avg_p90"] == 2.0
    assert attention_balance([(1.0, [0.0])]) is None
