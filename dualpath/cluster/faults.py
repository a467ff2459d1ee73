"""Faults a LocalCluster can be put through, as an operator would meet them: the shared
vocabulary of the fault suite (tests/faults/) and bench/faults.py.

Each maker returns an *action* ``act(cluster)`` that breaks something real and, where
the fault is a process stopping, starts it again before returning: SIGKILL or SIGTERM
(and a restart) of the scheduler or a node, SIGSTOP for a while then SIGCONT, a node cut
off the network for a while then healed (its cluster in network namespaces: netns.py),
stored blocks corrupted, truncated or deleted, the disk under the store filled. Actions run on
the thread that owns the cluster (a restarted process dies with the thread that forked
it: PR_SET_PDEATHSIG).

:func:`recovery_s` measures what a fault cost: from the moment it struck until every
round that was in flight then had finished. :func:`taken_up_again_s` measures the
cluster's own part of it: from the fault's end until each of those rounds was taken up
by a prefill node again (without the service time of the round run again).

Threads: the cluster's owner thread; nothing here is asynchronous.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from dualpath.cluster.local import LocalCluster
from dualpath.cluster.netns import Namespaces
from dualpath.storage.format import HEADER_BYTES
from dualpath.trace.report import RequestRecord

Action = Callable[[LocalCluster], None]

DAMAGE_KINDS = ("corrupt", "truncate", "delete")


def kill_and_restart(name: str) -> Action:
    """SIGKILL the scheduler (``name`` "scheduler") or a node, then start it again."""
    def act(cluster: LocalCluster) -> None:
        if name == "scheduler":
            cluster.kill_scheduler()
            cluster.start_scheduler()
        else:
            cluster.kill(name)
            cluster.restart_node(name)
    return act


def terminate_and_restart(name: str, grace_s: float = 60.0) -> Action:
    """SIGTERM the scheduler or a node, wait for its exit, start it again."""
    def act(cluster: LocalCluster) -> None:
        proc = cluster.scheduler if name == "scheduler" else cluster.node(name).proc
        cluster.signal(name, signal.SIGTERM)
        proc.wait(grace_s)
        if name == "scheduler":
            cluster.start_scheduler()
        else:
            cluster.restart_node(name)
    return act


def stall(name: str, seconds: float) -> Action:
    """SIGSTOP a node (or the scheduler) for ``seconds``, then SIGCONT it."""
    def act(cluster: LocalCluster) -> None:
        cluster.signal(name, signal.SIGSTOP)
        try:
            time.sleep(seconds)
        finally:
            cluster.signal(name, signal.SIGCONT)
    return act


def partition(nets: Namespaces, name: str, seconds: float) -> Action:
    """Cut node ``name`` off the network (``nets``) for ``seconds``, then heal it."""
    def act(cluster: LocalCluster) -> None:
        nets.cut(name)
        try:
            time.sleep(seconds)
        finally:
            nets.heal(name)
    return act


def block_files(cluster: LocalCluster) -> list[Path]:
    """The stored blocks (not temp files, not ones set aside as corrupt)."""
    root = cluster.dir / "kv"
    return sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith(".")
                  and not p.name.endswith(".corrupt"))


def damage_blocks(kind: str, fraction: float = 1.0, rng: random.Random | None = None
                  ) -> Action:
    """Corrupt (one payload byte flipped), truncate (to half) or delete ``fraction`` of
    the blocks stored so far; ``act.damaged`` lists them afterwards."""
    if kind not in DAMAGE_KINDS:
        raise ValueError(f"damage kind {kind!r}; allowed: {', '.join(DAMAGE_KINDS)}")

    def act(cluster: LocalCluster) -> None:
        files = block_files(cluster)
        if fraction < 1.0:
            files = (rng or random).sample(files, int(len(files) * fraction))
        done = []
        for p in files:
            try:
                if kind == "corrupt":
                    with open(p, "r+b") as fh:
                        fh.seek(HEADER_BYTES + 1000)
                        b = fh.read(1)
                        fh.seek(HEADER_BYTES + 1000)
                        fh.write(bytes([b[0] ^ 0xFF]))
                elif kind == "truncate":
                    os.truncate(p, p.stat().st_size // 2)
                else:
                    p.unlink()
            except (FileNotFoundError, IndexError):   # read and set aside meanwhile
                continue
            done.append(p)
        act.damaged = done
    act.damaged = []
    return act


def recached(kind: str, paths: Sequence[Path]) -> int:
    """Damaged blocks that were found bad on a read and written again: a deleted one is
    back; a corrupt or short one was set aside on read (``.corrupt``) and the recomputed
    block took its name."""
    return sum(1 for p in paths if p.exists() and (
        kind == "delete" or p.with_name(p.name + ".corrupt").exists()))


def fill_disk(directory: Path) -> int:
    """Write a ballast file into ``directory`` until its filesystem is full; its bytes."""
    n = 0
    chunk = b"\0" * (1 << 20)
    with open(directory / "ballast", "wb", buffering=0) as fh:
        try:
            while True:
                n += fh.write(chunk)
        except OSError:
            pass
    return n


def recovery_s(records: Sequence[RequestRecord], struck_unix_s: float) -> float:
    """From ``struck_unix_s`` until every round in flight then had finished (0 when none
    was)."""
    hit = [r.finish_s for r in records if r.submit_s < struck_unix_s < r.finish_s]
    return max(hit, default=struck_unix_s) - struck_unix_s


def episodes(spans: Sequence[tuple[float, float]]) -> list[int]:
    """For each fault's span (struck, until), the index of its episode: faults whose spans
    overlap, directly or through others, form one episode (numbered in strike order). A
    fault that strikes while an earlier one's rounds are still recovering adds to that
    recovery; the cluster's own recovery is the episode's, from its last fault's end."""
    order = sorted(range(len(spans)), key=lambda i: spans[i][0])
    out = [0] * len(spans)
    episode, reach = -1, float("-inf")
    for i in order:
        a, b = spans[i]
        if a >= reach:
            episode += 1
        reach = max(reach, b) if a < reach else b
        out[i] = episode
    return out


