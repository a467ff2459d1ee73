#!/usr/bin/env python3
"""Faults at random times, repeatedly, during replays on a local 1P2D cluster: totals.

Method. One LocalCluster (journaled scheduler, 1 prefill node, 2 decode nodes, TCP
provider on loopback, lease --lease-ms) replays a small generated trace (Table 2 '32k'
row, context scaled; storage NICs at 0.5 Gbit/s, so a replay lasts long enough for
several faults) again and again, fresh trajectory names each time. While a replay
runs, the main thread strikes faults one after another with random gaps (uniform in
[--gap-min-s, --gap-max-s]), at most --faults-per-replay of them, each of a kind drawn at random (weights in KINDS): SIGKILL
+ restart or SIGTERM + restart of the scheduler, p0, d0 or d1 (these are the *kills*),
SIGSTOP of a node for 1.5-3 leases then SIGCONT, the same three times in a row
(sigstop_again: each time the node registers again before the next), with --netns a
node cut off the network for 1.5-3 leases then healed (partition: each node in a
network namespace of its own behind a veth, its veth's bridge end down: a silent drop),
and a random quarter of the stored blocks corrupted, truncated or deleted. A restart is part of its
fault; the next gap starts after it. Replays continue until --kills kills and --faults
faults in all have struck.

After each replay: requests lost (rounds that never finished plus submissions the
scheduler forgot), reported twice, wrong bytes (what the DEs' verification found) and
ended FAILED, all from the replay client; the most failed attempts of any request (the
scheduler's GetResults); the idle invariant once the replay is over (`dualpath ctl
check`, waited for up to 60 s: every node's pools whole, nothing fenced, an empty read
queue, no request state; each replay that never gets there is a violation); rounds a
replay gave up on (requests_stuck); and per fault its recovery: seconds from the fault
until every round in flight when it struck had finished, also in leases (several faults may fall
in one round's life, so this bounds each from above). Model execution is emulated (the
cost model); every KV byte moves for real and is verified.

Prints a table per fault kind and the totals; --json PATH writes the same record, its
"summary" holding faults_injected, kills, requests_lost, requests_duplicated,
bytes_mismatched, requests_stuck, idle_invariant_violations, unhandled_errors (tracebacks
and "never retrieved" lines in the daemons' logs), episodes and max_recovery_leases (faults
whose spans, strike to the later of its end and its recovery, overlap, directly or in a
chain, are one episode; its recovery runs from the end of its last fault until every round
any of them met had finished: the soak strikes the next fault 0.2-1.5 s after one ended,
and a partition or freeze lasts 1.5-3 leases by itself, so this is the figure the cluster
answers for), max_taken_up_again_leases_after_episode (the same until every such round
was taken up by a prefill node again), max_recovery_leases_from_strike (per fault, from
its strike: the fault itself and the faults that followed within its recovery included),
max_recovery_leases_after_scheduler_restart (a scheduler fault's recovery counted from
the restarted scheduler's start, not from the kill) and max_recovery_leases_after_fault
(every fault's, from its end: a freeze's SIGCONT, a restart; with one prefill node no
prefill runs while it is frozen); and for the isolated faults alone (isolated_faults: a
fault that is an episode by itself) max_recovery_leases_isolated_after_fault and
max_taken_up_again_leases_isolated. The table per fault kind gives recovery from the
strike. --quick: 6 kills, 10 faults on a smaller trace (a
smoke run).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

from dualpath import tls
from dualpath.cluster.faults import (
    DAMAGE_KINDS,
    affected,
    damage_blocks,
    episode_recovery_s,
    episodes,
    isolated,
    kill_and_restart,
    partition,
    recovery_s,
    registrations,
    service_s,
    stall,
    taken_up_again_s,
    terminate_and_restart,
    unhandled_errors,
    wait_idle,
)
from dualpath.cluster.local import LocalCluster
from dualpath.cluster.netns import Namespaces, available
from dualpath.cluster.replay import ReplayAborted, replay_local
from dualpath.cluster.run import make_trace
from dualpath.kv.profiles import get_profile
from dualpath.v1 import scheduler_pb2, scheduler_pb2_grpc

PROFILE = get_profile("demo")
DAEMONS = ("scheduler", "p0", "d0", "d1")
NODES = ("p0", "d0", "d1")
#: Fault kinds and their weights (kills dominate: the target counts them).
KINDS = {"sigkill": 4, "sigterm": 2, "sigstop": 1, "sigstop_again": 1, "blocks": 1}
STOPS_AGAIN = 3


def settings(lease_ms: int) -> dict:
    return {"transport": {"kind": "tcp"},
            "scheduler": {"lease_ms": lease_ms, "retry_backoff_ms": 50,
                          "peer_avoid_ms": lease_ms},
            "transfer": {"timeout_s": 5.0, "recover_attempts": 1},
            "buffers": {"pe_buffer_mib": 128, "de_buffer_mib": 128},
            "storage": {"snic_gbit_per_s": 0.5}}


def draw(rng: random.Random, lease_s: float, nets: Namespaces | None = None):
    """A random fault: (kind, target, action); partitions only with ``nets``."""
    kinds = {**KINDS, **({"partition": 2} if nets is not None else {})}
    kind = rng.choices(list(kinds), weights=list(kinds.values()))[0]
    if kind == "partition":
        who = rng.choice(NODES)
        return kind, who, partition(nets, who, rng.uniform(1.5, 3.0) * lease_s)
    if kind == "sigkill":
        who = rng.choice(DAEMONS)
        return kind, who, kill_and_restart(who)
    if kind == "sigterm":
        who = rng.choice(DAEMONS)
        return kind, who, terminate_and_restart(who)
    if kind == "sigstop":
        who = rng.choice(NODES)
        return kind, who, stall(who, rng.uniform(1.5, 3.0) * lease_s)
    if kind == "sigstop_again":
        who = rng.choice(NODES)
        return kind, who, stall_again(who, [rng.uniform(1.5, 3.0) * lease_s
                                            for _ in range(STOPS_AGAIN)])
    how = rng.choice(DAMAGE_KINDS)
    return kind, how, damage_blocks(how, 0.25, rng)


def stall_again(who: str, seconds: list[float]):
    """Freeze ``who`` past its lease once per entry of ``seconds``, waiting (up to 30 s)
    for it to register again between two freezes."""
    def act(cluster: LocalCluster) -> None:
        log = cluster.dir / "logs" / "scheduler.log"
        for s in seconds:
            before = _registrations(log, who)
            stall(who, s)(cluster)
            deadline = time.monotonic() + 30
            while _registrations(log, who) <= before and time.monotonic() < deadline:
                time.sleep(0.1)
    return act


def _registrations(log: Path, who: str) -> int:
    try:
        return registrations(log.read_text(errors="replace"), who)
    except OSError:
        return 0


def idle_invariant(cluster: LocalCluster, bound_s: float = 60.0) -> list[str]:
    """`dualpath ctl check` until it holds (bounded): [] or the last violations."""
    rc, rec = wait_idle(cluster, bound_s)
    if rc == 0:
        return []
    return rec.get("violations") or [f"not idle: {rec.get('busy')}"]


def one_replay(cluster: LocalCluster, args, rng: random.Random, index: int,
               kills_left: int, nets: Namespaces | None = None) -> dict:
    """A replay with faults striking while it runs (kills at most ``kills_left``, other
    kinds then)."""
    trace = make_trace(args.agents, context_scale=args.context_scale, max_rounds=args.rounds,
                       seed=args.seed + index)
    rounds = sum(len(t.rounds) for t in trace.trajectories)
    out: dict = {}

    def drive():
        try:
            out["run"] = replay_local(cluster, trace, PROFILE,
                                      timeout_s=args.replay_timeout_s, give_up_s=60,
                                      seed=args.seed + index,
                                      **({"sink_listen": f"{nets.bridge_ip}:0"}
                                         if nets is not None else {}))
        except ReplayAborted as e:
            out["run"], out["aborted"] = e.run, str(e)

    worker = threading.Thread(target=drive, daemon=True)
    worker.start()
    faults = []
    lease_s = args.lease_ms / 1000
    while worker.is_alive() and len(faults) < args.faults_per_replay:
        worker.join(rng.uniform(args.gap_min_s, args.gap_max_s))
        if worker.is_alive():
            kind, who, act = draw(rng, lease_s, nets)
            while kind in ("sigkill", "sigterm") and kills_left <= 0:
                kind, who, act = draw(rng, lease_s, nets)
            t0, struck = time.monotonic(), time.time()
            act(cluster)
            kills_left -= kind in ("sigkill", "sigterm")
            faults.append({"kind": kind, "target": who, "struck_unix_s": struck,
                           "fault_s": time.monotonic() - t0,
                           "damaged": len(getattr(act, "damaged", ()))})
    worker.join()
    run = out["run"]
    if "aborted" in out:
        out["aborted"] += "\n" + scheduler_view(cluster)
    struck_at = [f["struck_unix_s"] for f in faults]
    calm = [service_s(r, t) for r, t in zip(run.records, run.timings)
            if not any(r.submit_s < s < r.finish_s for s in struck_at)]
    calm_s = statistics.median(calm) if calm else 0.0
    for f in faults:
        f["recovery_s"] = recovery_s(run.records, f["struck_unix_s"])
        f["recovery_leases"] = f["recovery_s"] / lease_s
        ended = f["struck_unix_s"] + f["fault_s"]
        f["taken_up_again_s"] = taken_up_again_s(run.records, run.timings,
                                                 f["struck_unix_s"], ended)
        hit = affected(run.records, run.timings, f["struck_unix_s"])
        # The slowest service of a round the fault met and a prefill node took up again
        # after it ended, over the replay's median of rounds no fault met: a stall the
        # fault left behind shows here (a round that rode through a freeze does not).
        again = [service_s(r, t) for r, t in hit if t.assigned_unix_s >= ended]
        f["service_vs_calm"] = max(again, default=0.0) / calm_s if calm_s else 0.0
        f["rounds"] = [{"attempt": t.attempt,
                        "assigned_s": round(t.assigned_unix_s - ended, 2),
                        "finish_s": round(r.finish_s - ended, 2),
                        "service_s": round(service_s(r, t), 2)} for r, t in hit]
    spans = [(f["struck_unix_s"], f["struck_unix_s"] + max(f["fault_s"], f["recovery_s"]))
             for f in faults]
    for f, alone, ep in zip(faults, isolated(spans), episodes(spans)):
        f["isolated"], f["episode"] = alone, ep
    eps = []
    for ep in sorted({f["episode"] for f in faults}):
        fs = [f for f in faults if f["episode"] == ep]
        ended = max(f["struck_unix_s"] + f["fault_s"] for f in fs)
        eps.append({"faults": [f"{f['kind']} {f['target']}" for f in fs],
                    "fault_s": round(ended - min(f["struck_unix_s"] for f in fs), 2),
                    "recovery_s": round(episode_recovery_s(
                        [(f["struck_unix_s"], f["fault_s"], f["recovery_s"]) for f in fs]), 2),
                    "taken_up_again_s": round(max(
                        (f["struck_unix_s"] + f["fault_s"] + f["taken_up_again_s"] - ended
                         for f in fs), default=0.0), 2)})
    return {"rounds": rounds, "finished": len(run.records),
            "stuck": rounds - len(run.records) if "aborted" in out else 0,
            "idle_violations": idle_invariant(cluster),
            "lost": rounds - len(run.records) + run.requests_lost,
            "duplicated": run.requests_duplicated, "bytes_mismatched": run.bytes_mismatched,
            "failed": run.requests_failed, "reexecutions": run.reexecutions,
            "bytes_verified": run.bytes_verified,
            "max_failed_attempts": max_failed_attempts(cluster, run),
            "aborted": out.get("aborted", ""), "faults": faults, "episodes": eps}


def scheduler_view(cluster: LocalCluster) -> str:
    """`dualpath ctl requests --all`: where the scheduler holds each live request."""
    r = subprocess.run([sys.executable, "-m", "dualpath.cli", "ctl", "requests", "--all",
                        "--config", str(cluster.config_path)],
                       check=False, capture_output=True, text=True, timeout=60)
    return r.stdout + r.stderr


def max_failed_attempts(cluster: LocalCluster, run) -> int:
    ids = sorted({t.request_id for t in run.timings})
    if not ids:
        return 0
    with tls.sync_channel(cluster.scheduler_address, cluster.client_tls) as ch:
        r = scheduler_pb2_grpc.SchedulerStub(ch).GetResults(
            scheduler_pb2.GetResultsRequest(request_ids=ids), timeout=10)
    return max((x.failed_attempts for x in r.results), default=0)


def summarize(replays: list[dict], wall_s: float, args, unhandled: list[str]) -> dict:
    faults = [f for r in replays for f in r["faults"]]
    kills = [f for f in faults if f["kind"] in ("sigkill", "sigterm")]
    rec = [f["recovery_leases"] for f in faults]
    alone = [f for f in faults if f["isolated"]]
    eps = [e for r in replays for e in r["episodes"]]
    lease_s = args.lease_ms / 1000

    def after_fault(fs: list[dict]) -> float:
        """The longest recovery of ``fs`` from the fault's end, in leases."""
        return round(max((max(0.0, f["recovery_s"] - f["fault_s"]) / lease_s for f in fs),
                         default=0.0), 2)

    def taken_up(fs: list[dict]) -> float:
        return round(max((f["taken_up_again_s"] / lease_s for f in fs), default=0.0), 2)
    return {
        "faults_injected": len(faults),
        "kills": len(kills),
        "kills_by_daemon": dict(Counter(f"{f['kind']} {f['target']}" for f in kills)),
        "faults": len(faults),
        "faults_by_kind": dict(Counter(f["kind"] for f in faults)),
        "replays": len(replays),
        "replays_aborted": sum(1 for r in replays if r["aborted"]),
        "requests": sum(r["rounds"] for r in replays),
        "requests_lost": sum(r["lost"] for r in replays),
        "requests_duplicated": sum(r["duplicated"] for r in replays),
        "bytes_mismatched": sum(r["bytes_mismatched"] for r in replays),
        "requests_failed": sum(r["failed"] for r in replays),
        "requests_stuck": sum(r["stuck"] for r in replays),
        "idle_invariant_violations": sum(bool(r["idle_violations"]) for r in replays),
        "unhandled_errors": len(unhandled),
        "reexecutions": sum(r["reexecutions"] for r in replays),
        "max_failed_attempts": max((r["max_failed_attempts"] for r in replays), default=0),
        # Per episode (faults whose spans overlap, chained), from its last fault's end
        # until every round any of them met had finished: how long the cluster takes to
        # be whole again once the faults stop. A partition or freeze lasts 1.5-3 leases
        # by construction, and nothing on the cut-off node can finish meanwhile.
        "episodes": len(eps),
        "max_recovery_leases": round(max((e["recovery_s"] for e in eps), default=0.0)
                                     / lease_s, 2),
        "max_taken_up_again_leases_after_episode": round(max(
            (e["taken_up_again_s"] for e in eps), default=0.0) / lease_s, 2),
        "max_episode_faults": max((len(e["faults"]) for e in eps), default=0),
        # From each fault's strike (the fault itself and whatever struck after it within
        # its recovery included).
        "max_recovery_leases_from_strike": round(max(rec, default=0.0), 2),
        # From the restarted scheduler's start (a scheduler fault's fault_s is the kill
        # or stop plus our restart of the process, ~1 s): the scheduler's own recovery.
        "max_recovery_leases_after_scheduler_restart": after_fault(
            [f for f in faults if f["target"] == "scheduler"]),
        "median_recovery_leases": round(statistics.median(rec), 2) if rec else 0.0,
        # From the fault's end (a freeze's SIGCONT, a restart): with one prefill node no
        # prefill runs while it is frozen, so recovery from the strike includes the freeze.
        "max_recovery_leases_after_fault": after_fault(faults),
        # From the fault's end until every round it met was taken up by a prefill node
        # again (its final attempt): the cluster's recovery without the service time of
        # the round it runs again (a round of this trace takes 1-2 leases by itself).
        "max_taken_up_again_leases": taken_up(faults),
        # The same two for the faults no other fault's span overlapped (the soak strikes
        # the next fault 0.2-1.5 s after one ended, mostly within its recovery: those
        # figures add up several faults).
        "isolated_faults": len(alone),
        "max_recovery_leases_isolated_after_fault": after_fault(alone),
        "max_taken_up_again_leases_isolated": taken_up(alone),
        "max_affected_service_vs_calm": round(max(
            (f["service_vs_calm"] for f in faults), default=0.0), 2),
        "lease_ms": args.lease_ms,
        "wall_s": round(wall_s, 1),
    }


