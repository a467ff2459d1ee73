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

import pytest

from dualpath.cluster.faults import terminate_and_restart
from tests.faults.conftest import (
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
    log = scheduler_log(cluster)
    # The new incarnation's log from its journal line on: written before the server
    # starts, whereas "listening on" follows the start, and a group retrying every
    # fetch interval can register in between.
    after = log[log.rindex("journal "):]
    # Each of the three groups registered once with the new incarnation (within a lease
    # of its start), claiming what it ran.
    for g in ("p0", "d0", "d1"):
        assert registrations(after, g) == 1, g
    assert "recovered" in after.splitlines()[0]
    fault.notes["claims"] = sum(int(x) for x in
                                re.findall(r"; (\d+) running requests claimed", after))
    check(f"scheduler {how} + restart", cluster, run, fault)
