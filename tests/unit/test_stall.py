"""dualpath/stall.py: a blocked event loop is noticed, located and counted."""

import asyncio
import logging
import time

from dualpath.stall import StallWatch


def _block_here(seconds: float) -> None:
    time.sleep(seconds)              # what the watch must name


def test_a_blocked_loop_is_logged_with_where_it_is_and_counted(caplog):
    stalls: list[float] = []

    async def main():
        w = StallWatch("t", threshold_s=0.3, period_s=0.05, on_stall=stalls.append).start()
        await asyncio.sleep(0.2)
        _block_here(0.8)
        await asyncio.sleep(0.3)         # the loop runs again: the stall is measured
        w.close()
        w.close()                        # idempotent
    with caplog.at_level(logging.WARNING, logger="dualpath.stall"):
        asyncio.run(main())
    text = caplog.text
    assert "event loop blocked for" in text and "_block_here" in text
    assert "ran again after" in text
    assert len(stalls) == 1 and 0.6 < stalls[0] < 2.0


def test_a_loop_that_runs_reports_nothing(caplog):
    stalls: list[float] = []

    async def main():
        w = StallWatch("t", threshold_s=0.3, period_s=0.05, on_stall=stalls.append).start()
        for _ in range(10):
            await asyncio.sleep(0.05)
        w.close()
    with caplog.at_level(logging.WARNING, logger="dualpath.stall"):
        asyncio.run(main())
    assert stalls == [] and "blocked" not in caplog.text


def test_a_process_that_ran_no_python_is_told_apart_from_a_blocked_loop(caplog):
    """The watch thread itself did not run (a C call holding the GIL, a SIGSTOP): it
    says so, counts it, and does not blame the loop."""
    stalls: list[float] = []

    async def main():
        w = StallWatch("t", threshold_s=0.3, period_s=0.05, on_stall=stalls.append).start()
        await asyncio.sleep(0.1)
        w._stop.wait = _oversleep(w._stop.wait)      # its next wait lasts 0.8 s
        await asyncio.sleep(1.2)
        w.close()
    with caplog.at_level(logging.WARNING, logger="dualpath.stall"):
        asyncio.run(main())
    assert "no Python thread ran for" in caplog.text
    assert "event loop blocked" not in caplog.text
    assert len(stalls) == 1 and stalls[0] > 0.5


def _oversleep(wait):
    once = [True]

    def w(timeout):
        if once[0]:
            once[0] = False
            time.sleep(0.8)
            return False
        return wait(timeout)
    return w