def table(replays: list[dict], summary: dict) -> str:
    by: dict[str, list[dict]] = defaultdict(list)
    for r in replays:
        for f in r["faults"]:
            by[f"{f['kind']} {f['target']}"].append(f)
    lines = ["recovery from the strike, per fault kind:",
             (f"{'fault':<20} {'count':>5} {'fault_s':>8} {'recovery_s max':>14} "
              f"{'leases max':>10} {'leases median':>13}")]
    for name in sorted(by):
        fs = by[name]
        leases = [f["recovery_leases"] for f in fs]
        lines.append(f"{name:<20} {len(fs):>5} "
                     f"{statistics.mean(f['fault_s'] for f in fs):>8.2f} "
                     f"{max(f['recovery_s'] for f in fs):>14.2f} {max(leases):>10.2f} "
                     f"{statistics.median(leases):>13.2f}")
    s = summary
    lines += ["",
              (f"kills {s['kills']}  faults {s['faults']}  replays {s['replays']} "
              f"(aborted {s['replays_aborted']})  requests {s['requests']}"),
              (f"requests_lost {s['requests_lost']}  requests_duplicated "
              f"{s['requests_duplicated']}  bytes_mismatched {s['bytes_mismatched']}  "
              f"requests_failed {s['requests_failed']}  max_failed_attempts "
              f"{s['max_failed_attempts']}"),
              (f"requests_stuck {s['requests_stuck']}  idle_invariant_violations "
               f"{s['idle_invariant_violations']}  unhandled_errors {s['unhandled_errors']}"),
              (f"episodes {s['episodes']} (at most {s['max_episode_faults']} faults): "
               f"max_recovery_leases {s['max_recovery_leases']} from the last fault's end  "
               f"(lease {s['lease_ms']} ms)  wall {s['wall_s']} s"),
              (f"max_taken_up_again_leases_after_episode "
               f"{s['max_taken_up_again_leases_after_episode']}  "
               f"max_recovery_leases_from_strike {s['max_recovery_leases_from_strike']} "
               f"(median {s['median_recovery_leases']})"),
              ("max_recovery_leases_after_scheduler_restart "
               f"{s['max_recovery_leases_after_scheduler_restart']}  "
               f"max_recovery_leases_after_fault {s['max_recovery_leases_after_fault']}"),
              (f"max_taken_up_again_leases {s['max_taken_up_again_leases']}  "
               f"max_affected_service_vs_calm {s['max_affected_service_vs_calm']}"),
              (f"isolated faults {s['isolated_faults']}: max_recovery_leases_isolated_after_"
               f"fault {s['max_recovery_leases_isolated_after_fault']}  "
               f"max_taken_up_again_leases_isolated "
               f"{s['max_taken_up_again_leases_isolated']}")]
    return "\n".join(lines)


