"""The scheduler core's failure handling (docs/reliability.md): attempts and their numbers,
the failure budget and its terminal FAILED state, jittered exponential backoff, peer
avoidance, cancel, graceful release, idempotent submission and reconciliation of what
re-registering groups still run. Time is injected; nothing sleeps."""

import random

from hypothesis import given
from hypothesis import strategies as st

from dualpath.scheduler.core import (
    Claim,
    Completion,
    CompletionStage,
    EngineReport,
    EngineSpec,
    Outcome,
    Params,
    RejectReason,
    RequestSpec,
    Role,
    Scheduler,
    Stage,
)
from dualpath.scheduler.core.model import backoff_s
from tests.unit.test_sched_properties import audit

FAILED, DONE, PDONE = (CompletionStage.FAILED, CompletionStage.DECODE_DONE,
                       CompletionStage.PREFILL_DONE)


def params(**kw):
    base = {"alpha_tokens": 10**9, "beta_tokens": 10**9, "lease_s": 3.0,
            "max_failed_attempts": 3, "retry_backoff_s": 0.1, "retry_backoff_max_s": 1.0,
            "peer_avoid_s": 2.0}
    base.update(kw)
    return Params(**base)


def cluster(pes=1, des=2, **kw):
    s = Scheduler(params(**kw), rng=random.Random(7))
    gs = {}
    for role, n, p in ((Role.PREFILL, pes, "p"), (Role.DECODE, des, "d")):
        for i in range(n):
            gid = f"{p}{i}"
            gs[gid] = s.register_group(gid, role, specs(gid, role), now=0.0)
    return s, gs


def specs(gid, role):
    return [EngineSpec(f"{gid}/e0", 0, gid, "", 10**6 if role is Role.DECODE else 0)]


def reports(g):
    return [EngineReport(e.engine_id, 0, 0, 0, 10**6 if g.role is Role.DECODE else 0)
            for e in g.engines]


def step(s, gs, now, order=None):
    """Every group fetches (DE groups first): what each received."""
    got = {}
    for gid in order or sorted(gs, key=lambda k: (k[0] != "d", k)):
        g = s.groups[gid]
        if g.up:
            got[gid] = s.fetch(gid, g.lease_id, reports(g), now)
    return got


def run_to_pe(s, gs, now):
    """Fetch until the request(s) sit on a PE; the PREFILLING requests."""
    step(s, gs, now)
    return [r for r in s.requests.values() if r.stage is Stage.PREFILLING]


def fail(s, r, now, side="pe", suspect="", error="boom"):
    e = r.pe if side == "pe" else r.de
    return s.report(e.group.group_id, e.group.lease_id,
                    [Completion(r.request_id, e.engine_id, FAILED, r.attempt, error, suspect)],
                    now)


@given(base=st.floats(0.001, 10), cap=st.floats(0.001, 100), n=st.integers(1, 40),
       jitter=st.floats(0.5, 1.0))
def test_backoff_doubles_is_capped_and_never_less_than_half(base, cap, n, jitter):
    p = params(retry_backoff_s=base, retry_backoff_max_s=cap)
    d = backoff_s(p, n, jitter)
    full = min(cap, base * 2 ** (n - 1))
    assert full / 2 - 1e-12 <= d <= full + 1e-12
    assert d <= cap


def test_a_request_that_fails_every_time_ends_failed_after_its_budget():
    s, gs = cluster()
    s.submit([RequestSpec(100, 0, 10, "poison")])
    now, attempts = 0.0, []
    while "poison" in s.requests:
        now += 2.5    # past every backoff and avoidance window, within the lease
        s.expire(now)
        for x in run_to_pe(s, gs, now):
            attempts.append(x.attempt)
            fail(s, x, now, error=f"payload unreadable (attempt {x.attempt})")
        audit(s)
        assert now < 100, "never ended"
    f = s.finished["poison"]
    assert f.outcome is Outcome.FAILED and f.failures == 3 and attempts == [1, 2, 3]
    assert f.error == "payload unreadable (attempt 3)"
    assert s.newly_failed == [f]          # one line for the request, not per retry
    assert s.counters.failed_attempts == 3 and s.counters.failed == 1


