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
  plaintext; ``tls`` below compares it with mutual TLS). The 144 leaders run in
  ``--workers`` spawned processes (uvloop; default 1, see below), each with its own
  channel and TCP connection as leaders on their own hosts have (``--channels N``
  shares N per process instead; measured: one connection shared by all 144 schedules
  only ~5,800 of the 6,000 requests/s offered, its queue growing, cause not found),
  each leader on its own fixed timer grid: it fetches every
  ``--fetch-interval-ms`` (100 ms, as deploy/scheduler.toml), the 144 grids staggered
  evenly, a late wake-up skipping to the next slot instead of shifting its phase (else
  one pause synchronises the groups into bursts that last the whole run). Each fetch
  carries the group's completions; a PE's PREFILL_DONE for a DE run by another worker
  travels over a pipe, as a real PE tells its DE. The coordinating process submits
  ``--grpc-rate`` requests/s (open loop, one SubmitRequest every 10 ms). The daemon and
  the leader processes freeze their start-up objects out of the garbage collector and
  run full collections a tenth as often (``service.tune_gc``). Requests/s = requests
  scheduled / window. Fetch latency = the leader's own clock around its awaited Fetch
  call (``time.monotonic`` before the call, after the await returns): what a leader
  observes, including any wait in its own event loop; beside it the daemon's own
  fetch-duration histogram (server-side), the event-loop lag of the daemon and of the
  leader processes, a trivial call's round trip from a separate process (the floor),
  and the CPU of every process over the window from /proc, including
  ``host_other_cpu_cores``: what the rest of the machine ran meanwhile (on a shared
  2-core host that, not the scheduler, decides the tail). The daemon's histograms are
  scraped just outside the window (rendering /metrics pauses the daemon for a few ms).
  More leader processes do not help on 2 cores: they take CPU shares from the daemon
  (measured: 2 workers, p99 82-102 ms against 5-20 ms for 1 at the same load).

* saturated (the cost of durability, issue 12): the gRPC set-up ``--sat-reps`` times
  (default 3) without and as many times with the daemon's journal (``journal_file``,
  SQLite WAL, ``journal_sync = "normal"``, group commit on the journal's writer thread:
  every submission and every completion on disk before the answer) in ONE run,
  alternated as the TLS comparison below (plain first in even repetitions, journal
  first in odd ones; a fresh daemon each), because what the rest of a shared host runs
  drifts by tenths of a core between two back-to-back windows, and on 2 cores that alone
  moves a single pair's ratio by ~20 %. The submitter is closed-loop (the next
  SubmitRequest of 500 as soon as the last is answered, while fewer than ``--backlog``
  wait) and the engines fast enough (``--sat-speedup``, each group fetching every
  ``--sat-fetch-interval-ms``) that the daemon, not the simulated cluster, limits the
  rate. Requests/s = requests scheduled (reached a PE) / window; CPU per request = the
  daemon's CPU over the window (all its threads) / those requests; beside them the
  journal's transactions per second and RPCs per transaction (from the daemon's
  /metrics). ``saturated_requests_per_s_journal_over_plain`` is the ratio of the two
  sides' median rates (target >= 0.8: durable submission costs at most 20 %).

* tls (the cost of mutual TLS, issue 11): the gRPC set-up above (same engines, grids and
  seeds; offered rate ``--tls-rate`` and fetch period ``--tls-fetch-interval-ms``, 1,500
  requests/s and 200 ms by default: with the 144 leaders and the daemon on one 2-core
  host, the gRPC set-up's own 6,000/s and 100 ms keep the host saturated, so its p99 is
  the queue of a full host, which moves by 2-3x between repetitions of one side and
  grows with any extra CPU work; below saturation the p99 is the calls' own latency,
  which is what TLS adds to) ``--tls-reps`` times with mutual TLS and as many
  times in plaintext, in ONE run, alternated: repetition k runs both sides, plain first
  when k is even and TLS first when it is odd (plain, TLS, TLS, plain, ...), each a fresh
  daemon, ``--grpc-warmup-s`` then a ``--tls-seconds`` window. Only the ``[tls]`` of the
  daemon and of its clients differs. One throw-away PKI (``dualpath.tls
  .make_cluster_pki``, made before the first repetition and outside every window): a
  node certificate per group named after its group id (spiffe://dualpath/node/<group
  id>), as a real leader presents its node's, since the scheduler binds each group to
  the identity that registered it — the scheduler would let one identity register every
  group, but no cluster runs that way, and the per-connection handshakes fall before the
  window either way; a ``scheduler`` certificate for the daemon and one ``client``
  certificate for the submitter and both health probes. Each leader keeps its own
  connection (``--channels`` is refused: a shared one would present one identity for
  several groups). Over TLS the daemon reads each call's peer identity for its ownership
  check, as deployed. Per repetition: the leaders' Fetch p99 (as above), the daemon's
  CPU-seconds over the window / fetches begun in it (shown in us; the daemon also
  served the window's submissions and health calls, the same on both sides), the same
  for the leader process. ``grpc_fetch_p99_tls_over_plain`` = median over the TLS
  repetitions of their p99 / the same median over the plain ones (target <= 1.10). The
  144 leaders share one process on this host, so their client-side TLS work competes
  with the daemon for the same cores, which real leaders on their own hosts do not.

Prints a fixed table and, with ``--json PATH``, the same record with a top-level
``summary`` {core_requests_per_s, grpc_requests_per_s, grpc_fetch_p99_ms, and beside
them grpc_fetch_p50_ms, grpc_server_fetch_p99_ms_le, grpc_host_other_cpu_cores,
saturated_requests_per_s_journal_over_plain, saturated_server_us_per_request_{plain,
journal}, grpc_fetch_p99_tls_over_plain, and beside it grpc_fetch_p99_ms_{tls,plain},
grpc_server_cpu_us_per_fetch_{tls,plain} (medians) and grpc_tls_repetitions}. Targets
(issue 5): core >= 50,000 requests/s on one core; gRPC >= 5,000 requests/s with p99
fetch <= 10 ms; (issue 12) journal over plain >= 0.8; (issue 11) TLS over plain <= 1.10.
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
from dualpath.scheduler.service import tune_gc
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
                         split_read=args.split_read,
                         # In process the whole backlog is one call (no reply to fit).
                         max_submit_requests=max(4096, args.backlog)))
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


