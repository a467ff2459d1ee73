"""bench/sim_validate.py --real-from: the real figures of an earlier record stand in for
new cluster runs (no cluster is started), and a record of other cases is refused."""

from __future__ import annotations

import json
import sys

import pytest

from dualpath.sim.hardware import LOCAL
from tests.bench_module import load_bench

MODES = ("basic", "dualpath", "oracle")


def nodes(case):
    return [*(f"p{i}" for i in range(case.prefill_nodes)),
            *(f"d{i}" for i in range(case.decode_nodes))]


def record(bench, with_runs: bool) -> dict:
    """A record of the --quick cases, each mode's JCT 10 s (passes 9 and 11) and every
    node at 0.5 (0.4 and 0.6 a pass: a spread of 0.2; the spread recorded beside, 0.3,
    is what an older record without the passes has to go by)."""
    cal, val = bench.cases(True)
    rows = []
    for kind, cs in (("calibration", cal), ("validation", val)):
        for case in cs:
            for m in MODES:
                util = {n: 0.5 for n in nodes(case)}
                rows.append({
                    "kind": kind, "case": case.name(), "mode": m,
                    "jct_real_runs_s": [9.0, 11.0], "snic_util_real": util,
                    "snic_util_role_real": {"prefill": 0.5, "decode": 0.5},
                    "snic_util_real_spread": 0.3, "host_cpu_load": 0.3, "real_wall_s": 20.0,
                    **({"snic_util_real_runs": [{n: 0.4 for n in util},
                                                {n: 0.6 for n in util}]}
                       if with_runs else {})})
    return {"rows": rows}


@pytest.mark.parametrize("with_runs", [True, False])
def test_recorded_real_rebuilds_the_runs(tmp_path, with_runs):
    bench = load_bench("sim_validate")
    path = tmp_path / "rec.json"
    path.write_text(json.dumps(record(bench, with_runs)))
    cal, val = bench.recorded_real(str(path))
    assert [c for c, _ in cal] == bench.cases(True)[0]
    assert [c for c, _ in val] == bench.cases(True)[1]
    real = val[0][1]
    assert set(real) == set(MODES)
    assert real["dualpath"]["jct_s"] == 10.0
    # The spread is the passes' where the record has them, the recorded one otherwise.
    sim = {m: {"jct_s": 10.0, "snic_util": real[m]["snic_util"],
               "snic_util_role": real[m]["snic_util_role"]} for m in MODES}
    e = bench.errors(real, sim)["dualpath"]
    assert e["jct_rel_error"] == 0.0
    assert e["snic_util_real_spread"] == pytest.approx(0.2 if with_runs else 0.3)


def test_a_record_of_other_cases_is_refused(tmp_path):
    bench = load_bench("sim_validate")
    rec = record(bench, True)
    rec["rows"][0]["case"] = "9P9D 32k s1 1x1 ctx1"
    path = tmp_path / "rec.json"
    path.write_text(json.dumps(rec))
    with pytest.raises(SystemExit, match="9P9D"):
        bench.recorded_real(str(path))


def test_real_from_runs_no_cluster(tmp_path, monkeypatch):
    bench = load_bench("sim_validate")
    path = tmp_path / "rec.json"
    path.write_text(json.dumps(record(bench, True)))

    def no_cluster(*a, **k):
        raise AssertionError("a cluster was started")

    def sim(case, modes, hw, seeds):
        # 10% long on every case: JCT error 0.1, utilisation 0.5/1.1 on each role.
        return {m: {"jct_s": 11.0, "snic_util": {n: 0.5 / 1.1 for n in nodes(case)},
                    "snic_util_role": {"prefill": 0.5 / 1.1, "decode": 0.5 / 1.1},
                    "jct_runs_s": [11.0]} for m in modes}

    monkeypatch.setattr(bench, "real_runs", no_cluster)
    monkeypatch.setattr(bench, "calibrate", lambda runs, seeds: (LOCAL, 0.5))
    monkeypatch.setattr(bench, "sim_runs", sim)
    out = tmp_path / "out.json"
    monkeypatch.setattr(sys, "argv", ["sim_validate.py", "--real-from", str(path),
                                      "--seeds", "1", "--json", str(out)])
    assert bench.main() == 0
    rec = json.loads(out.read_text())
    assert rec["real_from"] == str(path)
    assert rec["summary"]["real_repeats"] == 2
    assert rec["summary"]["jct_rel_error_max"] == pytest.approx(0.1)
    assert rec["summary"]["snic_util_abs_error_max"] == pytest.approx(0.5 - 0.5 / 1.1)
    assert len(rec["rows"]) == 3 * (len(bench.cases(True)[0]) + len(bench.cases(True)[1]))


@pytest.mark.parametrize("flag", [["--quick"], ["--repeats", "2"]])
def test_real_from_refuses_flags_it_would_ignore(tmp_path, monkeypatch, capsys, flag):
    bench = load_bench("sim_validate")
    monkeypatch.setattr(sys, "argv", ["sim_validate.py", "--real-from", "x.json", *flag])
    with pytest.raises(SystemExit) as e:
        bench.main()
    assert e.value.code == 2
    assert "--real-from" in capsys.readouterr().err