def test_a_final_failure_ends_the_request_at_once_without_a_retry():
    """A request larger than a node's buffer can never succeed: its FAILED completion says
    so (final) and the request ends there, its budget unspent, marked final."""
    s, gs = cluster()
    s.submit([RequestSpec(100, 0, 10, "huge"), RequestSpec(100, 0, 10, "flaky")])
    now = 1.0
    on_pe = {r.request_id: r for r in run_to_pe(s, gs, now)}
    e = on_pe["huge"].pe
    s.report(e.group.group_id, e.group.lease_id,
             [Completion("huge", e.engine_id, FAILED, on_pe["huge"].attempt,
                         "raise buffers.de_buffer_mib", "", True)], now)
    fail(s, on_pe["flaky"], now)
    audit(s)
    f = s.finished["huge"]
    assert f.outcome is Outcome.FAILED and f.final and f.failures == 1
    assert f.error == "raise buffers.de_buffer_mib"
    assert "flaky" in s.requests and "flaky" not in s.finished   # an ordinary one retries
    assert s.requests["flaky"].attempt == 2


def test_a_failed_attempt_waits_out_its_backoff():
    s, gs = cluster(retry_backoff_s=0.4, retry_backoff_max_s=10.0, peer_avoid_s=0.0)
    s.submit([RequestSpec(100, 0, 10, "a")])
    (r,) = run_to_pe(s, gs, 0.0)
    fail(s, r, 0.0)
    assert r.stage is Stage.BACKOFF and 0.2 <= r.not_before <= 0.4
    assert run_to_pe(s, gs, r.not_before - 1e-6) == []          # not before its time
    assert run_to_pe(s, gs, r.not_before) == [r] and r.attempt == 2
    fail(s, r, 1.0)                                              # second: 0.4 .. 0.8 s
    assert 1.4 <= r.not_before <= 1.8


def test_the_other_side_is_told_and_a_stale_attempt_cannot_finish_it():
    s, gs = cluster(retry_backoff_s=0.0, peer_avoid_s=0.0)
    s.submit([RequestSpec(100, 0, 10, "a")])
    (r,) = run_to_pe(s, gs, 0.0)
    de, pe = r.de, r.pe
    fail(s, r, 0.1)                       # the PE gives up
    assert r.stage is Stage.GLOBAL_QUEUE and r.attempt == 2
    assert de.group.pending_cancel == ["a"] and pe.group.pending_cancel == []
    # The old attempt's DE finishing later is ignored, whatever it says.
    acc, ign = s.report(de.group.group_id, de.group.lease_id,
                        [Completion("a", de.engine_id, DONE, 1)], 0.2)
    assert (acc, ign) == (0, ["a"])
    got = step(s, gs, 0.3)
    assert "a" in got[de.group.group_id].cancelled   # delivered with the next fetch
    (r2,) = [x for x in s.requests.values() if x.stage is Stage.PREFILLING]
    s.report(r2.pe.group.group_id, r2.pe.group.lease_id,
             [Completion("a", r2.pe.engine_id, PDONE, 2)], 0.4)
    s.report(r2.de.group.group_id, r2.de.group.lease_id,
             [Completion("a", r2.de.engine_id, DONE, 2)], 0.5)
    assert s.finished["a"].outcome is Outcome.DECODE_DONE and s.finished["a"].attempt == 2


