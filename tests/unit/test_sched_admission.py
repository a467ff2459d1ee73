"""Admission on the scheduler core: each request is accepted or rejected on its own with
a reason (never a failed call after part of it was enqueued); bounds by the model's
context whether or not a DE is up, by request id and payload size, by the queue in
requests and in bytes, by the per-call count; a fetch reply never passes its byte
budget, however large the payloads."""

import pytest

from dualpath.errors import UsageError
from dualpath.scheduler.core import Params, Scheduler
from dualpath.scheduler.core.model import (
    ASSIGNMENT_FIXED_BYTES,
    REQUEST_FIXED_BYTES,
    EngineReport,
    EngineSpec,
    RejectReason,
    RequestSpec,
    Role,
)


def core(**over) -> Scheduler:
    return Scheduler(Params(alpha_tokens=1000, beta_tokens=10**9, context_tokens=4096,
                            **over))


def reasons(adm):
    return [(x.index, x.reason) for x in adm.rejected]


def test_a_poison_request_is_rejected_with_no_decode_group_up():
    # 2^64-1 tokens used to be accepted while no DE was up, then blocked its group.
    s = core()
    adm = s.submit([RequestSpec(2**64 - 1), RequestSpec(4000, 0, 96), RequestSpec(4000, 0, 97)])
    assert [r.prompt_tokens for r in adm.accepted] == [4000]
    assert reasons(adm) == [(0, RejectReason.TOO_LARGE), (2, RejectReason.TOO_LARGE)]
    assert "the model's context is 4096" in adm.rejected[0].detail


def test_ids_and_payloads_are_bounded_and_duplicates_named():
    s = core(max_payload_bytes=100)
    adm = s.submit([RequestSpec(10, request_id="x" * 129), RequestSpec(10, payload=b"p" * 101),
                    RequestSpec(10, request_id="a"), RequestSpec(10, request_id="a"),
                    RequestSpec(0)])
    assert reasons(adm) == [(0, RejectReason.INVALID), (1, RejectReason.INVALID),
                            (3, RejectReason.DUPLICATE), (4, RejectReason.INVALID)]
    assert len(adm.rejected[0].request_id) == 128          # echoed, but bounded
    assert [r.request_id for r in adm.accepted] == ["a"]


@pytest.mark.parametrize("rid", ["a\nINFO forged line", "nul\x00", "esc\x1b[31m", "tab\t"])
def test_a_request_id_with_a_control_character_is_refused(rid):
    """An id is written into log lines and the journal: a newline or NUL in it would
    split or forge them. Refused INVALID at submit, naming it (repr); others pass."""
    s = core()
    adm = s.submit([RequestSpec(10, request_id=rid), RequestSpec(10, request_id="ok-é 1")])
    assert reasons(adm) == [(0, RejectReason.INVALID)]
    assert "only printable characters" in adm.rejected[0].detail
    assert "\n" not in adm.rejected[0].detail and "\x00" not in adm.rejected[0].detail
    assert [r.request_id for r in adm.accepted] == ["ok-é 1"]


def test_the_queue_is_bounded_by_requests_and_by_bytes():
    s = core(max_queued_requests=3)
    adm = s.submit([RequestSpec(10) for _ in range(5)])
    assert len(adm.accepted) == 3 and reasons(adm) == [(3, RejectReason.QUEUE_FULL),
                                                       (4, RejectReason.QUEUE_FULL)]
    one = 1000 + ASSIGNMENT_FIXED_BYTES + REQUEST_FIXED_BYTES
    s = core(max_payload_bytes=1000, max_held_bytes=2 * one + 10)
    adm = s.submit([RequestSpec(10, payload=b"x" * 1000) for _ in range(3)])
    assert len(adm.accepted) == 2 and reasons(adm) == [(2, RejectReason.QUEUE_FULL)]
    assert s.held_bytes <= 2 * one + 10


def test_too_many_requests_in_one_call_are_refused_whole():
    s = core(max_submit_requests=10)
    with pytest.raises(UsageError, match="11 requests in one submit; at most 10"):
        s.submit([RequestSpec(10)] * 11)
    assert s.queued_requests() == 0


def test_a_fetch_reply_stays_within_its_byte_budget():
    budget = 64 << 10
    s = core(max_payload_bytes=16 << 10, max_fetch_reply_bytes=budget)
    g = s.register_group("de", Role.DECODE, [EngineSpec("de.0", 0, "n", hbm_tokens=10**9)],
                         0.0)
    s.submit([RequestSpec(10, payload=b"x" * (16 << 10)) for _ in range(50)])
    res = s.fetch("de", g.lease_id, [EngineReport("de.0", 0, 0, 0, 10**9)], 0.1)
    assert 0 < len(res.assignments) < 50
    assert sum(r.wire_bytes for r in res.assignments) <= budget