def isolated(spans: Sequence[tuple[float, float]]) -> list[bool]:
    """For each fault's span (struck, until: its end or its recovery's, whichever is
    later), whether no other fault's span overlaps it, i.e. it is an episode by itself:
    its recovery is its own, not a sum of faults that struck one after another."""
    eps = episodes(spans)
    return [eps.count(e) == 1 for e in eps]


def episode_recovery_s(faults: Sequence[tuple[float, float, float]]) -> float:
    """An episode's recovery: from the end of its last fault until every round in flight
    at any of its strikes had finished (0 when they had by then). ``faults`` holds each
    fault's (struck, fault_s, recovery_s), recovery_s as :func:`recovery_s` gives it."""
    ended = max(s + f for s, f, _ in faults)
    return max(0.0, max(s + r for s, _, r in faults) - ended)


def affected(records: Sequence[RequestRecord], timings: Sequence, struck_unix_s: float
             ) -> list[tuple[RequestRecord, object]]:
    """The rounds in flight when a fault struck at ``struck_unix_s``, each with its
    timings (node.proto RequestTimings: ``records`` and ``timings`` pair up)."""
    return [(r, t) for r, t in zip(records, timings)
            if r.submit_s < struck_unix_s < r.finish_s]


def taken_up_again_s(records: Sequence[RequestRecord], timings: Sequence,
                     struck_unix_s: float, ended_unix_s: float) -> float:
    """From a fault's end (``ended_unix_s``) until every round in flight when it struck
    was taken up by a prefill node again (its final attempt's assignment; a round whose
    final attempt was assigned before the strike was never interrupted): the cluster's
    own recovery, without the re-executed round's service time (0 when none)."""
    points = [max(struck_unix_s, t.assigned_unix_s)
              for _, t in affected(records, timings, struck_unix_s)]
    return max(0.0, max(points, default=ended_unix_s) - ended_unix_s)


def service_s(record: RequestRecord, timing) -> float:
    """A round's service time: from its final attempt's assignment to its last token
    (from its submission when the assignment is not known)."""
    start = timing.assigned_unix_s or record.submit_s
    return record.finish_s - start


def unhandled_errors(log_dir: Path) -> list[str]:
    """Lines of the daemons' logs in ``log_dir`` that show an error nobody handled (a
    traceback, "never retrieved"); vLLM's own logs (``vllm-*``) are not ours to judge: a
    killed peer's tracebacks are expected there."""
    out = []
    for f in sorted(log_dir.glob("*.log")):
        if f.name.startswith("vllm-"):
            continue
        lines = f.read_text(errors="replace").splitlines()
        for i, line in enumerate(lines):
            if "never retrieved" in line:
                # asyncio's next line names the future and its exception
                nxt = lines[i + 1][:300] if i + 1 < len(lines) else ""
                out.append(f"{f.name}: {line[:200]} | {nxt}")
            elif line.startswith("Traceback") and not (
                    i >= 2 and "never retrieved" in lines[i - 2]):
                out.append(f"{f.name}: {line[:200]}")
    return out


def registrations(log: str, group: str) -> int:
    """Times ``group`` registered, in the scheduler's log text."""
    return len(re.findall(rf" group {group} registered by ", log))


def idle_check(cluster: LocalCluster) -> tuple[int, dict]:
    """`dualpath ctl check --json` against the cluster (its admin config), as an
    operator runs it: exit code and record (the idle invariant: dualpath/node/holdings.py)."""
    p = subprocess.run([sys.executable, "-m", "dualpath.cli", "ctl", "check", "--json",
                        "--config", str(cluster.config_path)],
                       check=False, capture_output=True, text=True, timeout=60)
    try:
        return p.returncode, json.loads(p.stdout)
    except json.JSONDecodeError:
        why = f"ctl check: exit {p.returncode}: {p.stderr[-300:]}"
        return p.returncode, {"violations": [why], "busy": {}}


def wait_idle(cluster: LocalCluster, bound_s: float = 60.0) -> tuple[int, dict]:
    """:func:`idle_check` until it holds or ``bound_s`` passed (a decode node's
    write-back drains for a while after the last request): its last answer."""
    deadline = time.monotonic() + bound_s
    while True:
        rc, rec = idle_check(cluster)
        if rc == 0 or time.monotonic() > deadline:
            return rc, rec
        time.sleep(0.5)