def test_a_retry_avoids_the_blamed_group_until_it_registers_again_or_time_passes():
    s, gs = cluster(retry_backoff_s=0.0, max_failed_attempts=5)
    s.submit([RequestSpec(100, 0, 10, "a")])
    (r,) = run_to_pe(s, gs, 0.0)
    bad = r.de.group.group_id
    good = "d1" if bad == "d0" else "d0"
    fail(s, r, 0.1, suspect=r.de.engine_id)   # the PE blames its DE (it stopped answering)
    for t in (0.2, 0.3):
        step(s, gs, t, order=[bad, good, "p0"])
    assert r.de.group.group_id == good
    # With one PE, a retry that blames it waits out the window, then runs there again.
    fail(s, r, 0.4, suspect=r.pe.engine_id)
    assert run_to_pe(s, gs, 0.5) == []
    assert run_to_pe(s, gs, 2.4 + 1e-6) == [r]
    # A new lease lifts it at once.
    fail(s, r, 2.5, suspect=r.pe.engine_id)
    assert run_to_pe(s, gs, 2.6) == []
    gs["p0"] = s.register_group("p0", Role.PREFILL, specs("p0", Role.PREFILL), now=2.7)
    assert run_to_pe(s, gs, 2.7) == [r]
    audit(s)


def test_unknown_blame_avoids_both_sides():
    s, gs = cluster(pes=2, retry_backoff_s=0.0)
    s.submit([RequestSpec(100, 0, 10, "a")])
    (r,) = run_to_pe(s, gs, 0.0)
    pe, de = r.pe.group.group_id, r.de.group.group_id
    fail(s, r, 0.1)
    run_to_pe(s, gs, 0.2)
    assert r.pe.group.group_id != pe and r.de.group.group_id != de


def test_an_attempt_lost_with_its_node_counts_against_the_lost_budget_not_the_failures():
    """A group whose lease lapses (its node killed, frozen, cut off) takes its requests'
    attempts with it: the node's fault, not the request's. They go back to the queue
    head at once (no backoff, nothing avoided), count against ``max_lost_attempts``
    only, and a request lost that many times ends FAILED: a budget with an end. (The
    soak: five faults in 12 s on one request's nodes ended it FAILED against
    max_failed_attempts, as if it had failed five times itself.)"""
    s, gs = cluster(retry_backoff_s=10.0, max_failed_attempts=2, max_lost_attempts=4)
    s.submit([RequestSpec(100, 0, 10, "r")])
    now = 0.0
    for lost in range(1, 4):
        (r,) = run_to_pe(s, gs, now)
        now += 10.0                           # every lease lapses
        s.expire(now)
        assert (r.stage, r.failures, r.lost, r.attempt) == (
            Stage.GLOBAL_QUEUE, 0, lost, lost + 1), "no backoff, no failure counted"
        assert not r.avoid
        for gid, g in list(gs.items()):       # the nodes come back
            gs[gid] = s.register_group(gid, g.role, specs(gid, g.role), now=now)
        audit(s)
    assert s.counters.lost_attempts == 3 and s.counters.failed_attempts == 0
    run_to_pe(s, gs, now)
    s.expire(now + 10.0)                      # the fourth: the budget is spent
    f = s.finished["r"]
    assert f.outcome is Outcome.FAILED and f.lost == 4 and f.failures == 0
    assert "max_lost_attempts" in f.error and "lost its lease" in f.error
    audit(s)


def test_release_hands_work_back_without_counting_a_failure():
    s, gs = cluster(retry_backoff_s=0.0)
    s.submit([RequestSpec(100, 0, 10, f"r{i}") for i in range(4)])
    running = run_to_pe(s, gs, 0.0)
    d0 = gs["d0"]
    on_d0 = [r for r in running if r.de_group is d0]
    assert s.release_group("d0", d0.lease_id, 0.1) == len(on_d0) > 0
    assert not d0.up and all(r.failures == 0 and r.attempt == 2 for r in on_d0)
    assert s.release_group("d0", d0.lease_id, 0.2) == 0       # idempotent
    assert s.release_group("nope", 1, 0.2) == 0
    assert s.counters.failed_attempts == 0
    audit(s)


