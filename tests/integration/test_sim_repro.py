"""The simulator's commands end to end: `dualpath repro table3 --quick` (its record,
summary keys and PNG) and one small validation case — a real local cluster and the
simulator replaying the same trace (bench/sim_validate.py's method, at a test's size)."""

from __future__ import annotations

import json

from dualpath import cli
from dualpath.sim.hardware import LOCAL
from dualpath.sim.validate import Case, errors, real_runs, sim_runs


def test_table3_quick_writes_its_record(tmp_path, capsys):
    out = tmp_path / "t3.json"
    assert cli.main(["repro", "table3", "--quick", "--out", str(tmp_path), "--json",
                     str(out), "--online-agents", "0"]) == 0
    rec = json.loads(out.read_text())
    assert rec["model_execution"].startswith("simulated")
    assert [p["shape"] for p in rec["points"]] == ["2P4D", "4P8D", "8P16D"]
    assert all(p["complete"] and p["jct_s"] > 0 for p in rec["points"])
    s = rec["summary"]
    # Near-linear scaling holds by construction with per-node NICs (issue 14); the
    # scheduler's CPU is measured, not modelled, so only bounded loosely.
    assert 0.8 < s["per_gpu_throughput_8p16d_vs_2p4d"] < 1.2
    # The two equivalences the real cluster keeps with its write-back paced hold in the
    # simulator; the third (dualpath 2P1D vs 1P2D) the real one breaks, 0.26 (one DE
    # writes every block: docs/reproduction.md), and so does the simulator.
    eq = s["fig8_equivalences"]
    assert eq["dualpath_1p1d_vs_basic_2p1d"] < 0.15 and eq["basic_1p1d_vs_1p2d"] < 0.15
    assert eq["dualpath_2p1d_vs_1p2d"] > 0.15
    assert s["fig8_equivalence_predicted_rel_error"] == max(
        v for k, v in eq.items() if k != "jct_s")
    assert s["sim_speed_over_real_time_48p96d"] is None     # not run at --quick
    assert (tmp_path / "table3.png").read_bytes()[:4] == b"\x89PNG"
    assert "fig8_equivalence_predicted_rel_error" in capsys.readouterr().out


def test_simulator_tracks_a_real_storage_bound_run():
    """1P2D, 12 agents x 3 rounds, 0.25 Gbit/s storage NICs: the simulated JCT within 25%
    of the real one in basic and dualpath, and dualpath faster in both. A test's run is
    small, and its real JCT moves with the host's load (dualpath's 2.5 s run of 8 agents
    came out 23% slower than simulated on a loaded host); bench/sim_validate.py measures
    the errors on bigger runs (docs/sim.md)."""
    case = Case("32k", 5, 12, 3, 0.1, 1, 2, 0.25)
    modes = ("basic", "dualpath")
    real = real_runs(case, modes)
    sim = sim_runs(case, modes, LOCAL)
    err = errors(real, sim)
    for m in modes:
        assert err[m]["jct_rel_error"] < 0.25, err
    assert real["dualpath"]["jct_s"] < real["basic"]["jct_s"]
    assert sim["dualpath"]["jct_s"] < sim["basic"]["jct_s"]
