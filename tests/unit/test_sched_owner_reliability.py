"""Where the identity binding and admission bounds (issue 11) meet the reliability
calls (issue 12): only a group's owner may release it or have its running requests
reconciled; a failure report cannot steer work away from groups the request never
touched; what a leader sends and the scheduler keeps stays bounded; the byte bound's
books close over every way a request ends."""

import random

import pytest

from dualpath.scheduler.core import (
    Claim,
    Completion,
    CompletionStage,
    PermissionDenied,
    RequestSpec,
    Role,
    Scheduler,
    Stage,
)
from dualpath.scheduler.core.model import MAX_ERROR_BYTES, REQUEST_FIXED_BYTES
from tests.unit.test_sched_properties import audit
from tests.unit.test_sched_reliability import params, run_to_pe, specs, step

P0, D0 = "node/p0", "node/d0"


def owned_cluster(**kw):
    """p0, d0 and d1, each registered by its own node identity."""
    s = Scheduler(params(**kw), rng=random.Random(3))
    gs = {}
    for gid, role in (("p0", Role.PREFILL), ("d0", Role.DECODE), ("d1", Role.DECODE)):
        gs[gid] = s.register_group(gid, role, specs(gid, role), now=0.0, owner=f"node/{gid}")
    return s, gs


def fetch_all(s, gs, now):
    for gid in ("d0", "d1", "p0"):
        g = s.groups[gid]
        s.fetch(gid, g.lease_id, [], now, caller=g.owner)


def test_only_the_owner_releases_its_group():
    s, gs = owned_cluster()
    s.submit([RequestSpec(100, 0, 10, f"r{i}") for i in range(4)])
    fetch_all(s, gs, 0.0)
    d0 = gs["d0"]
    held = sum(1 for r in s.requests.values() if r.de_group is d0)
    assert held
    with pytest.raises(PermissionDenied, match="node/d0"):
        s.release_group("d0", d0.lease_id, 0.1, caller="node/p0")
    with pytest.raises(PermissionDenied):
        s.release_group("d0", d0.lease_id, 0.1)     # unauthenticated (plaintext) caller
    assert d0.up
    assert s.release_group("d0", d0.lease_id, 0.1, caller=D0) == held
    assert not d0.up and s.release_group("d0", d0.lease_id, 0.2, caller=D0) == 0
    assert s.release_group("nope", 1, 0.2, caller="node/x") == 0   # unknown: idempotent
    audit(s)


def test_a_stranger_cannot_register_a_group_to_claim_its_requests():
    s, gs = owned_cluster(retry_backoff_s=0.0)
    s.submit([RequestSpec(100, 0, 10, "a")])
    fetch_all(s, gs, 0.0)
    r = s.requests["a"]
    de = r.de
    claims = [Claim("a", de.engine_id, r.attempt, prefill_done=True)]
    with pytest.raises(PermissionDenied):
        s.register_group(de.group.group_id, Role.DECODE, specs(de.group.group_id, Role.DECODE),
                         now=0.1, claims=claims, owner="node/intruder")
    # Nothing moved: the owner's group, lease and request are as they were.
    assert de.group.up and r.de is de and r.stage is Stage.PREFILLING and r.attempt == 1
    # The owner itself re-registers and keeps it.
    g = s.register_group(de.group.group_id, Role.DECODE, specs(de.group.group_id,
                                                                Role.DECODE),
                         now=0.2, claims=[Claim("a", de.engine_id, 1)], owner=de.group.owner)
    assert s.take_cancelled(g) == [] and r.de.group is g and r.attempt == 1
    audit(s)


def test_a_suspect_outside_the_request_is_not_believed():
    s, gs = owned_cluster(retry_backoff_s=0.0, peer_avoid_s=5.0)
    s.submit([RequestSpec(100, 0, 10, "a")])
    fetch_all(s, gs, 0.0)
    r = s.requests["a"]
    other = "d1" if r.de.group.group_id == "d0" else "d0"
    pe_group, de_group = r.pe.group, r.de.group
    s.report("p0", pe_group.lease_id, [Completion("a", r.pe.engine_id,
                                                   CompletionStage.FAILED, 1, "x",
                                                   f"{other}.0")], 0.1, caller=P0)
    # Blaming an uninvolved group is treated as "unknown": both of its own sides.
    assert set(r.avoid) == {pe_group.group_id, de_group.group_id}


def test_a_failure_reason_is_bounded():
    s, gs = owned_cluster(retry_backoff_s=0.0)
    s.submit([RequestSpec(100, 0, 10, "a")])
    fetch_all(s, gs, 0.0)
    r = s.requests["a"]
    s.report("p0", gs["p0"].lease_id, [Completion("a", r.pe.engine_id,
                                                   CompletionStage.FAILED, 1,
                                                   "é" * 4000)], 0.1, caller=P0)
    assert 0 < len(r.error.encode()) <= MAX_ERROR_BYTES


def test_cancellations_in_a_registration_answer_share_the_reply_budget():
    s = Scheduler(params(max_fetch_reply_bytes=4096, max_payload_bytes=0))
    g = s.register_group("d0", Role.DECODE, specs("d0", Role.DECODE), now=0.0,
                         claims=[Claim(f"gone-{i:03d}", "d0/e0", 1) for i in range(500)])
    first = s.take_cancelled(g)
    assert 0 < len(first) < 500 and sum(len(x) + 8 for x in first) <= 4096
    rest = s.fetch("d0", g.lease_id, [], 0.1).cancelled
    assert first + rest == [f"gone-{i:03d}" for i in range(len(first) + len(rest))]


def test_held_bytes_close_over_every_end():
    s, gs = owned_cluster(retry_backoff_s=0.0, max_failed_attempts=1)
    s.submit([RequestSpec(100, 0, 10, x, b"p" * 100) for x in ("done", "failed", "cut")])
    assert s.held_bytes == sum(r.wire_bytes + REQUEST_FIXED_BYTES
                               for r in s.requests.values())
    s.cancel(["cut"], 0.0)
    fetch_all(s, gs, 0.0)
    for r in list(s.requests.values()):
        if r.request_id == "failed":
            s.report("p0", gs["p0"].lease_id, [Completion(
                r.request_id, r.pe.engine_id, CompletionStage.FAILED, r.attempt)], 0.1,
                caller=P0)
        else:
            s.report(r.de.group.group_id, r.de.group.lease_id,
                     [Completion(r.request_id, r.de.engine_id, CompletionStage.DECODE_DONE,
                                 r.attempt)], 0.1, caller=r.de.group.owner)
    assert not s.requests and s.held_bytes == 0
    assert {f.request_id for f in s.finished.values()} == {"done", "failed", "cut"}


def test_steps_of_an_unowned_cluster_still_work():
    # The plaintext listener's callers have no identity: "" owns, "" acts.
    s = Scheduler(params())
    gs = {gid: s.register_group(gid, role, specs(gid, role), now=0.0)
          for gid, role in (("p0", Role.PREFILL), ("d0", Role.DECODE))}
    s.submit([RequestSpec(100, 0, 10, "a")])
    assert [r.request_id for r in run_to_pe(s, gs, 0.0)] == ["a"]
    step(s, gs, 0.1)
    audit(s)
