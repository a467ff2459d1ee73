"""The cluster simulator (dualpath/sim): its queueing parts, conservation, and that it
shows the storage bottleneck the fluid load generator cannot."""

from __future__ import annotations

import itertools
from dataclasses import replace
from statistics import fmean

import pytest

from dualpath.cli import main
from dualpath.cluster.run import make_trace
from dualpath.kv import cost
from dualpath.kv.profiles import get_profile
from dualpath.sim.cluster import SimCluster
from dualpath.sim.hardware import LOCAL, Shape
from dualpath.sim.nodes import DecodeEngine, SimRequest
from dualpath.sim.resources import Link, Pool
from dualpath.trace.model import plan_rounds


def trace(agents=12, rounds=4, seed=3):
    return make_trace(agents, table="32k", context_scale=0.1, max_rounds=rounds, seed=seed)


def test_link_is_fifo_at_its_rate():
    ln = Link("x", 100.0, window_s=1.0)
    assert ln.reserve(0.0, 100) == 1.0
    assert ln.reserve(0.5, 50) == 1.5          # waits for the first job
    assert ln.reserve(3.0, 100) == 4.0         # idle link: starts at once
    assert ln.backlog(3.5) == pytest.approx(50)
    assert ln.windows[0] == pytest.approx(100) and ln.windows[1] == pytest.approx(50)
    assert Link("inf", 0).reserve(2.0, 1e9) == 2.0


def test_pool_is_fifo_with_backpressure():
    p, got = Pool("b", 10), []
    p.acquire(8, lambda: got.append("a"))
    p.acquire(5, lambda: got.append("b"))
    p.acquire(1, lambda: got.append("c"))      # fits, but waits behind b (FIFO)
    assert got == ["a"]
    p.release(8)
    assert got == ["a", "b", "c"] and p.free == 4


def test_fluid_decode_step_is_the_cost_models():
    """The DE's fluid step equals decode_step_s over the members' mean contexts."""
    prof = get_profile("demo")
    de = DecodeEngine("d0/e0", None, prof, 1000)
    reqs = [SimRequest(f"r{i}", 0, i, "dualpath", 1000 * (i + 1), 0, 200, 0.0)
            for i in range(3)]
    for r in reqs:
        de.join(r, 0.0)
    want = cost.decode_step_s(prof, [r.prompt + r.gen / 2 for r in reqs])
    assert de.step_s() == pytest.approx(want, rel=1e-6)
    # 199 more tokens each at that step: all finish together.
    assert de.next_finish(0.0) == pytest.approx(199 * want, rel=1e-6)
    assert len(de.due(199 * want + 1e-9)) == 3 and de.members == 0


@pytest.mark.parametrize("mode", ["basic", "dualpath", "oracle"])
def test_every_request_completes_exactly_once(mode):
    tr = trace()
    r = SimCluster(Shape(2, 2), LOCAL, tr, mode).run()
    want = {(a, k) for a, t in enumerate(tr.trajectories) for k in range(len(t.rounds))}
    got = [(x.agent, x.round) for x in r.records]
    assert sorted(got) == sorted(want)
    assert r.extra["duplicate_completions"] == 0
    # Rounds of an agent run one after the other.
    for a in range(len(tr.trajectories)):
        mine = sorted((x for x in r.records if x.agent == a), key=lambda x: x.round)
        assert all(p.finish_s <= n.submit_s for p, n in itertools.pairwise(mine))


def test_storage_bound_basic_tracks_the_pe_nic():
    """Basic reads every hit through the PE node's NIC: JCT is at least its bytes over
    the NIC's rate, and a storage-bound run is not much more (the NIC is busy)."""
    tr = trace(agents=16)
    r = SimCluster(Shape(1, 2), LOCAL, tr, "basic").run()
    rate = LOCAL.snic_bytes_per_s
    hit_bytes = sum(p.hit_tokens for t in tr.trajectories
                    for p in plan_rounds(t, 64)) * get_profile("demo").kv_bytes_per_token
    assert r.snic_read_bytes["p0"] == pytest.approx(hit_bytes)
    assert r.snic_read_bytes["d0"] == r.snic_read_bytes["d1"] == 0
    floor = hit_bytes / rate
    assert floor <= r.sim_s <= 1.3 * floor


def test_dualpath_wins_when_storage_bound_not_when_compute_bound():
    tr = trace(agents=16)
    jct = {m: SimCluster(Shape(1, 2), LOCAL, tr, m).run().sim_s for m in ("basic", "dualpath")}
    assert jct["basic"] / jct["dualpath"] > 1.8          # 3 NICs instead of 1
    # No storage limit and a slow GPU: the PE's compute is the bottleneck either way.
    hw = LOCAL.with_(snic_bytes_per_s=0, speed_scale=0.002)
    jct = {m: SimCluster(Shape(1, 2), hw, tr, m).run().sim_s for m in ("basic", "dualpath")}
    assert jct["basic"] / jct["dualpath"] == pytest.approx(1.0, abs=0.15)