def _cluster(args, nets: Namespaces | None) -> LocalCluster:
    if nets is None:
        return LocalCluster(1, 2, settings=settings(args.lease_ms), work_dir=args.work_dir)
    return LocalCluster(
        1, 2, settings=settings(args.lease_ms), work_dir=args.work_dir, host=nets.bridge_ip,
        node_settings={n: {"engine": {"control_listen": f"{nets.ip[n]}:0",
                                      "metrics_listen": f"{nets.ip[n]}:0"},
                           "transfer": {"tcp_listen": nets.ip[n]}} for n in NODES},
        tls_ips=tuple(nets.ip.values()),
        node_launchers={n: nets.launcher(n) for n in NODES})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=50, help="kills to strike (SIGKILL/SIGTERM)")
    ap.add_argument("--faults", type=int, default=50, help="faults of any kind to strike "
                    "in all (at least --kills)")
    ap.add_argument("--quick", action="store_true", help="6 kills on a smaller trace")
    ap.add_argument("--agents", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--context-scale", type=float, default=0.1)
    ap.add_argument("--lease-ms", type=int, default=1000)
    ap.add_argument("--gap-min-s", type=float, default=0.2)
    ap.add_argument("--gap-max-s", type=float, default=1.5)
    ap.add_argument("--replay-timeout-s", type=float, default=300.0)
    ap.add_argument("--faults-per-replay", type=int, default=5,
                    help="at most this many faults strike one replay; then it finishes")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--netns", action="store_true", help="each node in a network namespace "
                    "of its own (needs root and iproute2), and partitions among the faults")
    ap.add_argument("--work-dir", default="", help="keep the cluster's logs here")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    if args.json:      # before the run, not after it: a missing folder is made
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    if args.quick:
        args.kills, args.agents, args.rounds = min(args.kills, 6), 6, 4
        args.faults = min(args.faults, 10)
    rng = random.Random(args.seed)
    replays: list[dict] = []
    t0 = time.monotonic()
    if args.netns and available():
        ap.error(f"--netns: {available()}")
    nets = Namespaces(list(NODES)) if args.netns else None
    try:
        cluster = _cluster(args, nets)
    except BaseException:
        if nets is not None:
            nets.close()
        raise
    with contextlib.ExitStack() as stack:
        if nets is not None:
            stack.callback(nets.close)
        stack.enter_context(cluster)
        kills = 0
        while kills < args.kills or sum(len(r["faults"]) for r in replays) < args.faults:
            r = one_replay(cluster, args, rng, len(replays), args.kills - kills, nets)
            replays.append(r)
            kills += sum(f["kind"] in ("sigkill", "sigterm") for f in r["faults"])
            print(f"replay {len(replays)}: {r['finished']}/{r['rounds']} rounds, "
                  f"{len(r['faults'])} faults ({kills}/{args.kills} kills), lost "
                  f"{r['lost']}, duplicated {r['duplicated']}, wrong bytes "
                  f"{r['bytes_mismatched']}, idle invariant "
                  f"{'; '.join(r['idle_violations']) or 'holds'}"
                  f"{', ABORTED: ' + r['aborted'] if r['aborted'] else ''}",
                  file=sys.stderr, flush=True)
        unhandled = unhandled_errors(cluster.dir / "logs")
    summary = summarize(replays, time.monotonic() - t0, args, unhandled)
    print(table(replays, summary))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"summary": summary, "replays": replays, "unhandled": unhandled}, fh,
                  indent=1)
    bad = (summary["requests_lost"] or summary["requests_duplicated"]
           or summary["bytes_mismatched"] or summary["requests_stuck"]
           or summary["idle_invariant_violations"])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
