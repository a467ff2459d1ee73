"""`dualpath repro`: one paper figure at its small scale on the local cluster (fig13, the
storage-NIC balance), its JSON record and PNG; a figure it does not know is a usage
error."""

from __future__ import annotations

import json

import pytest

from dualpath import cli


def test_fig13_quick_writes_its_record_and_plot(tmp_path, capsys):
    assert cli.main(["repro", "fig13", "--quick", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    rec = json.loads((tmp_path / "fig13.json").read_text())
    assert (tmp_path / "fig13.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert rec["figure"] == "fig13" and rec["model_execution"] == "emulated (cost model)"
    assert "emulated" in rec["scale"]["described"] and rec["scale"]["agents"] == 8
    assert [p["policy"] for p in rec["points"]] == ["round-robin", "dualpath scheduler"]
    # max/avg over nodes is at least 1 by definition, at most the node count (3).
    for key in ("snic_max_avg_dualpath", "snic_max_avg_round_robin"):
        assert 1.0 <= rec["summary"][key] <= 3.0, rec["summary"]
    assert all(p["jct_s"] > 0 for p in rec["points"])
    assert rec["paper"] == {"snic_max_avg_round_robin": 1.53, "snic_max_avg_dualpath": 1.18}
    assert "snic_max_avg_dualpath" in out and "wrote" in out


def test_an_unknown_figure_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as ei:
        cli.main(["repro", "fig99", "--out", str(tmp_path)])
    assert ei.value.code == 2
    assert "fig99" in capsys.readouterr().err