def test_cli_usage_errors_exit_2(capsys):
    assert main(["sim", "--modes", "fast"]) == 2
    assert "--modes" in capsys.readouterr().err
    assert main(["sim", "--prefill-nodes", "0"]) == 2
    assert "--prefill-nodes" in capsys.readouterr().err
    assert main(["sim", "--agents", "0"]) == 2
    assert main(["sim", "--max-rounds", "-1"]) == 2      # ran every round, exit 0
    assert "--max-rounds" in capsys.readouterr().err
    assert main(["repro", "table3", "--quick", "--online-aps", "0"]) == 2  # ran offline
    assert "--online-aps" in capsys.readouterr().err
    assert main(["repro", "table3", "--quick", "--shapes", "2P4D",
                 "--speed-horizon-s", "10"]) == 2        # was ignored
    assert "--speed-horizon-s" in capsys.readouterr().err


def test_cli_writes_the_replay_report(tmp_path, capsys):
    out = tmp_path / "s.json"
    assert main(["sim", "--agents", "4", "--max-rounds", "2", "--modes", "dualpath",
                 "--json", str(out), "--plot", str(tmp_path / "s.png")]) == 0
    import json

    rep = json.loads(out.read_text())
    assert rep["settings"]["model_execution"].startswith("simulated")
    s = rep["modes"]["dualpath"]
    assert s["requests"] == 8 and s["scheduler_cpu"]["fetches"] > 0
    assert (tmp_path / "s.png").stat().st_size > 0
    assert "simulated" in capsys.readouterr().out


def test_plan_recommends_and_writes_a_valid_deploy_toml(tmp_path):
    from dualpath.config import load as load_config
    from dualpath.sim.plan import deploy_toml, plan

    tr = trace(agents=8, rounds=3)
    res = plan(tr, LOCAL, 3, buffers_bytes=[LOCAL.pe_buffer_bytes], alpha_xs=[1.0],
               beta_xs=[1.0, 2.0])
    stages = [c["stage"] for c in res["candidates"]]
    assert stages == ["P/D", "P/D", "alpha/beta"]
    assert res["chosen"]["jct_s"] == min(c["jct_s"] for c in res["candidates"])
    assert res["simulated_pd_range"]["low"] <= res["simulated_pd_range"]["high"]
    text = deploy_toml(res, LOCAL)
    path = tmp_path / "deploy.toml"
    path.write_text(text)
    cfg = load_config(str(path))            # every key exists and validates
    assert cfg.buffers.pe_buffer_mib == 512 and cfg.engine.engines_per_node == 1
    # What the plan assumed of the emulated hardware is in it (it used to be dropped).
    assert cfg.engine.speed_scale == pytest.approx(LOCAL.speed_scale)
    assert cfg.storage.snic_gbit_per_s == pytest.approx(LOCAL.snic_bytes_per_s * 8 / 1e9)
    # An unlimited NIC stays unlimited (0), not capped at the rate alpha counts it as.
    free = LOCAL.with_(snic_bytes_per_s=0)
    path.write_text(deploy_toml(res, free))
    cfg = load_config(str(path))
    assert cfg.storage.snic_gbit_per_s == 0
    assert cfg.scheduler.storage_read_bytes_per_s == pytest.approx(free.snic_rate)
    with pytest.raises(Exception, match="nodes"):
        plan(tr, LOCAL, 1, buffers_bytes=[1], alpha_xs=[1.0], beta_xs=[1.0])


def test_table3_flags_are_refused_for_other_figures(tmp_path, capsys):
    assert main(["repro", "fig13", "--out", str(tmp_path), "--shapes", "2P4D"]) == 2
    assert "table3 only" in capsys.readouterr().err
    assert main(["repro", "table3", "--out", str(tmp_path), "--shapes", "2X4"]) == 2


def test_a_de_part_crosses_to_the_pe_when_it_was_read_not_when_it_was_queued():
    """A DE's part is booked on the compute network once its read ended: a small part
    read by an idle DE reaches the PE long before a large one queued on another DE's
    storage NIC (booked at queueing time, it waited behind that one's future slot)."""
    sim = SimCluster(Shape(1, 2), replace(LOCAL, host_cores=0.0), trace(2, 2), "dualpath")
    pe = sim.pe_nodes[0].engines[0]
    d0, d1 = (n.engines[0] for n in sim.de_nodes)
    staged = {}
    sim._staged = lambda r: staged.setdefault(r.request_id, sim.loop.now)
    big = SimRequest("big", 0, 1, "dualpath", 64_064, 64_000, 1, 0.0, pe=pe, de=d0,
                     remote_tokens=64_000)
    small = SimRequest("small", 1, 1, "dualpath", 128, 64, 1, 0.0, pe=pe, de=d1,
                       remote_tokens=64)
    sim._read(big)
    sim._read(small)
    sim.loop.run()
    read_s = 64_000 * sim.kvt / LOCAL.snic_bytes_per_s
    assert staged["big"] >= read_s
    assert staged["small"] < read_s / 100


