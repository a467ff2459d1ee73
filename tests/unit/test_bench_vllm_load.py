"""bench/vllm_load.py's pure parts: its usage errors (exit 2 before anything starts) and
the summary it derives from a record."""

from __future__ import annotations

import argparse
import json

import pytest

from tests.bench_module import load_bench

bench = load_bench("vllm_load")


@pytest.mark.parametrize("argv", [["--ks", "0"], ["--ks", "a,b"], ["--cases", "x"],
                                  ["--reps", "0"],
                                  ["--prefix-tokens", "8150", "--max-model-len", "8192"]])
def test_bad_usage_exits_2_before_anything_starts(argv, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    assert e.value.code == 2
    assert "usage" in capsys.readouterr().err


def test_the_summary_is_medians_side_by_side(tmp_path, capsys):
    rec = {"settings": {"model": "m"},
           "concurrent": {"1": {"dualpath": [2.0, 3.0, 4.0], "vllm": [1.0, 1.0, 2.0]},
                          "4": {"dualpath": [5.0, 6.0, 9.0], "vllm": [4.0, 5.0, 4.0]},
                          "8": {"dualpath": [8.0], "vllm": [5.0]}},
           "agentic": {"dualpath": [{"jct_s": 12.0}], "vllm": [{"jct_s": 10.0}]},
           "startup_s": {"dualpath": 50.0, "vllm": 25.0},
           "idle_cores": {"dualpath": 0.04, "vllm": 0.01},
           "tokens_mismatched": 0, "load_timeouts": 0, "lease_losses": 0}
    out = tmp_path / "r.json"
    args = argparse.Namespace(max_model_len=8192, reps=3, prefix_tokens=6144, agents=8,
                              rounds=4, json=str(out))
    assert bench.report(rec, [1, 4, 8], args) == 0
    s = json.loads(out.read_text())["summary"]
    assert s["concurrent_hit_wall_vs_vllm"] == {"1": 3.0, "4": 1.5, "8": 1.6}
    assert s["concurrent_hit_wall_vs_vllm_max"] == 1.6          # K = 4 and 8 only
    assert s["agentic_jct_vs_vllm"] == 1.2 and s["idle_cores"] == 0.04
    assert "| K=4 concurrent" in capsys.readouterr().out