def tls_section(pki, identity: str) -> str:
    """The daemon's [tls] table: mutual TLS as ``identity`` of ``pki``, or plaintext
    (``pki`` None)."""
    if pki is None:
        return "[tls]\nplaintext = true\n"
    return "[tls]\n" + "".join(f"{k} = {json.dumps(v)}\n"
                               for k, v in pki.section(identity).items())


def scheduler_client(addr: str, pki, identity: str, options=(), tls_config=None):
    """A SchedulerClient as a real one is made: over mutual TLS presenting ``identity``
    of ``pki`` (or the ``tls_config`` given) and checking that the server is the
    scheduler (tls.channel's identity check, as every leader's), or plaintext."""
    from dualpath import rpc, tls
    from dualpath.scheduler.client import SchedulerClient

    cfg = tls_config or (pki.config(identity) if pki is not None else None)
    if cfg is None:
        return SchedulerClient(addr, timeout_s=30, options=options)
    opts = list(options)
    given = {k for k, _ in opts}
    opts += [kv for kv in rpc.CHANNEL_OPTIONS if kv[0] not in given]
    return SchedulerClient(addr, timeout_s=30, channel=tls.channel(
        addr, cfg, opts, expect=cfg.scheduler_identity))


def bench_identities(args) -> list[str]:
    """Every identity a TLS run presents: one node certificate per group, named after
    its group id (the id its leader registers; the scheduler binds the group to it),
    the scheduler's, and one client certificate for the submitter and the probes."""
    cl = SimCluster(get_profile(args.model), args.pe_nodes, args.de_nodes,
                    args.engines_per_node, READ_BYTES_PER_S, args.grpc_speedup, seed=args.seed)
    return [f"node/{g.group_id}" for g in cl.groups] + ["scheduler/scheduler",
                                                          "client/bench"]


