"""fig14's per-run figures: the balance over every step and over the full ones (every
engine's batch left work queued), each time-weighted."""

import pytest

from dualpath.engines.emulated.forward import StepRecord
from dualpath.repro.figures import step_balance


def _step(dur, attn, left, reqs=(1, 1)):
    return StepRecord(0.0, dur, tuple(attn), tuple(reqs), (64, 64), tuple(left))


def test_full_steps_are_those_whose_every_batch_left_work_queued():
    steps = [_step(2.0, [1.0, 1.0], [10, 5]),            # full, balanced
             _step(1.0, [1.0, 0.5], [10, 0]),            # one queue emptied: not full
             _step(1.0, [2.0, 0.0], [0, 0], (3, 0))]     # the drain: one engine idle
    b = step_balance(steps)
    assert b["steps"] == 3 and b["full_steps"] == 1
    assert b["attention_max_avg_full_steps"] == pytest.approx(1.0)
    assert b["attention_max_avg_mean"] == pytest.approx((2 * 1.0 + 1 * (4 / 3) + 1 * 2) / 4)
    assert b["full_step_time_fraction"] == pytest.approx(0.5)
    assert b["batch_requests_mean"] == pytest.approx(7 / 5)


def test_no_step_gives_no_figure():
    b = step_balance([])
    assert b["steps"] == 0 and b["attention_max_avg_mean"] is None
    assert b["full_step_time_fraction"] == 0.0
