"""The core driven by the synthetic cluster (the bench's set-up, small): work flows from
submission to DECODE_DONE, nothing is lost on the way, and the policies balance load."""

import pytest

from dualpath.kv.profiles import get_profile
from dualpath.scheduler.core import Params, ReadSide, Role, Scheduler, policy
from dualpath.scheduler.sim import SimCluster
from tests.unit.test_sched_properties import audit


def drive(s, cl, rounds, dt, submit_per_round):
    order = list(cl.groups)
    for _ in range(rounds):
        cl.now += dt
        if submit_per_round:
            s.submit(cl.new_requests(submit_per_round))
        # Leaders fetch in an order that changes every round, as independent timers would.
        cl.rng.shuffle(order)
        for g in order:
            done = cl.step(g, dt)
            if done:
                s.report(g.group_id, g.lease_id, done, cl.now)
            res = s.fetch(g.group_id, g.lease_id, g.reports(), cl.now)
            cl.drop(res.cancelled)
            cl.absorb_requests(g, res.assignments)
        audit(s)


@pytest.mark.parametrize("split", [False, True])
def test_every_request_finishes_exactly_once(split):
    prof = get_profile("ds27b")
    cl = SimCluster(prof, pe_nodes=2, de_nodes=2, engines_per_node=4, speedup=5.0, seed=7)
    s = Scheduler(Params(alpha_tokens=policy.derive_alpha(250e9, prof.kv_bytes_per_token),
                         beta_tokens=policy.derive_beta(prof) * 5, split_read=split,
                         default_read_tokens_per_s=cl.read_tokens_per_s, lease_s=1e9))
    for g in cl.groups:
        g.lease_id = s.register_group(g.group_id, g.role, g.specs(), 0.0).lease_id
    drive(s, cl, rounds=100, dt=0.05, submit_per_round=20)
    drive(s, cl, rounds=2000, dt=0.05, submit_per_round=0)  # drain
    assert s.counters.submitted == 2000 and s.counters.completed == 2000
    assert not s.requests and s.queued_requests() == 0
    sides = s.counters.by_read_side
    assert sum(sides.values()) == 2000  # each request scheduled once (no requeues here)
    # Both read paths carry traffic (the point of DualPath); split reads only when enabled.
    if split:
        assert sides[ReadSide.SPLIT] > 0
    else:
        assert sides[ReadSide.PREFILL] > 0 and sides[ReadSide.DECODE] > 0
        assert sides[ReadSide.SPLIT] == 0
    # Work spreads over the PEs. (Across groups the paper's policy balances through fetch
    # timing and beta only: whichever group fetches first takes what its engines can.)
    assigned = [e.assigned_total for e in s.engines.values() if e.role is Role.PREFILL]
    assert min(assigned) > 0.5 * max(assigned)


def test_replicas_split_over_processes_hand_prefill_done_over():
    """The bench's multi-process mode: replica A runs the PE groups, replica B the DE
    groups (each marks the other's engines non-local); PREFILL_DONE for B's DEs leaves A
    through its outbox and reaches B by prefill_done, and every request still finishes
    exactly once."""
    prof = get_profile("ds27b")
    reps = [SimCluster(prof, pe_nodes=2, de_nodes=2, engines_per_node=4, speedup=5.0, seed=7)
            for _ in range(2)]
    a, b = reps
    s = Scheduler(Params(alpha_tokens=policy.derive_alpha(250e9, prof.kv_bytes_per_token),
                         beta_tokens=policy.derive_beta(prof) * 5, lease_s=1e9,
                         default_read_tokens_per_s=a.read_tokens_per_s))
    owned = []  # (replica, group) with the group object of the replica that runs it
    for ga, gb in zip(a.groups, b.groups, strict=True):
        rep, g = (a, ga) if ga.role is Role.PREFILL else (b, gb)
        for other in (ga, gb):
            for e in other.engines:
                e.local = other is g
        g.lease_id = s.register_group(g.group_id, g.role, g.specs(), 0.0).lease_id
        owned.append((rep, g))
    handed = 0
    for rnd in range(2100):
        for rep in reps:
            rep.now += 0.05
        if rnd < 100:
            s.submit(a.new_requests(20))
        for rep, g in owned:
            done = rep.step(g, 0.05)
            for rid, engine_id in a.outbox:
                b.prefill_done(rid, engine_id)
                handed += 1
            a.outbox.clear()
            if done:
                s.report(g.group_id, g.lease_id, done, rep.now)
            res = s.fetch(g.group_id, g.lease_id, g.reports(), rep.now)
            rep.absorb_requests(g, res.assignments)
    assert b.outbox == []  # B runs no PE
    assert handed == 2000  # every PREFILL_DONE crossed over once (all DEs are B's)
    assert s.counters.submitted == 2000 and s.counters.completed == 2000
    assert not s.requests
