"""Scheduler faults during a 1P2D replay (the harness: conftest.py).

SIGKILL + restart: the journal keeps every acknowledged submission and completion; the
nodes are told FAILED_PRECONDITION by the new incarnation and register again, claiming
what their engines run, so that work resumes where it was instead of running again;
the replay retries its calls through the outage and counts each round once, when the
restarted scheduler recorded it. SIGTERM + restart: the same after a clean stop.
Recovery in leases: each group registers exactly once with the new incarnation.
"""

from __future__ import annotations

import re
import time

import pytest

from dualpath.cluster.faults import terminate_and_restart
from tests.faults.conftest import (
    LEASE_S,
    Fault,
    check,
    kill_and_restart_scheduler,
    registrations,
    run_replay,
    scheduler_log,
)

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("how", ["sigkill", "sigterm"])
def test_scheduler_stopped_and_restarted_mid_replay(cluster, how):
    act = kill_and_restart_scheduler if how == "sigkill" else terminate_and_restart("scheduler")
    fault = Fault(after=5, action=act)
    run = run_replay(cluster, fault)

    def since_restart() -> str:
        # The new incarnation's log from its journal line on: written before the server
        # starts, whereas "listening on" follows the start, and a group retrying every
        # fetch interval can register in between.
        log = scheduler_log(cluster)
        return log[log.rindex("journal "):]
    # Each of the three groups registers once with the new incarnation, claiming what it
    # ran. A group the rest of the replay did not need may still be in its channel's
    # reconnect backoff when the replay ends: wait for it (bounded), then count.
    deadline = time.monotonic() + 40 * LEASE_S
    while (any(registrations(since_restart(), g) == 0 for g in ("p0", "d0", "d1"))
           and time.monotonic() < deadline):
        time.sleep(0.1)
    after = since_restart()
    for g in ("p0", "d0", "d1"):
        assert registrations(after, g) == 1, g
    assert "recovered" in after.splitlines()[0]
    fault.notes["claims"] = sum(int(x) for x in
                                re.findall(r"; (\d+) running requests claimed", after))
    check(f"scheduler {how} + restart", cluster, run, fault)
