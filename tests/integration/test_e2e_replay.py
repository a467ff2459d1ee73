"""End to end over real daemons: a scheduler and a 1P2D cluster as separate processes,
the TCP provider on loopback, a tiny generated trace replayed in each mode. Every prompt
KV byte that reaches a DE is checked against the generator there; the replay fails on
any mismatch, so "verified > 0 and mismatched == 0" is the whole data path working.
"""

from __future__ import annotations

import pytest

from dualpath.cluster.local import LocalCluster
from dualpath.cluster.replay import replay_local
from dualpath.cluster.run import make_trace
from dualpath.kv.profiles import get_profile

pytestmark = pytest.mark.slow

PROFILE = get_profile("demo")
# 4 agents x 3 rounds at a small context: rounds 2 and 3 of each agent hit the KV its
# previous round persisted, so both read paths and persistence are exercised.
TRACE = make_trace(4, context_scale=0.05, max_rounds=3, seed=1)
ROUNDS = sum(len(t.rounds) for t in TRACE.trajectories)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = LocalCluster(1, 2, work_dir=str(tmp_path_factory.mktemp("cluster")),
                     settings={"transport": {"kind": "tcp"},
                               "storage": {"snic_gbit_per_s": 2.0}})
    c.start()
    yield c
    c.stop()


def _replay(cluster, **kw):
    return replay_local(cluster, TRACE, PROFILE, **{"timeout_s": 120, **kw})


@pytest.mark.parametrize("mode,read_policy", [("dualpath", ""), ("basic", ""),
                                              ("dualpath", "round_robin"),
                                              ("dualpath", "split")])
def test_replay_completes_and_verifies(cluster, mode, read_policy):
    run = _replay(cluster, mode=mode, read_policy=read_policy)
    assert len(run.records) == ROUNDS
    assert run.bytes_mismatched == 0
    # The DE verifies every prompt byte: prompt tokens x KV bytes per token, summed.
    prompt = sum(r.prompt_tokens for r in run.records)
    assert run.bytes_verified == prompt * PROFILE.kv_bytes_per_token
    assert run.hit_bytes > 0
    # Hits were read from storage on some node: the reads add up to the hit blocks.
    assert sum(run.snic_bytes.values()) == run.hit_bytes
    if mode == "basic":
        assert run.snic_bytes["d0"] == run.snic_bytes["d1"] == 0
    if read_policy == "round_robin":
        assert run.snic_bytes["d0"] + run.snic_bytes["d1"] > 0    # the DE read path ran
    if read_policy == "split":       # each side read its half of a hit into the PE
        assert run.snic_bytes["p0"] > 0
        assert run.snic_bytes["d0"] + run.snic_bytes["d1"] > 0
    # Every WRITE of a node landed inside the scope its peer granted it (a refused one
    # would end in a recompute: the bytes above would still verify).
    for n in cluster.node_ids():
        m = cluster.node_metrics(n)
        assert m["dualpath_node_data_writes_refused_total"] == 0, (n, mode, read_policy)
        assert m["dualpath_node_data_writes_out_of_scope_total"] == 0


def test_no_layerwise_and_oracle(cluster):
    run = _replay(cluster, mode="dualpath", layerwise=False)
    assert len(run.records) == ROUNDS and run.bytes_verified > 0
    oracle = _replay(cluster, mode="oracle")
    assert len(oracle.records) == ROUNDS
    assert sum(oracle.snic_bytes.values()) == 0 and oracle.bytes_verified == 0


def test_a_replay_whose_reports_never_come_still_ends(cluster):
    # The nodes report to 127.0.0.2, where the sink does not listen: every timings report
    # is lost. Each round ends when the scheduler says so, after the grace; the last
    # round's end used to be checked only when another event came, so the run hung.
    run = _replay(cluster, sink_host="127.0.0.2", timings_grace_s=0.3, timeout_s=60)
    assert len(run.records) == ROUNDS
    assert run.results_without_timings == ROUNDS
    assert run.requests_duplicated == 0


def test_a_warm_up_replays_every_mode_first_then_passes_alternate(cluster, monkeypatch):
    from dualpath.cluster import run as run_mod

    seen = []
    real = run_mod.replay

    async def spy(scheduler, trace, nodes, **kw):
        seen.append((kw["opts"].mode, sum(len(t.rounds) for t in trace.trajectories)))
        return await real(scheduler, trace, nodes, **kw)

    monkeypatch.setattr(run_mod, "replay", spy)
    report, runs = run_mod.run_modes(
        cluster.scheduler_address, cluster.node_ids(), 1, TRACE, ("basic", "dualpath"),
        run_mod.ReplayOptions(progress=False, timeout_s=120), snic_gbit_per_s=2.0,
        tls_config=cluster.client_tls, node_tls=cluster.node_tls,
        node_addresses=cluster.addresses(), warmup_agents=1, repeats=2)
    warm = run_mod.WARMUP_ROUNDS
    # warm-ups unreported, then two measured passes, the second in reverse order
    assert seen == [("basic", warm), ("dualpath", warm), ("basic", ROUNDS),
                    ("dualpath", ROUNDS), ("dualpath", ROUNDS), ("basic", ROUNDS)]
    assert report["settings"]["warmup"] == {"agents": 1, "rounds": warm,
                                            "modes": ["basic", "dualpath"]}
    # What make_trace did to the trace (max_rounds here; extended_from with a short file).
    assert report["settings"]["max_rounds"] == 3 and "extended_from" not in report["settings"]
    rep = report["settings"]["repeats"]
    assert rep["order"] == ["basic", "dualpath", "dualpath", "basic"]
    assert [m for m, _ in rep["jct_s"]] == rep["order"]
    every = report["all_passes"]                       # once, beside the passes' JCTs
    assert "all_passes" not in rep
    assert every["requests_failed"] == 0
    assert every["bytes_mismatched"] == 0
    assert every["bytes_verified"] == sum(r.bytes_verified for r in runs.values()) * 2
    assert all(len(r.records) == ROUNDS for r in runs.values())
    assert {m: r["requests_submitted"] for m, r in report["reliability"].items()} == {
        "basic": ROUNDS, "dualpath": ROUNDS}