def test_cancel_ends_queued_and_running_requests_and_tells_their_engines():
    s, gs = cluster()
    s.submit([RequestSpec(100, 0, 10, "run"), RequestSpec(100, 0, 10, "wait")])
    step(s, gs, 0.0, order=["d0", "d1"])     # on a DE, waiting for a PE
    running = [x for x in s.requests.values() if x.stage is Stage.PREFILL_QUEUE]
    s.submit([RequestSpec(100, 0, 10, "late")])
    got = s.cancel(["late", running[0].request_id, "nope"], 0.1)
    assert [g.outcome if g else None for g in got] == [Outcome.CANCELLED,
                                                       Outcome.CANCELLED, None]
    assert running[0].request_id in running[0].de.group.pending_cancel
    # Cancelling an ended request leaves it as it ended.
    assert s.cancel(["late"], 0.2) == [s.finished["late"]]
    assert s.counters.cancelled == 2
    audit(s)


def test_resubmission_is_idempotent_for_live_and_ended_requests():
    s, _ = cluster()
    spec = RequestSpec(100, 99, 10, "a", b"payload")
    assert [r.request_id for r in s.submit([spec]).accepted] == ["a"]
    again = s.submit([spec])
    assert again.resubmitted == ["a"] and again.ids == ["a"] and not again.rejected
    assert s.counters.submitted == 1
    # Other content under a known id, or an id twice in one call: rejected, not a failed
    # call (admission is per request).
    other = s.submit([RequestSpec(100, 99, 10, "a", b"other")])
    assert [(x.reason, x.request_id) for x in other.rejected] == [
        (RejectReason.DUPLICATE, "a")] and "known with other content" in other.rejected[0].detail
    twice = s.submit([RequestSpec(1, 0, 0, "b"), RequestSpec(1, 0, 0, "b")])
    assert twice.ids == ["b"] and [(x.index, x.reason) for x in twice.rejected] == [
        (1, RejectReason.DUPLICATE)]
    s.cancel(["a"], 0.0)
    assert s.submit([spec]).resubmitted == ["a"]        # an ended one too
    assert "a" not in s.requests
    # Auto-named requests never take a known id.
    s.submit([RequestSpec(1, 0, 0, "r-3")])
    assert s.submit([RequestSpec(1, 0, 0)]).accepted[0].request_id not in ("a", "r-3")
    audit(s)


def test_a_retry_is_accepted_when_the_queue_is_full():
    # The retry of a submission whose answer was lost must not read as a refusal.
    s, _ = cluster(max_queued_requests=1)
    spec = RequestSpec(100, 0, 10, "a")
    s.submit([spec])
    assert [x.reason for x in s.submit([RequestSpec(100, 0, 10, "b")]).rejected] == [
        RejectReason.QUEUE_FULL]
    again = s.submit([spec])
    assert again.ids == ["a"] and not again.rejected


def test_submissions_without_engines_wait_and_say_so():
    s = Scheduler(params())
    assert s.waiting_for_engines()
    s.submit([RequestSpec(100, 0, 10)])
    s.register_group("d0", Role.DECODE, specs("d0", Role.DECODE), now=0.0)
    assert s.waiting_for_engines()
    s.register_group("p0", Role.PREFILL, specs("p0", Role.PREFILL), now=0.0)
    assert not s.waiting_for_engines()


def test_ended_requests_are_remembered_up_to_the_bound():
    s, _ = cluster(finished_requests_kept=2)
    s.submit([RequestSpec(1, 0, 0, f"r{i}") for i in range(3)])
    s.cancel(["r0", "r1", "r2"], 0.0)
    assert list(s.finished) == ["r1", "r2"]


