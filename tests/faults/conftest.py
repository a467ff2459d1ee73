"""The fault suite's harness: a small 1P2D LocalCluster (TCP provider, a journaled
scheduler, short leases), a replay driver, and helpers that break real processes of the
cluster — SIGKILL and restart of the scheduler or a node, SIGSTOP/SIGCONT past the
lease, SIGTERM, damaged blocks, a full disk under the store, a burst past the queue
bound. The replay runs on a worker thread and the faults on the main thread: a process
the cluster (re)starts gets SIGKILL when the thread that forked it exits
(PR_SET_PDEATHSIG), so it must be the long-lived one.

Each case asserts (:func:`check`), from the replay's own counts and the scheduler's:
0 acknowledged requests lost (every round finished), 0 reported twice, 0 wrong bytes
(the replay's bytes_mismatched, and every prompt byte verified at its DE — a round
whose DE died between its report and its timings counted apart), failed
attempts per request within the budget (none ended FAILED; the most any request had is
printed and bounded per case), and recovery within a stated number of leases measured
in the scheduler's own lease events (registrations, lapses, releases), never in seconds.
The seconds — from the fault to the end of every request in flight when it struck — and
the same in leases are printed on one FAULT line per case. Last, once the run is over,
the idle invariant (:func:`wait_idle_invariant`, `dualpath ctl check`): every node's
pools whole, nothing fenced, an empty read queue, no request state.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from dualpath import tls
from dualpath.cluster.faults import (  # noqa: F401 - registrations: the tests' too
    kill_and_restart,
    recovery_s,
    registrations,
    stall,
    wait_idle,
)
from dualpath.cluster.local import LocalCluster
from dualpath.cluster.replay import ReplayRun, replay_local
from dualpath.cluster.run import make_trace
from dualpath.kv.profiles import get_profile
from dualpath.v1 import scheduler_pb2, scheduler_pb2_grpc

PROFILE = get_profile("demo")
LEASE_MS = 1000
LEASE_S = LEASE_MS / 1000
MAX_FAILED_ATTEMPTS = 5          # the scheduler's default budget
SETTINGS = {"transport": {"kind": "tcp"},
            "scheduler": {"lease_ms": LEASE_MS, "retry_backoff_ms": 50,
                          "peer_avoid_ms": LEASE_MS},
            "transfer": {"timeout_s": 5.0, "recover_attempts": 1},
            "buffers": {"pe_buffer_mib": 128, "de_buffer_mib": 128},
            "storage": {"snic_gbit_per_s": 1.0}}


@dataclass
class Fault:
    """A fault injected (on the main thread) once ``after`` rounds have finished; with
    ``hold``, the replay waits for it to be in place before it goes on (a fault every
    later round must meet, whatever the host's load)."""

    after: int
    action: Callable[[LocalCluster], None]
    hold: bool = False
    fired_at: float = 0.0          # monotonic
    fired_unix: float = 0.0
    done_at: float = 0.0
    notes: dict = field(default_factory=dict)


def kill_and_restart_scheduler(cluster: LocalCluster) -> None:
    kill_and_restart("scheduler")(cluster)


def kill_and_restart_node(node_id: str) -> Callable[[LocalCluster], None]:
    return kill_and_restart(node_id)


def stall_node(node_id: str, leases: float) -> Callable[[LocalCluster], None]:
    """SIGSTOP a node past its lease, then SIGCONT it (it must register again)."""
    return stall(node_id, leases * LEASE_S)


def run_replay(cluster: LocalCluster, fault: Fault, *, agents: int = 6, rounds: int = 4,
               timeout_s: float = 240, seed: int = 3, **opts) -> ReplayRun:
    """Replay a small trace, injecting ``fault`` after its ``after``-th finished round
    (``opts``: more ReplayOptions, e.g. a read_policy)."""
    trace = make_trace(agents, context_scale=0.05, max_rounds=rounds, seed=seed)
    finished = [0]
    due, placed = threading.Event(), threading.Event()
    out: dict = {}

    def observer(_t):
        finished[0] += 1
        if finished[0] == fault.after:
            due.set()
            if fault.hold and not placed.wait(120):
                out["hold"] = "the replay's hold for the fault timed out (120 s)"

    def drive():
        try:
            out["run"] = replay_local(cluster, trace, PROFILE, timeout_s=timeout_s,
                                      observer=observer, give_up_s=60, **opts)
        except BaseException as e:  # noqa: BLE001 - re-raised on the main thread
            out["error"] = e

    worker = threading.Thread(target=drive, daemon=True)
    worker.start()
    while worker.is_alive():
        if due.wait(0.1):
            fault.fired_at, fault.fired_unix = time.monotonic(), time.time()
            try:
                fault.action(cluster)
            finally:
                placed.set()
            fault.done_at = time.monotonic()
            break
    worker.join()
    if "error" in out:
        raise out["error"]
    assert "hold" not in out, out["hold"]
    run = out["run"]
    run.extra["rounds"] = sum(len(t.rounds) for t in trace.trajectories)
    return run


def max_failed_attempts(cluster: LocalCluster, run: ReplayRun) -> int:
    """The most failed attempts any request of the run had (the scheduler's count)."""
    ids = sorted({t.request_id for t in run.timings})
    with tls.sync_channel(cluster.scheduler_address, cluster.client_tls) as ch:
        r = scheduler_pb2_grpc.SchedulerStub(ch).GetResults(
            scheduler_pb2.GetResultsRequest(request_ids=ids), timeout=10)
    return max((x.failed_attempts for x in r.results), default=0)


def fenced_blocks(cluster: LocalCluster) -> dict[str, int]:
    """Each node's dualpath_node_fenced_blocks, from its /metrics (the URL it logged)."""
    out = {}
    for nid in cluster.node_ids():
        text = (cluster.dir / "logs" / f"{nid}.log").read_text()
        url = re.findall(r"metrics: serving (http://\S+/metrics)", text)[-1]
        body = urllib.request.urlopen(url, timeout=10).read().decode()
        m = re.search(r"^dualpath_node_fenced_blocks (\S+)$", body, re.MULTILINE)
        out[nid] = int(float(m.group(1))) if m else 0
    return out


def wait_unfenced(cluster: LocalCluster, bound_s: float = 60.0) -> None:
    """Every fence released: the memory a stale writer might have written into is back
    once that writer said it stopped or was found gone (a liveness bound only)."""
    deadline = time.monotonic() + bound_s
    while any(fenced_blocks(cluster).values()):
        assert time.monotonic() < deadline, f"memory still fenced: {fenced_blocks(cluster)}"
        time.sleep(0.2)


def wait_idle_invariant(cluster: LocalCluster, bound_s: float = 60.0) -> None:
    """Once the run is over the cluster is idle, and then every node holds nothing: its
    pools whole, no fence, an empty read queue, no request state (`dualpath ctl check`;
    a decode node's write-back drains first: a liveness bound only)."""
    rc, rec = wait_idle(cluster, bound_s)
    assert rc == 0, f"idle invariant broken: {rec}"
    assert rec["ok"] and len(rec["nodes"]) == len(cluster.node_ids()), rec


def check(name: str, cluster: LocalCluster, run: ReplayRun, fault: Fault, *,
          max_failed: int = 2) -> dict:
    """The suite's promises for one case (see the module docstring); prints the FAULT
    line and returns its figures."""
    assert fault.fired_at, "the fault never fired"
    assert len(run.records) == run.extra["rounds"], "acknowledged requests lost"
    assert run.requests_lost == 0
    assert run.requests_duplicated == 0
    assert run.bytes_mismatched == 0
    assert run.requests_failed == 0, "a request spent its failure budget"
    # Every round's prompt KV verified at its DE. A round a killed DE reported to the
    # scheduler just before it died comes without the sink's timings, which carry the
    # verified count: its tokens are counted apart (the DE verified before it reported).
    prompt = sum(r.prompt_tokens for r in run.records)
    assert (run.unverified_prompt_tokens > 0) == (run.results_without_timings > 0)
    assert run.bytes_verified == ((prompt - run.unverified_prompt_tokens)
                                  * PROFILE.kv_bytes_per_token)
    failed = max_failed_attempts(cluster, run)
    assert failed <= max_failed < MAX_FAILED_ATTEMPTS
    wait_unfenced(cluster)
    wait_idle_invariant(cluster)
    rec = recovery_s(run.records, fault.fired_unix)
    figures = {"case": name, "requests": len(run.records),
               "lost": run.extra["rounds"] - len(run.records) + run.requests_lost,
               "duplicated": run.requests_duplicated, "wrong_bytes": run.bytes_mismatched,
               "max_failed_attempts": failed, "recovery_s": round(rec, 2),
               "recovery_leases": round(rec / LEASE_S, 2),
               "fault_s": round(fault.done_at - fault.fired_at, 2),
               "reexecutions": run.reexecutions, "node_failures": run.decode_failures,
               "results_without_timings": run.results_without_timings,
               **fault.notes}
    print(f"\nFAULT {json.dumps(figures)}")
    return figures


def make_cluster(tmp_path, *, launcher: list[str] | None = None, **overrides) -> LocalCluster:
    settings = {k: dict(v) for k, v in SETTINGS.items()}
    for sec, kv in overrides.items():
        settings.setdefault(sec, {}).update(kv)
    return LocalCluster(1, 2, work_dir=str(tmp_path), settings=settings,
                        launcher=launcher or [])


@pytest.fixture
def cluster(tmp_path):
    c = make_cluster(tmp_path)
    c.start()
    yield c
    c.stop()


def scheduler_log(cluster: LocalCluster) -> str:
    return (cluster.dir / "logs" / "scheduler.log").read_text()


def log_since(cluster: LocalCluster, name: str, marker: str) -> str:
    """The log of ``name`` from its last line containing ``marker`` on."""
    text = (cluster.dir / "logs" / f"{name}.log").read_text()
    at = text.rfind(marker)
    return text[at:] if at >= 0 else text


def eventually(what: str, ok: Callable[[], bool], bound_s: float = 60.0) -> None:
    """A liveness bound, not a timing: ``ok()`` holds within ``bound_s``."""
    deadline = time.monotonic() + bound_s
    while not ok():
        assert time.monotonic() < deadline, f"not within {bound_s:g} s: {what}"
        time.sleep(0.1)


def lapses(log: str, group: str) -> int:
    return len(re.findall(rf" group {group} \(\w+\) missed its lease", log))


def node_logs(cluster: LocalCluster) -> str:
    return "".join((cluster.dir / "logs" / f"{n}.log").read_text()
                   for n in cluster.node_ids())


@contextlib.contextmanager
def small_disk(kv_dir: Path, mib: int):
    """A ``mib`` MiB tmpfs over ``kv_dir`` in a mount namespace of its own, held by a
    sleeping process; yields (the launcher that runs a command in that namespace, the
    directory as seen from here through the holder's root). Skips where mount
    namespaces are not ours to make (not root, or no unshare)."""
    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("nsenter"):
        pytest.skip("a tmpfs in a private mount namespace needs root, unshare and nsenter")
    kv_dir.mkdir(parents=True, exist_ok=True)
    holder = subprocess.Popen(
        ["unshare", "-m", "--propagation", "private", "sh", "-c",
         (f"mount -t tmpfs -o size={mib}m dualpath-faults {kv_dir} && echo ready "
          "&& exec sleep infinity")], stdout=subprocess.PIPE, text=True)
    try:
        if holder.stdout.readline().strip() != "ready":
            pytest.skip("cannot mount a tmpfs in a private mount namespace here")
        yield (["nsenter", "-t", str(holder.pid), "-m", "--"],
               Path(f"/proc/{holder.pid}/root") / kv_dir.relative_to("/"))
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