def start_daemon(args, profile, tmp: Path) -> tuple[subprocess.Popen, str, str]:
    alpha, beta = scaled_thresholds(profile, args.grpc_speedup)
    cfg = tmp / "scheduler.toml"
    cfg.write_text(
        "[scheduler]\n"
        f'model_profile = "{args.model}"\n'
        f"alpha_tokens = {alpha}\nbeta_tokens = {beta}\n"
        f"storage_read_bytes_per_s = {READ_BYTES_PER_S * args.grpc_speedup}\n"
        f"split_read = {'true' if args.split_read else 'false'}\n"
        "lease_ms = 60000\nmax_queued_requests = 10000000\nmax_held_bytes = 17179869184\n"
        'metrics_listen = "127.0.0.1:0"\n'
        + (f'journal_file = "{tmp / "scheduler.sqlite"}"\n' if args.journal else "")
        + tls_section(args.pki, "scheduler/scheduler"))
    proc = subprocess.Popen([sys.executable, "-m", "dualpath.cli", "--log-level", "INFO",
                             "scheduler", "--config", str(cfg), "--listen", "127.0.0.1:0"],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    assert proc.stderr is not None
    metrics_url = ""
    for line in proc.stderr:
        m = re.search(r"metrics: serving (http://\S+)", line)
        metrics_url = m.group(1) if m else metrics_url
        m = re.search(r"listening on (127\.0\.0\.1:\d+), ([\w-]+)", line)
        if m:
            want = "mutual-tls" if args.pki else "plaintext"
            if m.group(2) != want:  # the comparison is void if a side is not what it says
                proc.terminate()
                raise RuntimeError(f"scheduler daemon serves {m.group(2)}, expected {want}")
            # Keep draining the daemon's log so it never blocks on a full pipe.
            threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
            return proc, m.group(1), metrics_url
    raise RuntimeError(f"scheduler daemon exited with {proc.wait()}")


def daemon_histograms(url: str) -> dict[str, dict[float, float]]:
    """Cumulative bucket counts of the daemon's fetch-duration (both roles summed) and
    event-loop-lag histograms, and its journal's counts ("journal": commits, calls
    committed)."""
    text = urllib.request.urlopen(url, timeout=30).read().decode()
    out: dict[str, dict] = {"fetch": {}, "lag": {}, "journal": {}}
    for key, name in (("fetch", "fetch_duration"), ("lag", "event_loop_lag")):
        for m in re.finditer(rf'dualpath_scheduler_{name}_seconds_bucket\{{le="([^"]+)"'
                             r'[^}]*\} (\S+)', text):
            le = float(m.group(1))
            out[key][le] = out[key].get(le, 0.0) + float(m.group(2))
    for key, name in (("commits", "journal_commit_seconds_count"),
                      ("calls", "journal_calls_total")):
        m = re.search(rf"^dualpath_scheduler_{name} (\S+)$", text, re.MULTILINE)
        out["journal"][key] = float(m.group(1)) if m else 0.0
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


def host_busy_s() -> float:
    """CPU seconds the whole host spent busy (all CPUs, /proc/stat)."""
    vals = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return (sum(vals) - vals[3] - vals[4]) / os.sysconf("SC_CLK_TCK")


def leader_worker(k: int, args, addr: str, ctl, rx: list, tx: dict) -> None:
    """Process ``k`` of ``--workers`` (spawned): the leaders of groups i with
    i % workers == k, each with its simulated engines."""
    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(leaders(k, args, addr, ctl, rx, tx))


async def leaders(k: int, args, addr: str, ctl, rx: list, tx: dict) -> None:
    from dualpath.scheduler.client import SchedulerClient
    from dualpath.v1 import scheduler_pb2 as pb

    profile = get_profile(args.model)
    cl = SimCluster(profile, args.pe_nodes, args.de_nodes, args.engines_per_node,
                    READ_BYTES_PER_S, args.grpc_speedup, seed=args.seed)
    n, workers = len(cl.groups), args.workers
    owner: dict[str, int] = {}
    mine = []
    for i, g in enumerate(cl.groups):
        for e in g.engines:
            owner[e.engine_id] = i % workers
            e.local = i % workers == k
        if i % workers == k:
            mine.append((i, g))
    loop = asyncio.get_running_loop()
    # Each leader has its own channel and TCP connection (a local subchannel pool each),
    # as leaders on separate hosts do; --channels N shares N among this process's
    # (plaintext only). Over mutual TLS each leader presents its own group's node
    # certificate.
    opts = [("grpc.use_local_subchannel_pool", 1)]
    if args.channels:
        clients = [SchedulerClient(addr, timeout_s=30, options=opts)
                   for _ in range(args.channels)]
    else:
        clients = [scheduler_client(addr, args.pki, f"node/{g.group_id}", opts)
                   for _, g in mine]
    kvb = profile.kv_bytes_per_token
    channel = {g.group_id: clients[j % len(clients)] for j, (_, g) in enumerate(mine)}
    for _, g in mine:
        client = channel[g.group_id]
        info = [pb.EngineInfo(engine_id=s.engine_id, rank=s.rank, node_id=s.node_id,
                              hbm_bytes=s.hbm_tokens * kvb) for s in g.specs()]
        role = pb.ENGINE_ROLE_PREFILL if g.role is Role.PREFILL else pb.ENGINE_ROLE_DECODE
        g.lease_id = (await client.register_group(g.group_id, role, info)).lease_id
    tune_gc()
    ctl.send("ready")
    start_at, window_at, window_end = await asyncio.to_thread(ctl.recv)
    stop_at = window_end + 0.3
    mono = time.monotonic

    def on_message(conn) -> None:  # PREFILL_DONE from a PE run by another worker
        cl.now = mono() - start_at
        for rid, engine_id in conn.recv():
            cl.prefill_done(rid, engine_id)

    for conn in rx:
        loop.add_reader(conn.fileno(), on_message, conn)

    def flush() -> None:
        if not cl.outbox:
            return
        if mono() < window_end:  # after it, a peer may stop reading: never block on it
            by: dict[int, list] = {}
            for m in cl.outbox:
                by.setdefault(owner[m[1]], []).append(m)
            for w, msgs in by.items():
                tx[w].send(msgs)
        cl.outbox.clear()

    interval = args.fetch_interval_ms / 1000
    lat: dict[str, list[float]] = {"prefill": [], "decode": []}
    scheduled = [0]

    async def leader(i: int, g) -> None:
        # A leader's timer fires on its own fixed grid (start + i/n x interval + k x
        # interval): a late wake-up does not shift its phase, so the groups stay
        # staggered and never synchronise into bursts after a pause; a missed slot is
        # skipped, not made up.
        due = start_at + interval * i / n
        await asyncio.sleep(max(0.0, due - mono()))
        last = mono()
        role = "prefill" if g.role is Role.PREFILL else "decode"
        client = channel[g.group_id]
        while (start := mono()) < stop_at:
            cl.now = start - start_at
            done = cl.step(g, start - last)
            last = start
            flush()
            completions = [pb.Completion(request_id=c.request_id, engine_id=c.engine_id,
                                         stage=int(c.stage)) for c in done]
            statuses = [pb.EngineStatus(engine_id=r.engine_id, unfinished_requests=r.seq,
                                        unfinished_tokens=r.tok, read_queue_tokens=r.read_q,
                                        free_hbm_bytes=r.free_hbm_tokens * kvb)
                        for r in g.reports()]
            f0 = mono()
            resp = await client.fetch(g.group_id, g.lease_id, statuses,
                                      completions=completions)
            f1 = mono()
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
            if window_at <= f0 < window_end:
                lat[role].append(f1 - f0)
                if g.role is Role.PREFILL:
                    scheduled[0] += len(resp.assignments)
            now = mono()
            due += interval * (max(0, int((now - due) // interval)) + 1)
            await asyncio.sleep(due - now)

    lag: list[float] = []

    async def lag_monitor() -> None:
        # This process's event-loop lag: how late a 10 ms timer runs, i.e. how long an
        # answer that has arrived can wait before its leader sees it.
        await asyncio.sleep(max(0.0, window_at - mono()))
        while (t := mono()) < window_end:
            await asyncio.sleep(0.01)
            lag.append(max(0.0, mono() - t - 0.01))

    health: list[float] = []

    async def health_probe() -> None:
        # The floor again, from inside this process (own connection): when it is slow
        # and the separate process's is not, the delay is this process's, not the daemon's.
        probe_client = scheduler_client(addr, args.pki, "client/bench",
                                        [("grpc.use_local_subchannel_pool", 1)])
        await probe_client.health()
        await asyncio.sleep(max(0.0, window_at - mono()))
        while (t := mono()) < window_end:
            await probe_client.health()
            health.append(mono() - t)
            await asyncio.sleep(0.01)
        await probe_client.close()

    await asyncio.gather(lag_monitor(), health_probe(), *(leader(i, g) for i, g in mine))
    for conn in rx:
        loop.remove_reader(conn.fileno())
    for client in clients:
        await client.close()
    ctl.send({"lat": lat, "scheduled": scheduled[0], "lag": lag, "health": health})


async def coordinate(args, profile, addr: str, pid: int, metrics_url: str,
                     procs: list, ctls: list) -> dict:
    """Wait for the leader processes, start them together, submit requests, and read
    every process's CPU and the daemon's histograms around the window."""
    from dualpath.v1 import scheduler_pb2 as pb

    for c in ctls:
        if await asyncio.to_thread(c.recv) != "ready":
            raise RuntimeError("a leader process failed to start")
    start_at = time.monotonic() + 0.2
    window_at = start_at + args.grpc_warmup_s
    window_end = window_at + args.grpc_seconds
    for c in ctls:
        c.send((start_at, window_at, window_end))
    # The floor probe starts now (its interpreter start-up falls in the warm-up) and
    # measures over the same window.
    floor = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--probe", addr, "--probe-at", str(window_at),
        "--grpc-seconds", str(args.grpc_seconds), "--probe-tls",
        json.dumps(args.pki.section("client/bench") if args.pki else {}),
        stdout=asyncio.subprocess.PIPE)
    cl = SimCluster(profile, args.pe_nodes, args.de_nodes, args.engines_per_node,
                    READ_BYTES_PER_S, args.grpc_speedup, seed=args.seed + 1000)
    state = {"queued": 0}

    async def submitter(client) -> None:
        """Open loop: ``--grpc-rate`` requests per second, sent every 10 ms in one batch.
        Saturated: closed loop, the next batch of 500 once the last one is answered,
        while fewer than ``--backlog`` requests wait."""
        await asyncio.sleep(max(0.0, start_at - time.monotonic()))
        if args.saturate:
            while time.monotonic() < window_end:
                if state["queued"] >= args.backlog:
                    state["queued"] = (await client.submit([])).queued_requests
                    await asyncio.sleep(0.002)
                    continue
                specs = [pb.RequestSpec(request_id=s.request_id,
                                        prompt_tokens=s.prompt_tokens,
                                        hit_tokens=s.hit_tokens,
                                        max_new_tokens=s.max_new_tokens)
                         for s in cl.new_requests(500)]
                state["queued"] = (await client.submit(specs)).queued_requests
            return
        sent = 0
        while (now := time.monotonic()) < window_end:
            due = min(int((now - start_at) * args.grpc_rate) - sent, 4096)  # per-call max
            if due > 0:
                specs = [pb.RequestSpec(request_id=s.request_id, prompt_tokens=s.prompt_tokens,
                                        hit_tokens=s.hit_tokens,
                                        max_new_tokens=s.max_new_tokens)
                         for s in cl.new_requests(due)]
                state["queued"] = (await client.submit(specs)).queued_requests
                sent += due
            await asyncio.sleep(0.01)

    def cpu_now() -> tuple:
        return (time.monotonic(), cpu_seconds(pid), [cpu_seconds(p.pid) for p in procs],
                time.process_time(), cpu_seconds(floor.pid), host_busy_s())

    async with scheduler_client(addr, args.pki, "client/bench") as client:
        sub = asyncio.get_running_loop().create_task(submitter(client))
        await asyncio.sleep(max(0.0, window_at - time.monotonic() - 0.5))
        # Scrape the daemon's histograms outside the window: rendering /metrics holds
        # the daemon's GIL for a few ms, a pause no leader would otherwise see.
        h0 = await asyncio.to_thread(daemon_histograms, metrics_url)
        await asyncio.sleep(max(0.0, window_at - time.monotonic()))
        a = cpu_now()
        await asyncio.sleep(max(0.0, window_end - time.monotonic()))
        b = cpu_now()
        await sub
        await asyncio.sleep(0.3)  # calls of the window finish before the scrape
        h1 = await asyncio.to_thread(daemon_histograms, metrics_url)
    results = [await asyncio.to_thread(c.recv) for c in ctls]
    health = json.loads((await floor.communicate())[0])
    window = b[0] - a[0]
    mine = (b[1] - a[1]) + sum(b[2]) - sum(a[2]) + (b[3] - a[3]) + (b[4] - a[4])
    lat = {r: [x for res in results for x in res["lat"][r]] for r in ("prefill", "decode")}
    both = lat["prefill"] + lat["decode"]
    lag = [x for res in results for x in res["lag"]]
    inner = [x for res in results for x in res["health"]]
    scheduled = sum(res["scheduled"] for res in results)
    return {
        "requests_scheduled": scheduled, "window_s": window,
        "requests_per_s": scheduled / window,
        "fetches_per_s": len(both) / window,
        "fetch_p50_ms": 1e3 * percentile(both, 50), "fetch_p99_ms": 1e3 * percentile(both, 99),
        "fetch_p999_ms": 1e3 * percentile(both, 99.9),
        "fetch_over_10ms_share": sum(1 for x in both if x > 0.010) / max(1, len(both)),
        "prefill_fetch_p99_ms": 1e3 * percentile(lat["prefill"], 99),
        "decode_fetch_p99_ms": 1e3 * percentile(lat["decode"], 99),
        "server_fetch_p50_ms_le": 1e3 * histogram_quantile(h0["fetch"], h1["fetch"], 50),
        "server_fetch_p99_ms_le": 1e3 * histogram_quantile(h0["fetch"], h1["fetch"], 99),
        "server_loop_lag_p99_ms_le": 1e3 * histogram_quantile(h0["lag"], h1["lag"], 99),
        # Group commit (journal on): transactions in the window, RPCs per transaction
        # (the scrapes fall just outside the window: an estimate).
        "journal_commits_per_s":
            (h1["journal"]["commits"] - h0["journal"]["commits"]) / window,
        "journal_calls_per_commit":
            (h1["journal"]["calls"] - h0["journal"]["calls"])
            / max(1.0, h1["journal"]["commits"] - h0["journal"]["commits"]),
        "client_loop_lag_p99_ms": 1e3 * percentile(lag, 99),
        "client_loop_lag_max_ms": 1e3 * max(lag, default=float("nan")),
        "health_rtt_p50_ms": health["p50_ms"], "health_rtt_p99_ms": health["p99_ms"],
        "leader_health_rtt_p50_ms": 1e3 * percentile(inner, 50),
        "leader_health_rtt_p99_ms": 1e3 * percentile(inner, 99),
        "server_cpu_cores": (b[1] - a[1]) / window,
        # The daemon's CPU over the window per fetch begun in it (it also served the
        # window's submissions and health calls: the same load on either side).
        "fetches": len(both),
        "server_cpu_us_per_fetch": 1e6 * (b[1] - a[1]) / len(both) if both else float("nan"),
        "client_cpu_us_per_fetch":
            1e6 * (sum(b[2]) - sum(a[2])) / len(both) if both else float("nan"),
        "client_cpu_cores": (sum(b[2]) - sum(a[2])) / window,
        "submitter_cpu_cores": (b[3] - a[3]) / window,
        # Everything else the host ran meanwhile (other users of the machine).
        "host_other_cpu_cores": max(0.0, (b[5] - a[5]) - mine) / window,
        "tls": "mutual-tls" if args.pki else "plaintext",
        "leader_processes": args.workers,
        "connections": args.channels * args.workers or args.pe_nodes + args.de_nodes,
        "speedup": args.grpc_speedup,
        "fetch_interval_ms": args.fetch_interval_ms,
        "offered_requests_per_s": args.grpc_rate,
        "queued_at_end": state["queued"],
    }


async def probe(addr: str, at: float, seconds: float, tls_section: dict) -> dict:
    """The floor: round trips of a trivial call (gRPC health) from a process of its own,
    one every 10 ms from monotonic time ``at``, against the same daemon under the same
    load (over mutual TLS with the ``tls_section`` files when given)."""
    from dualpath import tls

    cfg = tls.TlsConfig(**tls_section) if tls_section else None
    lat = []
    async with scheduler_client(addr, None, "", tls_config=cfg) as c:
        await c.health()  # connect before the window
        await asyncio.sleep(max(0.0, at - time.monotonic()))
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            t = time.perf_counter()
            await c.health()
            lat.append(time.perf_counter() - t)
            await asyncio.sleep(0.01)
    return {"calls": len(lat), "p50_ms": 1e3 * percentile(lat, 50),
            "p99_ms": 1e3 * percentile(lat, 99)}


def run_saturated(args) -> dict:
    """The gRPC set-up, closed loop, ``--sat-reps`` times without and as many with the
    journal in this run, alternated (:func:`tls_order`: plain first in even repetitions,
    journal first in odd ones); the medians of each side and their ratio."""
    from statistics import median

    runs = []
    for rep, journal in enumerate(tls_order(args.sat_reps)):
        a = argparse.Namespace(**vars(args))
        a.saturate, a.journal = True, journal
        a.grpc_speedup, a.fetch_interval_ms = args.sat_speedup, args.sat_fetch_interval_ms
        a.grpc_seconds = args.sat_seconds
        r = run_grpc(a)
        r["server_us_per_request"] = 1e6 * r["server_cpu_cores"] / r["requests_per_s"] \
            if r["requests_per_s"] else float("nan")
        r["repetition"], r["journal"] = rep // 2, journal
        runs.append(r)
    keys = ("requests_per_s", "server_cpu_cores", "server_us_per_request", "fetch_p99_ms",
            "host_other_cpu_cores", "journal_calls_per_commit", "journal_commits_per_s")
    out: dict = {"repetitions": args.sat_reps, "runs": runs}
    for journal in (False, True):
        mine = [r for r in runs if r["journal"] is journal]
        out["journal" if journal else "plain"] = {k: median(r[k] for r in mine)
                                                  for k in keys}
    out["journal_over_plain"] = out["journal"]["requests_per_s"] / \
        out["plain"]["requests_per_s"] if out["plain"]["requests_per_s"] else float("nan")
    return out


def tls_order(reps: int) -> list[bool]:
    """Which side runs when (True = mutual TLS): ``reps`` pairs, the side that goes first
    alternating from one pair to the next (plain, TLS, TLS, plain, plain, TLS, ...), so
    a drift of the host over the run weighs on both sides alike."""
    return [side for rep in range(reps)
            for side in ((False, True) if rep % 2 == 0 else (True, False))]


def compare_tls(runs: list[dict]) -> dict:
    """The medians of each side over its repetitions and their ratios (TLS / plain):
    Fetch p99 as the leaders see it (the target's figure), p50, and the daemon's and the
    leaders' CPU per fetch."""
    from statistics import median

    out: dict = {"repetitions": sum(1 for r in runs if r["tls"] == "mutual-tls")}
    keys = ("fetch_p99_ms", "fetch_p50_ms", "server_cpu_us_per_fetch",
            "client_cpu_us_per_fetch", "requests_per_s", "host_other_cpu_cores")
    for side in ("plaintext", "mutual-tls"):
        mine = [r for r in runs if r["tls"] == side]
        out["tls" if side == "mutual-tls" else "plain"] = {
            k: median(r[k] for r in mine) if mine else float("nan") for k in keys}
    for k in ("fetch_p99_ms", "fetch_p50_ms", "server_cpu_us_per_fetch",
              "client_cpu_us_per_fetch"):
        plain = out["plain"][k]
        out[f"{k}_tls_over_plain"] = out["tls"][k] / plain if plain else float("nan")
    return out


def run_tls(args) -> dict:
    """The gRPC set-up ``--tls-reps`` times with mutual TLS and as many without, in
    :func:`tls_order`; everything but the [tls] of the daemon and of its clients is the
    same (engines, grids, fetch period, offered rate, seeds). One PKI for the run."""
    from dualpath.tls import make_cluster_pki

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.monotonic()
        pki = make_cluster_pki(Path(tmp) / "pki", bench_identities(args))
        pki_s = time.monotonic() - t0
        runs = []
        for rep, side in enumerate(tls_order(args.tls_reps)):
            a = argparse.Namespace(**vars(args))
            a.pki = pki if side else None
            a.grpc_seconds = args.tls_seconds
            a.grpc_rate, a.fetch_interval_ms = args.tls_rate, args.tls_fetch_interval_ms
            r = run_grpc(a)
            r["repetition"] = rep // 2
            runs.append(r)
    out = compare_tls(runs)
    out.update(runs=runs, pki_s=pki_s, identities=len(pki.certs), rate=args.tls_rate,
               fetch_interval_ms=args.tls_fetch_interval_ms)
    return out


def run_grpc(args) -> dict:
    import multiprocessing

    import uvloop

    profile = get_profile(args.model)
    ctx = multiprocessing.get_context("spawn")
    k_all = range(args.workers)
    rx: dict[int, list] = {k: [] for k in k_all}
    tx: dict[int, dict] = {k: {} for k in k_all}
    for a in k_all:
        for b in k_all:
            if a != b:
                r, w = ctx.Pipe(duplex=False)
                rx[b].append(r)
                tx[a][b] = w
    with tempfile.TemporaryDirectory() as tmp:
        proc, addr, metrics_url = start_daemon(args, profile, Path(tmp))
        procs = []
        try:
            ctls = []
            for k in k_all:
                mine, theirs = ctx.Pipe()
                ctls.append(mine)
                procs.append(ctx.Process(target=leader_worker, daemon=True,
                                         args=(k, args, addr, theirs, rx[k], tx[k])))
                procs[-1].start()
            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                return runner.run(coordinate(args, profile, addr, proc.pid, metrics_url,
                                             procs, ctls))
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.terminate()
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
    p.add_argument("--workers", type=int, default=1,
                   help="grpc: processes the 144 leaders are spread over")
    p.add_argument("--channels", type=int, default=0,
                   help="grpc: connections per leader process (0: one per leader)")
    p.add_argument("--fetch-interval-ms", type=float, default=100.0,
                   help="grpc: period of each leader's fetch")
    p.add_argument("--grpc-warmup-s", type=float, default=3.0)
    p.add_argument("--grpc-seconds", type=float, default=10.0)
    p.add_argument("--skip-grpc", action="store_true")
    p.add_argument("--skip-saturated", action="store_true",
                   help="skip the journal-on vs journal-off closed-loop comparison")
    p.add_argument("--sat-speedup", type=float, default=200.0,
                   help="saturated: engine speed factor (the daemon must be the limit)")
    p.add_argument("--sat-fetch-interval-ms", type=float, default=20.0)
    p.add_argument("--sat-seconds", type=float, default=10.0)
    p.add_argument("--sat-reps", type=int, default=3,
                   help="saturated: repetitions of each side, alternated (medians)")
    p.add_argument("--skip-tls", action="store_true",
                   help="skip the mutual-TLS vs plaintext comparison")
    p.add_argument("--tls-reps", type=int, default=5,
                   help="tls: repetitions of each side (TLS and plain), alternated")
    p.add_argument("--tls-seconds", type=float, default=10.0,
                   help="tls: measured window of each repetition")
    p.add_argument("--tls-rate", type=float, default=1500.0,
                   help="tls: requests submitted per second (below the host's capacity)")
    p.add_argument("--tls-fetch-interval-ms", type=float, default=200.0,
                   help="tls: period of each leader's fetch")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--probe", metavar="ADDR", help=argparse.SUPPRESS)  # internal: the floor
    p.add_argument("--probe-at", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--probe-tls", default="{}", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.json:      # before the run, not after it: a missing folder is made
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    args.saturate, args.journal, args.pki = False, False, None
    if not args.skip_tls and args.channels:
        p.error("the TLS comparison needs one connection per leader (--channels 0): a "
                "shared connection would present one identity for several groups")
    if not args.skip_saturated and args.sat_reps < 1:
        p.error("--sat-reps must be at least 1")
    if not args.skip_tls and args.tls_reps < 1:
        p.error("--tls-reps must be at least 1 (the issue's target needs >= 5)")
    if args.probe:
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            print(json.dumps(runner.run(probe(args.probe, args.probe_at, args.grpc_seconds,
                                              json.loads(args.probe_tls)))))
        return 0

    load_before = os.getloadavg()[0]
    core = run_core(args)
    grpc_res = None if args.skip_grpc else run_grpc(args)
    sat = None if args.skip_saturated else run_saturated(args)
    tls_res = None if args.skip_tls else run_tls(args)
    load_after = os.getloadavg()[0]
    engines = (args.pe_nodes + args.de_nodes) * args.engines_per_node
    record = {
        "bench": "scheduler", "version": __version__, "host": platform.node(),
        "cpus": os.cpu_count(), "python": platform.python_version(),
        # The host's 1-minute load average: other work on the machine inflates latencies.
        "loadavg_1min": [load_before, load_after],
        "config": {k: v for k, v in vars(args).items() if k != "json"},
        "engines": engines, "groups": args.pe_nodes + args.de_nodes,
        "core": core, "grpc": grpc_res, "saturated": sat, "tls": tls_res,
        "summary": {
            "core_requests_per_s": round(core["requests_per_s"]),
            "grpc_requests_per_s": round(grpc_res["requests_per_s"]) if grpc_res else None,
            "grpc_fetch_p99_ms": round(grpc_res["fetch_p99_ms"], 3) if grpc_res else None,
            "grpc_fetch_p50_ms": round(grpc_res["fetch_p50_ms"], 3) if grpc_res else None,
            "grpc_server_fetch_p99_ms_le":
                grpc_res["server_fetch_p99_ms_le"] if grpc_res else None,
            "grpc_host_other_cpu_cores":
                round(grpc_res["host_other_cpu_cores"], 2) if grpc_res else None,
            "saturated_requests_per_s_journal_over_plain":
                round(sat["journal_over_plain"], 3) if sat else None,
            "saturated_server_us_per_request_plain":
                round(sat["plain"]["server_us_per_request"], 1) if sat else None,
            "saturated_server_us_per_request_journal":
                round(sat["journal"]["server_us_per_request"], 1) if sat else None,
            "grpc_fetch_p99_tls_over_plain":
                round(tls_res["fetch_p99_ms_tls_over_plain"], 3) if tls_res else None,
            "grpc_fetch_p99_ms_tls":
                round(tls_res["tls"]["fetch_p99_ms"], 3) if tls_res else None,
            "grpc_fetch_p99_ms_plain":
                round(tls_res["plain"]["fetch_p99_ms"], 3) if tls_res else None,
            "grpc_server_cpu_us_per_fetch_tls":
                round(tls_res["tls"]["server_cpu_us_per_fetch"], 1) if tls_res else None,
            "grpc_server_cpu_us_per_fetch_plain":
                round(tls_res["plain"]["server_cpu_us_per_fetch"], 1) if tls_res else None,
            "grpc_tls_repetitions": tls_res["repetitions"] if tls_res else None,
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
        g = grpc_res
        print(f"grpc: offered {args.grpc_rate:.0f} req/s, each group fetches every "
              f"{args.fetch_interval_ms:g} ms; {g['leader_processes']} leader process(es), "
              f"{g['connections']} connections; "
              f"{100 * g['fetch_over_10ms_share']:.2f}% of fetches over 10 ms")
        print(f"{'grpc latency':<34} {'p50 ms':>8} {'p99 ms':>8}")
        print(f"{'Fetch, as the leader sees it':<34} {g['fetch_p50_ms']:>8.3f} "
              f"{g['fetch_p99_ms']:>8.3f}")
        print(f"{'Fetch, inside the daemon (<=)':<34} {g['server_fetch_p50_ms_le']:>8g} "
              f"{g['server_fetch_p99_ms_le']:>8g}")
        print(f"{'health call, separate process':<34} {g['health_rtt_p50_ms']:>8.3f} "
              f"{g['health_rtt_p99_ms']:>8.3f}")
        print(f"{'health call, a leader process':<34} {g['leader_health_rtt_p50_ms']:>8.3f} "
              f"{g['leader_health_rtt_p99_ms']:>8.3f}")
        print(f"event-loop lag: daemon p99 <= {g['server_loop_lag_p99_ms_le']:g} ms; leader "
              f"processes p99 {g['client_loop_lag_p99_ms']:.1f} ms, max "
              f"{g['client_loop_lag_max_ms']:.1f} ms")
        print(f"cpu cores over the window: daemon {g['server_cpu_cores']:.2f}, leaders "
              f"{g['client_cpu_cores']:.2f}, submitter {g['submitter_cpu_cores']:.2f}, rest of "
              f"the host {g['host_other_cpu_cores']:.2f} (of {os.cpu_count()}); load average "
              f"{load_before:.1f} -> {load_after:.1f}")
    if sat:
        print(f"saturated (closed loop, engines x{args.sat_speedup:g}, fetch every "
              f"{args.sat_fetch_interval_ms:g} ms; {sat['repetitions']} repetitions of each "
              f"side, alternated, fresh daemon each; {args.sat_seconds:g} s windows):")
        print(f"  {'rep':>5} {'journal':<8} {'req/s':>9} {'daemon cores':>13} "
              f"{'us CPU/req':>11} {'fetch p99 ms':>13} {'calls/commit':>13} "
              f"{'rest of host':>13}")
        rows = [(str(r["repetition"]), "journal" if r["journal"] else "plain", r)
                for r in sat["runs"]]
        rows += [("median", name, sat[name]) for name in ("plain", "journal")]
        for rep_, name, r in rows:
            calls = f"{r['journal_calls_per_commit']:.1f}" if name == "journal" else "-"
            print(f"  {rep_:>5} {name:<8} {r['requests_per_s']:>9.0f} "
                  f"{r['server_cpu_cores']:>13.2f} {r['server_us_per_request']:>11.1f} "
                  f"{r['fetch_p99_ms']:>13.2f} {calls:>13} "
                  f"{r['host_other_cpu_cores']:>13.2f}")
        print(f"journal over plain (medians): {sat['journal_over_plain']:.3f} (target >= 0.8)")
    if tls_res:
        t = tls_res
        print(f"mutual TLS vs plaintext ({t['repetitions']} repetitions of each, alternated, "
              f"fresh daemon each; {t['identities']} certificates made in {t['pki_s']:.1f} s; "
              f"{args.tls_seconds:g} s windows; {t['rate']:g} requests/s offered, fetch "
              f"every {t['fetch_interval_ms']:g} ms):")
        print(f"  {'rep':>3} {'side':<10} {'req/s':>7} {'fetch p50 ms':>13} "
              f"{'fetch p99 ms':>13} {'server p99 <=':>14} {'daemon us/fetch':>16} "
              f"{'leaders us/fetch':>17} {'rest of host':>13}")
        for r in t["runs"]:
            print(f"  {r['repetition']:>3} {r['tls']:<10} {r['requests_per_s']:>7.0f} "
                  f"{r['fetch_p50_ms']:>13.3f} {r['fetch_p99_ms']:>13.3f} "
                  f"{r['server_fetch_p99_ms_le']:>14g} "
                  f"{r['server_cpu_us_per_fetch']:>16.1f} {r['client_cpu_us_per_fetch']:>17.1f} "
                  f"{r['host_other_cpu_cores']:>13.2f}")
        for side in ("plain", "tls"):
            m = t[side]
            print(f"  {'med':>3} {side:<10} {m['requests_per_s']:>7.0f} "
                  f"{m['fetch_p50_ms']:>13.3f} {m['fetch_p99_ms']:>13.3f} {'':>14} "
                  f"{m['server_cpu_us_per_fetch']:>16.1f} {m['client_cpu_us_per_fetch']:>17.1f} "
                  f"{m['host_other_cpu_cores']:>13.2f}")
        print(f"  Fetch p99 TLS / plain (medians): {t['fetch_p99_ms_tls_over_plain']:.3f} "
              f"(target <= 1.10); p50 {t['fetch_p50_ms_tls_over_plain']:.3f}; daemon CPU per "
              f"fetch {t['server_cpu_us_per_fetch_tls_over_plain']:.3f}, leaders' "
              f"{t['client_cpu_us_per_fetch_tls_over_plain']:.3f}")
    print("summary: " + json.dumps(record["summary"]))
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