def test_an_agents_next_round_waits_for_its_blocks_on_the_write_direction():
    """As the emulated DE's (paths/decode.py): DECODE_DONE waits for the request's new
    full blocks to be written through the storage NIC's write direction, so the next
    round starts no sooner than those bytes take at its rate."""
    res = SimCluster(Shape(1, 2), LOCAL, trace(6, 3), "dualpath").run()
    prof, T = LOCAL.profile, LOCAL.profile.block_tokens
    by_agent = {}
    for rec in res.records:
        by_agent.setdefault(rec.agent, []).append(rec)
    checked = 0
    for recs in by_agent.values():
        recs.sort(key=lambda x: x.round)
        for prev, nxt in itertools.pairwise(recs):
            blocks = (prev.prompt_tokens + prev.gen_tokens) // T - prev.hit_tokens // T
            write_s = blocks * prof.full_block_bytes / LOCAL.snic_bytes_per_s
            assert nxt.submit_s - prev.finish_s >= write_s - 1e-9
            checked += blocks > 0
    assert checked >= 6


def test_a_leader_sleeps_only_while_its_fetch_would_change_nothing():
    """``_noop``, the test a tick makes before skipping its fetch: a PE leader with work
    queued fetches while one of its engines is at or under beta; a DE leader fetches
    while the core holds another sum of its engines' tok_e than they have (the group
    phase of other groups reads it) or a read queue its node has left behind while a
    queued request's read side will read it."""
    sim = SimCluster(Shape(1, 1), replace(LOCAL, host_cores=0.0), trace(2, 2), "dualpath")
    pe_ld, de_ld = sim.pe_nodes[0].leader, sim.de_nodes[0].leader
    assert sim._noop(pe_ld, 0.0) and sim._noop(de_ld, 0.0)      # nothing queued
    sim._submit([(0, 0)])
    assert not sim._noop(de_ld, 0.0)                             # the group phase
    sim._tick(de_ld)                                             # places it on the DE
    assert sim.de_nodes[0].in_prefill_queue == 1 and sim.core.prefill_queue
    pe = sim.pe_nodes[0].engines[0]
    assert not sim._noop(pe_ld, 0.0)
    pe.tok = sim.core.params.beta_tokens + 1                     # every PE past beta
    assert sim._noop(pe_ld, 0.0)
    pe.tok = 0
    # The core counted the placement in the DE's tok_e before the DE has it.
    assert not sim._noop(de_ld, 0.0)
    r, de = sim.requests["a0-r0"], sim.de_nodes[0].engines[0]
    sim._placed(r, de)
    assert sim._noop(de_ld, 0.0)
    sim.de_nodes[0].read.reserve(0.0, 1e9)                       # its read queue moves
    assert not sim._noop(de_ld, 0.0)
    sim.de_nodes[0].in_prefill_queue = 0                         # ... but nobody reads it
    assert sim._noop(de_ld, 0.0)


def test_skipping_fetches_that_change_nothing_keeps_the_run():
    """The same cluster with every leader fetching on every tick until the last request
    ends: the same requests finish, in about the same time over a few seeds (a sleeping
    leader's skipped round trips are drawn anew, so runs are not identical; one seed's
    JCT varies by ~5%), with far fewer fetches."""
    tr = trace(agents=16)
    fast, slow = [], []
    for seed in range(8):
        fast.append(SimCluster(Shape(1, 2), LOCAL, tr, "dualpath", seed=seed).run())
        every = SimCluster(Shape(1, 2), LOCAL, tr, "dualpath", seed=seed)
        every._noop = lambda ld, now, asleep=False, c=every: c.left == 0
        slow.append(every.run())
    for a, b in zip(fast, slow):
        assert sorted((x.agent, x.round) for x in a.records) == \
            sorted((x.agent, x.round) for x in b.records)
    assert fmean(r.sim_s for r in fast) == pytest.approx(fmean(r.sim_s for r in slow),
                                                         rel=0.05)
    fetches = [sum(r.scheduler_cpu["fetches"] for r in rs) for rs in (fast, slow)]
    assert fetches[0] < 0.5 * fetches[1]
