"""A small dual-path replay over real verbs: scheduler + 1P2D node processes whose
TransferEngines use the RDMA device (rxe in the SoftRoCE guest). Hit KV takes both the PE
read path (storage -> PE buffer -> loopback WRITE -> PE HBM -> WRITE -> DE buffer) and the
DE read path (storage -> DE buffer -> WRITE -> PE buffer -> loopback WRITE -> PE HBM,
misses back), and every prompt byte
is verified at the DE. The cluster speaks mutual TLS, so every node buffer is scoped:
each peer's WRITE lands through the memory regions its grant made in that peer's own PD.
"""

from __future__ import annotations

import pytest

from dualpath.cluster.local import LocalCluster
from dualpath.cluster.replay import replay_local
from dualpath.cluster.run import make_trace
from dualpath.kv.profiles import get_profile

pytestmark = pytest.mark.rdma

PROFILE = get_profile("demo")


def test_dual_path_replay_over_verbs(dev_names, tmp_path):
    trace = make_trace(2, context_scale=0.03, max_rounds=3, seed=3)
    rounds = sum(len(t.rounds) for t in trace.trajectories)
    settings = {"transport": {"kind": "verbs", "device": dev_names[0]},
                "buffers": {"pe_buffer_mib": 32, "de_buffer_mib": 32},
                "engine": {"prefill_hbm_mib": 32, "decode_hbm_mib": 32},
                # Emulated guests are slow: long leases so no group expires mid-test.
                "scheduler": {"lease_ms": 30000}}
    with LocalCluster(1, 2, work_dir=str(tmp_path), settings=settings,
                      start_timeout_s=240) as cluster:
        # round_robin alternates the read side, so both read paths carry hits.
        run = replay_local(cluster, trace, PROFILE, timeout_s=300, read_policy="round_robin")
        metrics = {n: cluster.node_metrics(n) for n in ("p0", "d0", "d1")}
        logs = {n: (tmp_path / "logs" / f"{n}.log").read_text() for n in ("p0", "d0", "d1")}
    for name, text in logs.items():
        assert "transport verbs" in text, f"{name} did not run over verbs"
    assert len(run.records) == rounds
    assert run.bytes_mismatched == 0
    prompt = sum(r.prompt_tokens for r in run.records)
    assert run.bytes_verified == prompt * PROFILE.kv_bytes_per_token
    assert run.snic_bytes["p0"] > 0                               # PE read path ran
    assert run.snic_bytes["d0"] + run.snic_bytes["d1"] > 0        # DE read path ran
    # Under mutual TLS every buffer is scoped: each peer WRITE went through the windows
    # of its grant (keys fetched before writing), and none was refused on a NIC (a
    # refused one errors its QP: a recovery).
    assert metrics["p0"]["dualpath_node_transfer_rescopes_total"] > 0       # PE -> DE
    assert sum(metrics[d]["dualpath_node_transfer_rescopes_total"]
               for d in ("d0", "d1")) > 0                                  # DE -> PE
    for name, m in metrics.items():
        assert m["dualpath_node_transfer_recoveries_total"] == 0, name
