"""Offline/online arrivals and the replay schedule, driven by a fake clock."""

import numpy as np
import pytest

from dualpath.errors import UsageError
from dualpath.trace.arrivals import ReplaySchedule, arrival_times
from dualpath.trace.model import Round, Trajectory


class FakeClock:
    def __init__(self, t=100.0):
        self.t = t

    def __call__(self):
        return self.t


def test_offline_agents_start_together():
    assert arrival_times(4, "offline") == [0.0] * 4


def test_online_poisson_mean_gap_and_seeding():
    aps = 2.0
    t = arrival_times(20000, "online", aps=aps, seed=9)
    gaps = np.diff([0.0] + t)
    assert all(g > 0 for g in gaps)
    # Exponential gaps: mean 1/aps = 0.5 s, standard deviation 0.5 s, so the mean of
    # 20000 has standard error 0.5 / sqrt(20000) = 0.0035 s; 3% (0.015 s) is > 4 of them.
    assert gaps.mean() == pytest.approx(1 / aps, rel=0.03)
    # and the coefficient of variation of an exponential is 1 (a fixed-rate schedule
    # would give 0): measured within 5%.
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)
    assert t == arrival_times(20000, "online", aps=aps, seed=9)
    assert t[:10] != arrival_times(10, "online", aps=aps, seed=10)


@pytest.mark.parametrize("kwargs, match", [
    ({"n_agents": 0, "mode": "offline"}, "number of agents"),
    ({"n_agents": 2, "mode": "online"}, "aps > 0"),
    ({"n_agents": 2, "mode": "online", "aps": 0}, "aps > 0"),
    ({"n_agents": 2, "mode": "offline", "aps": 1.0}, "aps is for online"),
    ({"n_agents": 2, "mode": "closed"}, "unknown replay mode"),
])
def test_bad_arrival_arguments(kwargs, match):
    with pytest.raises(UsageError, match=match):
        arrival_times(**kwargs)


A = Trajectory("A", (Round(10, 2), Round(5, 3)))
B = Trajectory("B", (Round(7, 1),))


def test_offline_rounds_run_sequentially_per_agent():
    clk = FakeClock()
    s = ReplaySchedule([A, B], [0.0, 0.0], block_tokens=4, clock=clk)
    s.start()
    first = s.due()
    assert [(r.agent, r.round) for r in first] == [(0, 0), (1, 0)]
    assert s.due() == [] and s.in_flight == 2 and s.next_due_s() is None
    # round 0 of A has prompt 10, no hits; B's only round has prompt 7
    assert (first[0].plan.prompt_tokens, first[0].plan.hit_tokens) == (10, 0)
    clk.t += 1.5
    s.finish(first[0])  # A's round 1 is due now (t = 1.5), not before
    assert s.next_due_s() == 1.5
    (r1,) = s.due()
    assert (r1.agent, r1.round, r1.due_s) == (0, 1, 1.5)
    # A's round 1: context = 10 + 2 = 12, prompt 17, hits 12 (3 blocks of 4)
    assert (r1.plan.prompt_tokens, r1.plan.hit_tokens, r1.request_id) == (17, 12, "a0-r1")
    clk.t += 1.0
    s.finish(r1)
    assert not s.done
    s.finish(first[1])
    assert s.done and s.finished_rounds == s.total_rounds == 3
    with pytest.raises(UsageError, match="not in flight"):
        s.finish(r1)


def test_online_agent_waits_for_its_arrival_and_think_time_applies():
    clk = FakeClock(0.0)
    s = ReplaySchedule([A, B], [0.0, 5.0], block_tokens=4, clock=clk, think_time_s=0.25)
    s.start()
    (a0,) = s.due()
    assert s.next_due_s() == 5.0
    clk.t = 2.0
    s.finish(a0)
    assert s.next_due_s() == 2.25 and s.due() == []  # thinking until 2.25
    clk.t = 6.0
    late = s.due()  # both came due while nobody looked; earliest first
    assert [(r.agent, r.round, r.due_s) for r in late] == [(0, 1, 2.25), (1, 0, 5.0)]


def test_schedule_argument_checks():
    with pytest.raises(UsageError, match="one trajectory per agent"):
        ReplaySchedule([A], [0.0, 1.0], block_tokens=4)
    s = ReplaySchedule([A], [0.0], block_tokens=4, clock=FakeClock())
    with pytest.raises(UsageError, match="not started"):
        s.due()
    s.start()
    with pytest.raises(UsageError, match="already started"):
        s.start()
