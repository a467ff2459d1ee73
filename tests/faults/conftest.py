"""The fault suite's harness: a small 1P2D LocalCluster (TCP provider, a journaled
scheduler, short leases), a replay driver, and helpers that break real processes of the
cluster — SIGKILL and restart of the scheduler or a node, SIGSTOP/SIGCONT past the
lease, SIGTERM. The replay runs on a worker thread and the faults on the main thread:
a process the cluster (re)starts gets SIGKILL when the thread that forked it exits
(PR_SET_PDEATHSIG), so it must be the long-lived one.

Each case asserts, from the replay's own counts and the scheduler's: 0 acknowledged
requests lost (every round finished), 0 reported twice, 0 wrong bytes, failed attempts
within the budget (no request ended FAILED), and recovery within a stated number of
leases measured in registrations, never in seconds (the seconds are printed).
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from dualpath.cluster.local import LocalCluster
from dualpath.cluster.replay import ReplayOptions, ReplayRun, replay
from dualpath.cluster.run import make_trace
from dualpath.kv.profiles import get_profile

PROFILE = get_profile("demo")
LEASE_MS = 1000
SETTINGS = {"transport": {"kind": "tcp"},
            "scheduler": {"lease_ms": LEASE_MS, "retry_backoff_ms": 50,
                          "peer_avoid_ms": LEASE_MS},
            "transfer": {"timeout_s": 5.0, "recover_attempts": 1},
            "buffers": {"pe_buffer_mib": 128, "de_buffer_mib": 128},
            "storage": {"snic_gbit_per_s": 1.0}}


@dataclass
class Fault:
    """A fault injected (on the main thread) once ``after`` rounds have finished."""

    after: int
    action: Callable[[LocalCluster], None]
    fired_at: float = 0.0
    done_at: float = 0.0


def kill_and_restart_scheduler(cluster: LocalCluster) -> None:
    cluster.kill_scheduler()
    cluster.start_scheduler()


def kill_and_restart_node(node_id: str) -> Callable[[LocalCluster], None]:
    def act(cluster: LocalCluster) -> None:
        cluster.kill(node_id)
        cluster.restart_node(node_id)
    return act


def stall_node(node_id: str, leases: float) -> Callable[[LocalCluster], None]:
    """SIGSTOP a node past its lease, then SIGCONT it (it must register again)."""
    def act(cluster: LocalCluster) -> None:
        cluster.signal(node_id, signal.SIGSTOP)
        time.sleep(leases * LEASE_MS / 1000)
        cluster.signal(node_id, signal.SIGCONT)
    return act


def run_replay(cluster: LocalCluster, fault: Fault, *, agents: int = 6, rounds: int = 4,
               timeout_s: float = 240) -> ReplayRun:
    """Replay a small trace, injecting ``fault`` after its ``after``-th finished round."""
    trace = make_trace(agents, context_scale=0.05, max_rounds=rounds, seed=3)
    finished = [0]
    due = threading.Event()
    out: dict = {}

    def observer(_t):
        finished[0] += 1
        if finished[0] == fault.after:
            due.set()

    def drive():
        try:
            out["run"] = asyncio.run(replay(
                cluster.scheduler_address, trace, cluster.node_ids(),
                block_tokens=PROFILE.block_tokens,
                kv_bytes_per_token=PROFILE.kv_bytes_per_token,
                tls_config=cluster.client_tls, node_tls=cluster.node_tls,
                opts=ReplayOptions(progress=False, timeout_s=timeout_s, observer=observer,
                                   give_up_s=60)))
        except BaseException as e:  # noqa: BLE001 - re-raised on the main thread
            out["error"] = e

    worker = threading.Thread(target=drive, daemon=True)
    worker.start()
    while worker.is_alive():
        if due.wait(0.1):
            fault.fired_at = time.monotonic()
            fault.action(cluster)
            fault.done_at = time.monotonic()
            break
    worker.join()
    if "error" in out:
        raise out["error"]
    run = out["run"]
    run.extra["rounds"] = sum(len(t.rounds) for t in trace.trajectories)
    return run


def assert_clean(run: ReplayRun) -> None:
    """0 lost, 0 reported twice, 0 wrong bytes, nothing past its failure budget."""
    assert len(run.records) == run.extra["rounds"], "acknowledged requests lost"
    assert run.requests_duplicated == 0
    assert run.bytes_mismatched == 0
    assert run.requests_failed == 0, "a request spent its failure budget"
    prompt = sum(r.prompt_tokens for r in run.records)
    assert run.bytes_verified == prompt * PROFILE.kv_bytes_per_token


@pytest.fixture
def cluster(tmp_path):
    c = LocalCluster(1, 2, work_dir=str(tmp_path), settings=SETTINGS)
    c.start()
    yield c
    c.stop()


def scheduler_log(cluster: LocalCluster) -> str:
    return (cluster.dir / "logs" / "scheduler.log").read_text()
