"""The latencies the scheduler hears of (its TTFT and TPOT histograms): time to first
token from submission to the first PREFILL_DONE of a request, time per output token
from the PREFILL_DONE of the attempt that finished to its DECODE_DONE. Time is injected."""

from dualpath.scheduler.core import (
    Completion,
    CompletionStage,
    RequestSpec,
)
from tests.unit.test_sched_lease import cluster, reports


def assigned(s, pe, des, now):
    for d in des:
        s.fetch(d.group_id, d.lease_id, reports(d), now=now)
    return s.fetch("pe", pe.lease_id, reports(pe), now=now).assignments


def done(s, g, r, stage, now):
    eng = r.pe if stage is CompletionStage.PREFILL_DONE else r.de
    s.report(g.group_id, g.lease_id, [Completion(r.request_id, eng.engine_id, stage)], now=now)


def test_ttft_from_submission_and_tpot_per_token_after_the_first():
    s, pe, des = cluster()
    s.submit([RequestSpec(100, 50, 11)], now=0.0)     # submitted at clock 0: still timed
    (r,) = assigned(s, pe, des, now=0.5)
    done(s, pe, r, CompletionStage.PREFILL_DONE, now=1.25)
    done(s, r.de_group, r, CompletionStage.DECODE_DONE, now=2.25)
    assert list(s.latencies) == [("ttft", 1.25), ("tpot", 0.1)]   # 1 s over 10 tokens


def test_a_retried_request_counts_its_first_token_once():
    s, pe, des = cluster()
    s.submit([RequestSpec(100, 50, 3)], now=0.0)
    (r,) = assigned(s, pe, des, now=0.1)
    done(s, pe, r, CompletionStage.PREFILL_DONE, now=1.0)
    de = r.de_group
    s.report(de.group_id, de.lease_id, [Completion(r.request_id, r.de.engine_id,
                                                   CompletionStage.FAILED)], now=2.0)
    (r2,) = assigned(s, pe, des, now=3.0)
    done(s, pe, r2, CompletionStage.PREFILL_DONE, now=4.0)
    done(s, r2.de_group, r2, CompletionStage.DECODE_DONE, now=5.0)
    assert list(s.latencies) == [("ttft", 1.0), ("tpot", 0.5)]   # the last attempt's decode