def test_a_group_registering_again_keeps_what_its_engines_claim():
    s, gs = cluster(retry_backoff_s=0.0)
    s.submit([RequestSpec(100, 0, 10, f"r{i}") for i in range(4)])
    run_to_pe(s, gs, 0.0)
    d0 = gs["d0"]
    mine = sorted((r for r in s.requests.values() if r.de_group is d0), key=lambda r: r.seq)
    assert len(mine) == 2
    keep, drop = mine
    claims = [Claim(keep.request_id, keep.de.engine_id, keep.attempt),
              Claim("unknown", "d0/e0", 1), Claim(drop.request_id, "d0/e0", drop.attempt + 5)]
    g = s.register_group("d0", Role.DECODE, specs("d0", Role.DECODE), now=0.5, claims=claims)
    assert sorted(s.take_cancelled(g)) == sorted(["unknown", drop.request_id])
    assert keep.de.group is g and keep.attempt == 1 and keep.stage is Stage.PREFILLING
    assert drop.stage is Stage.GLOBAL_QUEUE and drop.attempt == 2 and drop.failures == 0
    assert drop.request_id in drop_pe_cancels(s)
    audit(s)


def drop_pe_cancels(s):
    return {rid for g in s.groups.values() if g.role is Role.PREFILL for rid in g.pending_cancel}


def restored(*reqs, lease_s=3.0):
    """A restarted scheduler holding ``reqs`` (as a journal would give them back)."""
    from dualpath.scheduler.core import Request

    s = Scheduler(params(lease_s=lease_s, retry_backoff_s=0.0))
    live = [Request(rid, 100, 0, 10, b"", seq, attempt=att) for seq, (rid, att) in
            enumerate(reqs, 1)]
    s.restore(live, [], next_seq=len(reqs), next_lease=40, now=100.0)
    return s


def test_after_a_restart_the_groups_claims_resume_what_they_still_run():
    s = restored(("both", 2), ("decoding", 1), ("de_only", 1), ("pe_only", 1), ("none", 3))
    assert s.stage_counts()[Stage.RECOVERING] == 5
    d = s.register_group("d0", Role.DECODE, specs("d0", Role.DECODE), now=100.1, claims=[
        Claim("both", "d0/e0", 2), Claim("decoding", "d0/e0", 1, prefill_done=True),
        Claim("de_only", "d0/e0", 1), Claim("none", "d0/e0", 2)])      # a stale attempt
    assert d.lease_id == 41                       # lease ids never repeat
    assert s.take_cancelled(d) == ["none"]
    assert s.requests["decoding"].stage is Stage.DECODING
    p = s.register_group("p0", Role.PREFILL, specs("p0", Role.PREFILL), now=100.2, claims=[
        Claim("both", "p0/e0", 2), Claim("pe_only", "p0/e0", 1)])
    assert s.take_cancelled(p) == []
    both = s.requests["both"]
    assert both.stage is Stage.PREFILLING and both.pe.group is p and both.de.group is d
    audit(s)
    # Nothing runs from the recovery hold before it ends (one lease).
    s.fetch("d0", d.lease_id, reports(d), 102.9)
    assert s.fetch("p0", p.lease_id, reports(p), 102.9).assignments == []
    s.expire(103.0)
    # Then the unclaimed and half-claimed go back with their next attempt, and the
    # engines holding half of one drop it.
    for rid, att in (("de_only", 2), ("pe_only", 2), ("none", 4)):
        assert s.requests[rid].stage is Stage.GLOBAL_QUEUE and s.requests[rid].attempt == att
    assert set(d.pending_cancel) == {"de_only"} and set(p.pending_cancel) == {"pe_only"}
    assert [r.request_id for r in s.global_queue] == ["de_only", "pe_only", "none"]
    audit(s)
    # The adopted ones finish normally.
    s.report("d0", d.lease_id, [Completion("decoding", "d0/e0", DONE, 1)], 103.1)
    assert s.finished["decoding"].outcome is Outcome.DECODE_DONE


def test_a_claim_of_a_finished_request_is_refused():
    s = restored(("a", 1))
    s.cancel(["a"], 100.0)
    d = s.register_group("d0", Role.DECODE, specs("d0", Role.DECODE), now=100.1,
                         claims=[Claim("a", "d0/e0", 1, prefill_done=True)])
    assert s.take_cancelled(d) == ["a"]
