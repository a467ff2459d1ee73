"""Scheduler faults during a 1P2D replay (the harness: conftest.py).

SIGKILL + restart: the journal keeps every acknowledged submission and completion; the
nodes are told FAILED_PRECONDITION by the new incarnation and register again; what was
running and not claimed runs again under a new attempt after one lease; the replay
retries its calls through the outage and counts each round once, when the restarted
scheduler recorded it. Recovery is asserted in leases: each group registers exactly once
with the new incarnation (the seconds are printed, not asserted).
"""

from __future__ import annotations

import pytest

from tests.faults.conftest import (
    LEASE_MS,
    Fault,
    assert_clean,
    kill_and_restart_scheduler,
    run_replay,
    scheduler_log,
)

pytestmark = pytest.mark.slow


def test_scheduler_sigkill_and_restart_mid_replay(cluster):
    fault = Fault(after=5, action=kill_and_restart_scheduler)
    run = run_replay(cluster, fault)
    assert fault.fired_at, "the fault never fired"
    assert_clean(run)
    log = scheduler_log(cluster)
    after = log[log.rindex("scheduler listening on"):]
    # Each of the three groups registered once with the new incarnation: recovery within
    # one lease of registrations (then one lease of recovery hold).
    registered = [line.split(" group ", 1)[1].split()[0] for line in after.splitlines()
                  if " group " in line and " registered by " in line]
    assert sorted(registered) == ["d0", "d1", "p0"]
    assert "recovered" in log[log.rindex("journal "):]
    print(f"\nscheduler restart: {fault.done_at - fault.fired_at:.2f} s down and back "
          f"(lease {LEASE_MS} ms); re-executions {run.reexecutions}, "
          f"node-reported failures {run.decode_failures}")
