"""Scheduler throughput and fetch latency at the paper's largest scale.

Method. A synthetic cluster (dualpath.scheduler.sim) of 48 PE nodes and 96 DE nodes with
8 engines each — 1,152 engines in 144 groups, one group per node, as in Table 3's 48P96D
run — fetches continuously while a submitter keeps a backlog of requests waiting, so
the scheduler never idles for lack of work. Requests are agentic turns shaped like the
paper's 64K trace (prompt 1K-64K tokens, 100-800 new, 64-288 generated); the model is
DS 660B (dualpath.kv.profiles "ds660b"). Simulated engines drain work ``--speedup`` times
faster than the profile's estimates (default 20: with real rates, 1,152 GPUs finish only
~3,300 of these requests per second, and a fetch would carry one or two of them).
α and β scale with the speedup, so the policy sees the same pressure as at 1x.

A request counts as *scheduled* when a PE leader receives its complete assignment (PE,
DE, read side): it has then passed submission, the DE group phase, the in-group phase
and the PE fetch. Completions flow back too (PREFILL_DONE, DECODE_DONE).

* core: one thread drives the pure Scheduler directly; every leader fetches once per
  round (``--dt`` simulated seconds), leaders in a new random order each round.
  Requests/s = requests scheduled / CPU time of this thread inside scheduler calls
  (submit, fetch, report) after ``--warmup`` rounds (the wall-clock rate is recorded too;
  on a shared host it also counts time given to other processes); fetch latency
  = one core ``fetch`` call.
* grpc: ``dualpath scheduler`` runs as its own process on 127.0.0.1 (uvloop, grpc.aio,
  plaintext); one client process (uvloop) runs the 144 leaders — each fetches every
  ``--fetch-interval-ms`` (start times staggered), reports completions, and absorbs
  assignments — and the submitter (batches of up to 1,000 per SubmitRequest). Requests/s
  = requests scheduled / window; fetch latency = client-side Fetch round trip. Server
  CPU is read from /proc over the window (cores used by the scheduler process).

Prints a fixed table and, with ``--json PATH``, the same record with a top-level
``summary`` {core_requests_per_s, grpc_requests_per_s, grpc_fetch_p99_ms}.
Targets (issue 5): core >= 50,000 requests/s on one core; gRPC >= 5,000 requests/s with
p99 fetch <= 10 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dualpath._version import __version__
from dualpath.kv.profiles import get_profile
from dualpath.scheduler.core import Params, Role, Scheduler, policy
from dualpath.scheduler.sim import SimAssignment, SimCluster

READ_BYTES_PER_S = 50e9  # one 400 Gbps storage NIC per node (paper §7)


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(q / 100 * len(s)))]


def scaled_thresholds(profile, speedup: float) -> tuple[int, int]:
    """α and β (paper A.4) for engines ``speedup`` times faster than the profile."""
    alpha = policy.derive_alpha(READ_BYTES_PER_S * speedup, profile.kv_bytes_per_token)
    beta = int(policy.derive_beta(profile) * speedup)
    return alpha, beta


# ---------------------------------------------------------------- core alone


def run_core(args) -> dict:
    profile = get_profile(args.model)
    cl = SimCluster(profile, args.pe_nodes, args.de_nodes, args.engines_per_node,
                    READ_BYTES_PER_S, args.speedup, seed=args.seed)
    alpha, beta = scaled_thresholds(profile, args.speedup)
    s = Scheduler(Params(alpha_tokens=alpha, beta_tokens=beta, lease_s=1e9,
                         default_read_tokens_per_s=cl.read_tokens_per_s,
                         split_read=args.split_read))
    for g in cl.groups:
        g.lease_id = s.register_group(g.group_id, g.role, g.specs(), 0.0).lease_id
    perf, cpu = time.perf_counter, time.thread_time
    busy = busy_cpu = 0.0
    scheduled = fetches = 0
    lat: list[float] = []
    order = list(cl.groups)
    for rnd in range(args.warmup + args.rounds):
        if rnd == args.warmup:
            busy, busy_cpu, scheduled, fetches, lat = 0.0, 0.0, 0, 0, []
        cl.now += args.dt
        need = args.backlog - s.queued_requests()
        specs = cl.new_requests(need) if need > 0 else []
        c0, t0 = cpu(), perf()
        s.submit(specs)
        busy += perf() - t0
        busy_cpu += cpu() - c0
        cl.rng.shuffle(order)  # leaders' timers are independent: the order changes
        for g in order:
            done = cl.step(g, args.dt)
            reports = g.reports()
            c0, t0 = cpu(), perf()
            if done:
                s.report(g.group_id, g.lease_id, done, cl.now)
            t1 = perf()
            res = s.fetch(g.group_id, g.lease_id, reports, cl.now)
            t2 = perf()
            busy_cpu += cpu() - c0
            busy += t2 - t0
            lat.append(t2 - t1)
            fetches += 1
            if g.role is Role.PREFILL:
                scheduled += len(res.assignments)
            cl.absorb_requests(g, res.assignments)
    sides = {k.name.lower(): v for k, v in s.counters.by_read_side.items()}
    return {
        "requests_scheduled": scheduled, "fetches": fetches,
        "scheduler_cpu_s": busy_cpu, "scheduler_wall_s": busy,
        # Per second of the scheduler thread's CPU ("on one core"); the wall-clock figure
        # also counts time the host gave to other processes mid-call.
        "requests_per_s": scheduled / busy_cpu if busy_cpu else 0.0,
        "requests_per_wall_s": scheduled / busy if busy else 0.0,
        "fetches_per_s": fetches / busy_cpu if busy_cpu else 0.0,
        "fetch_p50_ms": 1e3 * percentile(lat, 50), "fetch_p99_ms": 1e3 * percentile(lat, 99),
        "requests_per_pe_fetch": scheduled / (fetches * args.pe_nodes
                                              / (args.pe_nodes + args.de_nodes)),
        "completed": s.counters.completed, "read_sides_total": sides,
        "alpha_tokens": alpha, "beta_tokens": beta,
    }


# ---------------------------------------------------------------- through gRPC


def start_daemon(args, profile, tmp: Path) -> tuple[subprocess.Popen, str, str]:
    alpha, beta = scaled_thresholds(profile, args.grpc_speedup)
    cfg = tmp / "scheduler.toml"
    cfg.write_text(
        "[scheduler]\n"
        f'model_profile = "{args.model}"\n'
        f"alpha_tokens = {alpha}\nbeta_tokens = {beta}\n"
        f"storage_read_bytes_per_s = {READ_BYTES_PER_S * args.grpc_speedup}\n"
        f"split_read = {'true' if args.split_read else 'false'}\n"
        "lease_ms = 60000\nmax_queued_requests = 10000000\n"
        'metrics_listen = "127.0.0.1:0"\n')
    proc = subprocess.Popen([sys.executable, "-m", "dualpath.cli", "--log-level", "INFO",
                             "scheduler", "--config", str(cfg), "--listen", "127.0.0.1:0"],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    assert proc.stderr is not None
    metrics_url = ""
    for line in proc.stderr:
        m = re.search(r"metrics: serving (http://\S+)", line)
        metrics_url = m.group(1) if m else metrics_url
        m = re.search(r"listening on (127\.0\.0\.1:\d+)", line)
        if m:
            # Keep draining the daemon's log so it never blocks on a full pipe.
            threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
            return proc, m.group(1), metrics_url
    raise RuntimeError(f"scheduler daemon exited with {proc.wait()}")


def daemon_histograms(url: str) -> dict[str, dict[float, float]]:
    """Cumulative bucket counts of the daemon's fetch-duration (both roles summed) and
    event-loop-lag histograms."""
    text = urllib.request.urlopen(url, timeout=30).read().decode()
    out: dict[str, dict[float, float]] = {"fetch": {}, "lag": {}}
    for key, name in (("fetch", "fetch_duration"), ("lag", "event_loop_lag")):
        for m in re.finditer(rf'dualpath_scheduler_{name}_seconds_bucket\{{le="([^"]+)"'
                             r'[^}]*\} (\S+)', text):
            le = float(m.group(1))
            out[key][le] = out[key].get(le, 0.0) + float(m.group(2))
    return out


def histogram_quantile(before: dict[float, float], after: dict[float, float],
                       q: float) -> float:
    """Upper bound (s) of the bucket holding the q-th percentile of the window."""
    les = sorted(after)
    counts = [after[le] - before.get(le, 0.0) for le in les]
    total = counts[-1]
    for le, c in zip(les, counts, strict=True):
        if total and c >= q / 100 * total:
            return le
    return float("nan")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def grpc_clients(args, profile, addr: str, pid: int, metrics_url: str) -> dict:
    from dualpath.scheduler.client import SchedulerClient
    from dualpath.v1 import scheduler_pb2 as pb

    cl = SimCluster(profile, args.pe_nodes, args.de_nodes, args.engines_per_node,
                    READ_BYTES_PER_S, args.grpc_speedup, seed=args.seed)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    client = SchedulerClient(addr, timeout_s=30)
    kvb = profile.kv_bytes_per_token
    for g in cl.groups:
        info = [pb.EngineInfo(engine_id=s.engine_id, rank=s.rank, node_id=s.node_id,
                              hbm_bytes=s.hbm_tokens * kvb) for s in g.specs()]
        role = pb.ENGINE_ROLE_PREFILL if g.role is Role.PREFILL else pb.ENGINE_ROLE_DECODE
        g.lease_id = (await client.register_group(g.group_id, role, info)).lease_id
    interval = args.fetch_interval_ms / 1000
    state = {"measuring": False, "stop": False, "queued": 0}
    lat: dict[str, list[float]] = {"prefill": [], "decode": []}
    scheduled = [0]

    async def leader(g, offset: float):
        await asyncio.sleep(offset)
        last = loop.time()
        role = "prefill" if g.role is Role.PREFILL else "decode"
        while not state["stop"]:
            start = loop.time()
            cl.now = start - t0
            done = cl.step(g, start - last)
            last = start
            completions = [pb.Completion(request_id=c.request_id, engine_id=c.engine_id,
                                         stage=int(c.stage)) for c in done]
            statuses = [pb.EngineStatus(engine_id=r.engine_id, unfinished_requests=r.seq,
                                        unfinished_tokens=r.tok, read_queue_tokens=r.read_q,
                                        free_hbm_bytes=r.free_hbm_tokens * kvb)
                        for r in g.reports()]
            f0 = time.perf_counter()
            resp = await client.fetch(g.group_id, g.lease_id, statuses,
                                      completions=completions)
            f1 = time.perf_counter()
            if resp.cancelled_request_ids:
                cl.drop(list(resp.cancelled_request_ids))
            if g.role is Role.PREFILL:
                cl.absorb(g, [SimAssignment(a.request_id, a.prefill_engine_id,
                                            a.prompt_tokens, a.prompt_tokens + a.max_new_tokens,
                                            a.prefill_read_tokens, a.decode_read_tokens,
                                            a.decode_engine_id) for a in resp.assignments])
            else:
                cl.absorb(g, [SimAssignment(a.request_id, a.decode_engine_id, a.prompt_tokens,
                                            a.prompt_tokens + a.max_new_tokens)
                              for a in resp.assignments])
            if state["measuring"]:
                lat[role].append(f1 - f0)
                if g.role is Role.PREFILL:
                    scheduled[0] += len(resp.assignments)
            await asyncio.sleep(max(0.0, interval - (loop.time() - start)))

    async def submitter():
        """Open loop: ``--grpc-rate`` requests per second, sent every 10 ms in one batch."""
        begin = loop.time()
        sent = 0
        while not state["stop"]:
            due = min(int((loop.time() - begin) * args.grpc_rate) - sent, 5000)
            if due > 0:
                specs = [pb.RequestSpec(request_id=s.request_id, prompt_tokens=s.prompt_tokens,
                                        hit_tokens=s.hit_tokens,
                                        max_new_tokens=s.max_new_tokens)
                         for s in cl.new_requests(due)]
                state["queued"] = (await client.submit(specs)).queued_requests
                sent += due
            await asyncio.sleep(0.01)

    n = len(cl.groups)
    tasks = [loop.create_task(leader(g, interval * i / n)) for i, g in enumerate(cl.groups)]
    tasks.append(loop.create_task(submitter()))
    await asyncio.sleep(args.grpc_warmup_s)
    state["measuring"] = True
    floor = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--probe", addr, "--grpc-seconds", str(args.grpc_seconds),
        stdout=asyncio.subprocess.PIPE)
    h0 = await asyncio.to_thread(daemon_histograms, metrics_url)
    lag: list[float] = []

    async def lag_monitor():
        # The client's own event-loop lag: time a leader's answer could wait in this
        # process before the leader sees it.
        while not state["stop"]:
            t = loop.time()
            await asyncio.sleep(0.01)
            lag.append(max(0.0, loop.time() - t - 0.01))

    lag_task = loop.create_task(lag_monitor())
    c0, w0, k0 = cpu_seconds(pid), loop.time(), time.process_time()
    await asyncio.sleep(args.grpc_seconds)
    state["measuring"] = False
    c1, w1, k1 = cpu_seconds(pid), loop.time(), time.process_time()
    h1 = await asyncio.to_thread(daemon_histograms, metrics_url)
    state["stop"] = True
    await asyncio.gather(*tasks, lag_task)
    floor_out, _ = await floor.communicate()
    health = json.loads(floor_out)
    await client.close()
    window = w1 - w0
    both = lat["prefill"] + lat["decode"]
    return {
        "requests_scheduled": scheduled[0], "window_s": window,
        "requests_per_s": scheduled[0] / window,
        "fetches_per_s": len(both) / window,
        "fetch_p50_ms": 1e3 * percentile(both, 50), "fetch_p99_ms": 1e3 * percentile(both, 99),
        "prefill_fetch_p99_ms": 1e3 * percentile(lat["prefill"], 99),
        "decode_fetch_p99_ms": 1e3 * percentile(lat["decode"], 99),
        "server_fetch_p50_ms_le": 1e3 * histogram_quantile(h0["fetch"], h1["fetch"], 50),
        "server_fetch_p99_ms_le": 1e3 * histogram_quantile(h0["fetch"], h1["fetch"], 99),
        "server_loop_lag_p99_ms_le": 1e3 * histogram_quantile(h0["lag"], h1["lag"], 99),
        "client_loop_lag_p99_ms": 1e3 * percentile(lag, 99),
        "health_rtt_p50_ms": health["p50_ms"], "health_rtt_p99_ms": health["p99_ms"],
        "server_cpu_cores": (c1 - c0) / window,
        "client_cpu_cores": (k1 - k0) / window,
        "speedup": args.grpc_speedup,
        "fetch_interval_ms": args.fetch_interval_ms,
        "offered_requests_per_s": args.grpc_rate,
        "queued_at_end": state["queued"],
    }


async def probe(addr: str, seconds: float) -> dict:
    """The floor: round trips of a trivial call (gRPC health) from a process of its own,
    one every 10 ms, against the same daemon under the same load."""
    from dualpath.scheduler.client import SchedulerClient

    lat = []
    async with SchedulerClient(addr, timeout_s=30) as c:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            t = time.perf_counter()
            await c.health()
            lat.append(time.perf_counter() - t)
            await asyncio.sleep(0.01)
    return {"calls": len(lat), "p50_ms": 1e3 * percentile(lat, 50),
            "p99_ms": 1e3 * percentile(lat, 99)}


def run_grpc(args) -> dict:
    import uvloop

    profile = get_profile(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        proc, addr, metrics_url = start_daemon(args, profile, Path(tmp))
        try:
            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                return runner.run(grpc_clients(args, profile, addr, proc.pid, metrics_url))
        finally:
            proc.terminate()
            proc.wait(timeout=30)


# ---------------------------------------------------------------- report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="ds660b")
    p.add_argument("--pe-nodes", type=int, default=48)
    p.add_argument("--de-nodes", type=int, default=96)
    p.add_argument("--engines-per-node", type=int, default=8)
    p.add_argument("--speedup", type=float, default=20.0, help="core: engine speed factor")
    p.add_argument("--grpc-rate", type=float, default=6000.0,
                   help="grpc: requests submitted per second (open loop)")
    p.add_argument("--grpc-speedup", type=float, default=20.0,
                   help="grpc: engine speed factor (engines must keep up with the rate)")
    p.add_argument("--backlog", type=int, default=20_000, help="requests kept waiting")
    p.add_argument("--split-read", action="store_true")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--dt", type=float, default=0.02, help="core: simulated s per round")
    p.add_argument("--warmup", type=int, default=50, help="core: rounds not measured")
    p.add_argument("--rounds", type=int, default=250, help="core: rounds measured")
    p.add_argument("--fetch-interval-ms", type=float, default=100.0,
                   help="grpc: period of each leader's fetch")
    p.add_argument("--grpc-warmup-s", type=float, default=3.0)
    p.add_argument("--grpc-seconds", type=float, default=10.0)
    p.add_argument("--skip-grpc", action="store_true")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--probe", metavar="ADDR", help=argparse.SUPPRESS)  # internal: the floor
    args = p.parse_args(argv)
    if args.probe:
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            print(json.dumps(runner.run(probe(args.probe, args.grpc_seconds))))
        return 0

    load_before = os.getloadavg()[0]
    core = run_core(args)
    grpc_res = None if args.skip_grpc else run_grpc(args)
    load_after = os.getloadavg()[0]
    engines = (args.pe_nodes + args.de_nodes) * args.engines_per_node
    record = {
        "bench": "scheduler", "version": __version__, "host": platform.node(),
        "cpus": os.cpu_count(), "python": platform.python_version(),
        # The host's 1-minute load average: other work on the machine inflates latencies.
        "loadavg_1min": [load_before, load_after],
        "config": {k: v for k, v in vars(args).items() if k != "json"},
        "engines": engines, "groups": args.pe_nodes + args.de_nodes,
        "core": core, "grpc": grpc_res,
        "summary": {
            "core_requests_per_s": round(core["requests_per_s"]),
            "grpc_requests_per_s": round(grpc_res["requests_per_s"]) if grpc_res else None,
            "grpc_fetch_p99_ms": round(grpc_res["fetch_p99_ms"], 3) if grpc_res else None,
        },
    }
    print(f"scheduler bench: {args.pe_nodes}P{args.de_nodes}D x {args.engines_per_node} = "
          f"{engines} engines in {record['groups']} groups, model {args.model}, speedup "
          f"{args.speedup:g}, backlog {args.backlog}")
    print(f"{'path':<6} {'req/s':>10} {'fetch/s':>9} {'fetch p50 ms':>13} "
          f"{'fetch p99 ms':>13} {'server cores':>13}")
    rows = [("core", core, float("nan"))]
    if grpc_res:
        rows.append(("grpc", grpc_res, grpc_res["server_cpu_cores"]))
    for name, r, cores in rows:
        print(f"{name:<6} {r['requests_per_s']:>10.0f} {r['fetches_per_s']:>9.0f} "
              f"{r['fetch_p50_ms']:>13.3f} {r['fetch_p99_ms']:>13.3f} {cores:>13.2f}")
    if grpc_res:
        print(f"grpc: offered {args.grpc_rate:.0f} req/s, fetch every "
              f"{args.fetch_interval_ms:g} ms per group; server-side fetch p50 <= "
              f"{grpc_res['server_fetch_p50_ms_le']:g} ms, p99 <= "
              f"{grpc_res['server_fetch_p99_ms_le']:g} ms; client process "
              f"{grpc_res['client_cpu_cores']:.2f} cores; host load "
              f"{load_before:.1f} -> {load_after:.1f}")
        print(f"floor: a trivial call (health) from its own process, same daemon, same time: "
              f"p50 {grpc_res['health_rtt_p50_ms']:.3f} ms, p99 "
              f"{grpc_res['health_rtt_p99_ms']:.3f} ms; event-loop lag p99: daemon <= "
              f"{grpc_res['server_loop_lag_p99_ms_le']:g} ms, client "
              f"{grpc_res['client_loop_lag_p99_ms']:.1f} ms")
    print("summary: " + json.dumps(record["summary"]))
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
