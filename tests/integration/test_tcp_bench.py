"""bench/dataplane.py runs end to end on a tiny sweep and writes the record it prints:
the table's figures, the JSON points, the summary names issue 3 asks for."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_dataplane_bench_tiny_sweep_writes_its_record(tmp_path):
    out = tmp_path / "dp.json"
    cmd = [sys.executable, str(ROOT / "bench" / "dataplane.py"), "--sizes", "4K,64K",
           "--batches", "1,32", "--bytes-per-point", "1M", "--min-iters", "64",
           "--max-iters", "256", "--rounds", "2", "--json", str(out)]
    ucx = shutil.which("ucx_perftest") is not None
    if ucx:
        cmd.append("--vs-ucx")
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr
    rec = json.loads(out.read_text())
    # 2 sizes x 2 batches of ours, each bandwidth the one printed in the table.
    assert [(p["size"], p["batch"]) for p in rec["points"]] == [
        (4096, 1), (4096, 32), (65536, 1), (65536, 32)]
    for p in rec["points"]:
        assert p["bw_mbps"] > 0 and p["post_us_per_wr"] > 0
        assert f"{p['bw_mbps']:.1f}" in run.stdout
    summary = rec["summary"]
    for name in ("verbs_vs_perftest_min_ratio_ge_64k", "verbs_vs_perftest_ratio_4k_batch32",
                 "batch32_vs_batch1_msg_rate_4k", "tcp_vs_ucx_min_ratio_ge_64k",
                 "tcp_auth_overhead_max_ge_64k", "tcp_connect_us_auth", "tcp_connect_us_open"):
        assert name in summary
    # Authenticated against the open twin at the same points, the worst >= 64 KiB.
    twin = {(q["size"], q["batch"]): q for q in rec["peers"] if q["tool"] == "tcp_open"}
    assert sorted(twin) == [(4096, 1), (4096, 32), (65536, 1), (65536, 32)]
    assert summary["tcp_auth_overhead_max_point_ge_64k"] == max(
        round(1 - by_pt["bw_mbps"] / twin[(by_pt["size"], by_pt["batch"])]["bw_mbps"], 3)
        for by_pt in rec["points"] if by_pt["size"] >= 65536)
    # The figure: at 64K (the only size >= 64 KiB), the median over both rounds and both
    # batches of each back-to-back pair's ratio.
    rounds = rec["rounds_bw_mbps"]
    pairs = sorted(a / b for batch in (1, 32) for a, b in zip(rounds[f"ours/65536/{batch}"],
                                                              rounds[f"tcp_open/65536/{batch}"]))
    assert len(pairs) == 4
    assert abs(summary["tcp_auth_overhead_max_ge_64k"]
               - (1 - (pairs[1] + pairs[2]) / 2)) < 2e-3
    assert summary["tcp_auth_overhead_by_size"] == {"64K": summary[
        "tcp_auth_overhead_max_ge_64k"]}
    assert summary["tcp_connect_us_auth"] > 0 and summary["tcp_connect_us_open"] > 0
    assert summary["verbs_vs_perftest_min_ratio_ge_64k"] is None      # no verbs here
    by = {(p["size"], p["batch"]): p for p in rec["points"]}
    assert summary["batch32_vs_batch1_msg_rate_4k"] == round(
        by[(4096, 32)]["msg_rate_mpps"] / by[(4096, 1)]["msg_rate_mpps"], 3)
    if ucx:
        (peer,) = [q for q in rec["peers"] if q["size"] == 65536 and q["tool"] != "tcp_open"]
        assert summary["tcp_vs_ucx_min_ratio_ge_64k"] == round(
            by[(65536, 1)]["bw_mbps"] / peer["bw_mbps"], 3)
        assert "UCX_TLS=tcp,self" in peer["command"]
    else:
        assert summary["tcp_vs_ucx_min_ratio_ge_64k"] is None
