"""bench/pipeline.py end to end on a tiny run: the nodes really sit in network
namespaces of their own (addresses on the bench's bridge, none on loopback), the KV they
move verifies, and the record carries every figure the issue names."""

from __future__ import annotations

import ipaddress
import json
import shutil
import sys
from pathlib import Path

import pytest

from tests import netns

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import pipeline


@pytest.mark.skipif(bool(netns.available()), reason=netns.available() or "")
@pytest.mark.skipif(not (shutil.which("fio") and shutil.which("iperf3")),
                    reason="fio and iperf3 are needed (tools/install-system-packages.sh)")
def test_pipeline_bench_runs_its_nodes_in_namespaces(tmp_path, capsys):
    out = tmp_path / "pipeline.json"
    assert pipeline.main(["--agents", "2", "--rounds", "2", "--context-scale", "0.05",
                          "--small", "3", "--disk-gib", "0.25", "--proj-blocks", "16",
                          "--calls-requests", "2", "--net-seconds", "1",
                          "--verify-fraction", "1",
                          "--json", str(out)]) == 0
    rec = json.loads(out.read_text())
    nodes = rec["nodes"]
    hosts = {n: ipaddress.ip_address(nodes[n].rpartition(":")[0]) for n in ("p0", "d0", "d1")}
    sched = ipaddress.ip_address(nodes["scheduler"].rpartition(":")[0])
    assert len(set(hosts.values())) == 3 and not any(h.is_loopback for h in hosts.values())
    net = ipaddress.ip_network(f"{sched}/24", strict=False)
    assert all(h in net for h in hosts.values()) and not sched.is_loopback
    assert len(set(nodes["namespaces"].values())) == 3
    s = rec["summary"]
    assert s["kv_bytes_mismatched"] == 0 and s["verified_fraction_of_kv"] == 1.0
    assert rec["throughput"]["kv_verified_bytes"] > 0
    assert rec["throughput"]["storage_read_bytes"] > 0       # hits came from storage
    for k in ("kv_gbytes_per_s_vs_disk_limit", "cluster_cpu_s_per_gb",
              "cpu_ms_per_small_request", "projected_cores_50gbps",
              "python_calls_per_request_layer_64_over_1_blocks"):
        assert s[k] > 0, k
    # the emulator's work is counted apart, by kind, from the nodes' own metrics
    assert s["emulator_cpu_s_per_gb"] > 0
    assert "summary" in capsys.readouterr().out
