"""Leases: a group that misses its fetch deadline is marked down and its unfinished
requests are requeued at the head of the global queue with their next attempt — none
lost, none duplicated. Time is injected (the
core takes ``now``); nothing sleeps."""

import pytest

from dualpath.scheduler.core import (
    Completion,
    CompletionStage,
    EngineReport,
    EngineSpec,
    LeaseError,
    Params,
    RequestSpec,
    Role,
    Scheduler,
    Stage,
)
from tests.unit.test_sched_properties import audit

LEASE = 3.0


def cluster():
    s = Scheduler(Params(alpha_tokens=10**9, beta_tokens=10**9, lease_s=LEASE))
    pe = s.register_group("pe", Role.PREFILL,
                          [EngineSpec(f"pe.{k}", k, "pe-node") for k in range(2)], now=0.0)
    des = [s.register_group(f"de{n}", Role.DECODE,
                            [EngineSpec(f"de{n}.{k}", k, f"de-node{n}", hbm_tokens=10**6)
                             for k in range(2)], now=0.0) for n in range(2)]
    return s, pe, des


def reports(g, free=10**6):
    return [EngineReport(e.engine_id, e.seq, e.tok, 0, free if g.role is Role.DECODE else 0)
            for e in g.engines]


def test_a_prefill_group_that_misses_its_deadline_gives_its_requests_back_at_the_head():
    s, pe, (d0, d1) = cluster()
    reqs = s.submit([RequestSpec(100, 50, 10) for _ in range(6)]).accepted
    s.fetch("de0", d0.lease_id, reports(d0), now=0.5)   # group phase: 3 to de0, 3 to de1
    s.fetch("de0", d0.lease_id, reports(d0), now=0.6)
    s.fetch("de1", d1.lease_id, reports(d1), now=0.6)
    assert len(s.prefill_queue) == 6
    got = s.fetch("pe", pe.lease_id, reports(pe), now=1.0, limit=4).assignments
    assert len(got) == 4
    # The PE finishes one prefill, then its leader goes silent.
    s.report("pe", pe.lease_id, [Completion(got[0].request_id, got[0].pe.engine_id,
                                            CompletionStage.PREFILL_DONE)], now=1.5)
    # The DE groups keep renewing; at 1.5 + 3 s the PE group's deadline passes.
    for t in (2.0, 3.5, 4.4):
        s.report("de0", d0.lease_id, [], now=t)
        s.report("de1", d1.lease_id, [], now=t)
    assert s.expire(now=4.5) == []  # exactly at the deadline: not yet late
    audit(s)
    des = {r.request_id: r.de_group for r in got[1:]}
    assert s.expire(now=4.5001) == [pe]
    audit(s)
    # Its three unfinished requests lead the global queue in arrival order, with their
    # next attempt; their DEs are told to drop the attempt that was given up.
    order = sorted(got[1:], key=lambda r: r.seq)
    assert list(s.global_queue) == order
    assert all(r.stage is Stage.GLOBAL_QUEUE and r.pe is None and r.de is None
               and r.attempt == 2 and r.failures == 0 and r.lost == 1 for r in order)
    for rid, g in des.items():
        assert rid in g.pending_cancel
    assert got[0].stage is Stage.DECODING  # finished prefill stays with its DE
    # Lost with their node, not failed: the lost budget counts them, and no backoff.
    assert s.counters.requeued == 3 and s.counters.lost_attempts == 3
    assert s.counters.failed_attempts == 0
    # The old lease is dead; a re-registered group receives the requeued requests first.
    with pytest.raises(LeaseError):
        s.fetch("pe", pe.lease_id, reports(pe), now=4.6)
    with pytest.raises(LeaseError):
        s.report("pe", pe.lease_id, [], now=4.6)
    pe2 = s.register_group("pe", Role.PREFILL,
                           [EngineSpec(f"pe.{k}", k, "pe-node") for k in range(2)], now=5.0)
    for d in (d0, d1):
        s.fetch(d.group_id, d.lease_id, reports(d), now=5.0)
    # The requests that waited in the prefill queue all along are still ahead of them.
    again = s.fetch("pe", pe2.lease_id, reports(pe2), now=5.0).assignments
    waiting = sorted((r for r in reqs if r not in got), key=lambda r: r.seq)
    assert again[:len(waiting)] == waiting
    assert sorted(again[len(waiting):], key=lambda r: r.seq) == order
    assert all(r.attempt == 2 for r in order)
    audit(s)


def test_a_decode_group_that_misses_its_deadline_requeues_everything_it_held():
    s, pe, (d0, d1) = cluster()
    s.submit([RequestSpec(100, 0, 10) for _ in range(8)])
    s.fetch("de0", d0.lease_id, reports(d0), now=0.1)
    s.fetch("de1", d1.lease_id, reports(d1), now=0.1)
    on_d0 = [r for r in s.requests.values() if r.de_group is d0]
    assert len(on_d0) == 4
    got = s.fetch("pe", pe.lease_id, reports(pe), now=0.2).assignments
    assert len(got) == 8
    # Of de0's four: one finishes prefill (decoding), three are still prefilling.
    first = next(r for r in got if r.de_group is d0)
    s.report("pe", pe.lease_id, [Completion(first.request_id, first.pe.engine_id,
                                            CompletionStage.PREFILL_DONE)], now=0.3)
    # New work waits in the global queue (no DE fetch since).
    late = s.submit([RequestSpec(100, 0, 10) for _ in range(2)]).accepted
    s.report("pe", pe.lease_id, [], now=3.0)
    s.report("de1", d1.lease_id, [], now=3.0)
    assert s.expire(now=3.2) == [d0]
    audit(s)
    # de0's four lead the global queue in arrival order, ahead of the two newer requests.
    assert list(s.global_queue) == sorted(on_d0, key=lambda r: r.seq) + late
    assert all(r.de is None and r.pe is None for r in on_d0)
    # The PE still prefilling three of them is told to drop them, once.
    prefilling = sorted((r for r in on_d0 if r is not first), key=lambda r: r.seq)
    res = s.fetch("pe", pe.lease_id, reports(pe), now=3.3)
    assert res.cancelled == [r.request_id for r in prefilling]
    assert s.fetch("pe", pe.lease_id, reports(pe), now=3.4).cancelled == []
    # A late PREFILL_DONE for a cancelled request is ignored, not double-counted.
    acc, ignored = s.report("pe", pe.lease_id, [Completion(
        prefilling[0].request_id, "pe.0", CompletionStage.PREFILL_DONE)], now=3.5)
    assert (acc, ignored) == (0, [prefilling[0].request_id])
    # The survivors take the work; every request completes exactly once.
    done = 0
    t = 3.5
    while s.requests:
        t += 0.1
        assert t < 10, "requests are stuck"
        s.fetch("de1", d1.lease_id, reports(d1), now=t)
        s.fetch("pe", pe.lease_id, reports(pe), now=t)
        for r in [r for r in s.requests.values() if r.stage is Stage.PREFILLING]:
            s.report("pe", pe.lease_id, [Completion(r.request_id, r.pe.engine_id,
                                                    CompletionStage.PREFILL_DONE)], now=t)
            acc, _ = s.report("de1", d1.lease_id, [Completion(
                r.request_id, r.de.engine_id, CompletionStage.DECODE_DONE)], now=t)
            done += acc
        audit(s)
    assert done == s.counters.completed == s.counters.submitted == 10
