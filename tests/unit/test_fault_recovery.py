"""The soak's recovery figures (dualpath/cluster/faults.py): which rounds a fault met,
when the cluster took them up again, and a round's service time."""

from __future__ import annotations

from types import SimpleNamespace

from dualpath.cluster.faults import (
    affected,
    episode_recovery_s,
    episodes,
    isolated,
    recovery_s,
    service_s,
    taken_up_again_s,
)
from dualpath.trace.report import RequestRecord


def rec(submit: float, finish: float) -> RequestRecord:
    return RequestRecord(0, 0, submit, submit, None, finish, 10, 0, 1)


def timing(assigned: float, attempt: int = 1):
    return SimpleNamespace(assigned_unix_s=assigned, attempt=attempt)


STRUCK, ENDED = 100.0, 103.0
RECORDS = [rec(90, 95),            # done before the strike
           rec(98, 101),           # in flight, never interrupted (assigned at 98.5)
           rec(99, 106),           # in flight, taken up again at 104 (attempt 2)
           rec(101, 102)]          # submitted after the strike
TIMINGS = [timing(90.5), timing(98.5), timing(104.0, 2), timing(101.2)]


def test_affected_is_the_rounds_in_flight_when_it_struck():
    got = affected(RECORDS, TIMINGS, STRUCK)
    assert [r.submit_s for r, _ in got] == [98, 99]


def test_taken_up_again_counts_from_the_end_to_the_last_reassignment():
    assert taken_up_again_s(RECORDS, TIMINGS, STRUCK, ENDED) == 1.0
    # From the strike, the old figure: until the last of them finished.
    assert recovery_s(RECORDS, STRUCK) == 6.0


def test_a_fault_that_met_nothing_or_interrupted_nothing_costs_nothing():
    assert taken_up_again_s(RECORDS[:1], TIMINGS[:1], STRUCK, ENDED) == 0.0
    assert taken_up_again_s(RECORDS[:2], TIMINGS[:2], STRUCK, ENDED) == 0.0


def test_service_is_from_the_final_assignment_or_the_submission():
    assert service_s(RECORDS[2], TIMINGS[2]) == 2.0
    assert service_s(RECORDS[2], timing(0.0)) == 7.0


def test_a_fault_is_isolated_when_no_other_faults_span_overlaps_its_own():
    # Spans (struck, until): 0-3 and 2-5 overlap; 6-7 stands alone; 7-9 only touches it.
    assert isolated([(0, 3), (2, 5), (6, 7), (7, 9)]) == [False, False, True, True]
    assert isolated([(1, 2)]) == [True]
    assert isolated([]) == []


def test_overlapping_spans_chain_into_one_episode_in_strike_order():
    # 0-3 and 2-5 overlap; 4-6 overlaps 2-5 only (a chain); 7-9 starts after; 9-10 touches.
    assert episodes([(0, 3), (2, 5), (4, 6), (7, 9), (9, 10)]) == [0, 0, 0, 1, 2]
    # Given out of strike order, numbered in strike order.
    assert episodes([(7, 9), (0, 3), (2, 8)]) == [0, 0, 0]
    assert episodes([(5, 6), (0, 1)]) == [1, 0]
    assert episodes([]) == []


def test_an_episodes_recovery_counts_from_its_last_faults_end():
    # (struck, fault_s, recovery_s): the first fault's rounds finish at 10, the second
    # ends at 7 and its rounds finish at 8: 3 s after the last fault ended.
    assert episode_recovery_s([(0, 2, 10), (5, 2, 3)]) == 3.0
    # Rounds all done before the last fault ended: nothing to recover.
    assert episode_recovery_s([(0, 4, 1), (3, 2, 0)]) == 0.0
