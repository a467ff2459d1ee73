"""`dualpath up` (a local cluster) and `dualpath replay` (drive a trace through one)."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator

from dualpath.engines import KINDS
from dualpath.errors import UsageError


def register(sub) -> None:
    p = sub.add_parser("up", help="start a local cluster: scheduler + P prefill and D decode "
                       "node processes; Ctrl-C/SIGTERM stops them all")
    p.add_argument("--config", help="TOML config ([cluster], [engine], [storage], ...)")
    p.add_argument("--prefill-nodes", type=int, help="overrides cluster.prefill_nodes")
    p.add_argument("--decode-nodes", type=int, help="overrides cluster.decode_nodes")
    p.add_argument("--engines-per-node", type=int, help="overrides engine.engines_per_node")
    p.add_argument("--snic-gbit", type=float, help="per-node storage-NIC limit in Gbit/s "
                   "(overrides storage.snic_gbit_per_s)")
    p.add_argument("--engine", choices=tuple(KINDS), default="emulated",
                   help="emulated (the cost model) or vllm: a vLLM instance beside every "
                   "node (kv_producer / kv_consumer) and the OpenAI front end")
    p.add_argument("--model", help="--engine vllm: a local model directory (default: "
                   "SmolLM2-135M-Instruct, prepared from its PyPI package)")
    p.add_argument("--max-model-len", type=int, default=8192,
                   help="--engine vllm: the instances' context length")
    p.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="--engine vllm: vLLM's own prefix cache in every instance "
                   "(concurrent requests share a prefix's KV there; DualPath loads what "
                   "it lacks); --no-prefix-caching sends every hit through DualPath")
    p.add_argument("--concurrency", type=int, default=4,
                   help="--engine vllm: requests of full context each node holds KV for "
                   "at once; sizes the PE and DE buffers from the model's KV bytes per "
                   "token (more requests wait their turn; [buffers] in --config wins)")
    p.add_argument("--prefill-tp", type=int, default=1, metavar="N",
                   help="--engine vllm: tensor-parallel size of every prefill instance")
    p.add_argument("--decode-tp", type=int, default=1, metavar="N",
                   help="--engine vllm: tensor-parallel size of every decode instance "
                   "(may differ from the prefill's: every node keeps the canonical KV)")
    p.add_argument("--cores", metavar="LIST",
                   help="--engine vllm: the CPU cores the cluster runs on, e.g. 0-15 "
                   "(default: all this process may use); each instance gets a slice of its "
                   "own, the daemons and vLLM's API servers one core in 8 of them when "
                   "there are more cores than instances, else they share them")
    p.set_defaults(func=_up)

    r = sub.add_parser("replay", help="replay an agentic trace (offline JCT or online "
                       "latencies) on a cluster")
    src = r.add_argument_group("cluster")
    src.add_argument("--scheduler", metavar="ADDR", help="a running cluster's scheduler; "
                     "default: start a local 1P2D cluster for the run")
    src.add_argument("--nodes", help="node ids of that cluster, prefill first (for the "
                     "storage-NIC table), e.g. p0,d0,d1")
    src.add_argument("--prefill-nodes", type=int, default=1)
    src.add_argument("--decode-nodes", type=int, default=2)
    src.add_argument("--config", help="TOML config for the local cluster")
    src.add_argument("--snic-gbit", type=float, default=None,
                     help="per-node storage-NIC limit in Gbit/s (local cluster; also the "
                     "rate the report divides by)")
    tr = r.add_argument_group("trace")
    tr.add_argument("--trace", metavar="FILE.jsonl", help="a JSONL trace (docs/traces.md); "
                    "default: the Table 2 generator")
    tr.add_argument("--agents", type=int, default=8, help="trajectories (agents); with "
                    "--trace, past what the file holds, extra agents by the paper's rule "
                    "(A.3: a sampled trajectory behind a new first round)")
    tr.add_argument("--table", default="32k", help="Table 2 row: 32k, 48k, 64k")
    tr.add_argument("--context-scale", type=float, default=0.1,
                    help="scale of context lengths (generator), reported with results")
    tr.add_argument("--max-rounds", type=int, default=8, help="first rounds of each "
                    "trajectory only (0 = all)")
    tr.add_argument("--seed", type=int, default=0)
    mo = r.add_argument_group("run")
    mo.add_argument("--modes", default="basic,dualpath,oracle",
                    help="comma-separated: basic, dualpath, oracle")
    mo.add_argument("--warmup", type=int, default=2, metavar="AGENTS",
                    help="before measuring, every mode replays this many trajectories' "
                    "first 2 rounds, unreported, so no mode pays start-up costs for "
                    "another (0 = none)")
    mo.add_argument("--repeats", type=int, default=1, metavar="N",
                    help="measured passes over the modes, in alternating order (basic, "
                    "dualpath, oracle, then oracle, dualpath, basic, ...); each mode "
                    "reports its median pass by JCT, and every pass's JCT is in the "
                    "report's settings.repeats")
    mo.add_argument("--online", action="store_true", help="Poisson arrivals (needs --aps)")
    mo.add_argument("--aps", type=float, help="agents per second (online)")
    mo.add_argument("--no-layerwise", action="store_true", help="ablation: no layerwise "
                    "prefill in any mode (a request's HBM for all layers and all its "
                    "transfers before its compute; basic has none anyway)")
    mo.add_argument("--read-policy", default="", choices=("", "scheduler", "prefill",
                                                           "round_robin"),
                    help="ablation: override how the read side is chosen "
                    "(round_robin = scheduler balancing off)")
    mo.add_argument("--timeout", type=float, default=600.0, help="seconds per mode")
    mo.add_argument("--give-up-after", type=float, default=60.0, metavar="S",
                    help="stop (writing a partial report) when the scheduler has been "
                    "unreachable this long; until then calls are retried with backoff")
    mo.add_argument("--report-listen", default="127.0.0.1:0", metavar="HOST:PORT",
                    help="where the nodes' timing reports are received (0.0.0.0:PORT for "
                    "nodes on other hosts)")
    mo.add_argument("--report-host", default="", help="the host name or address the nodes "
                    "reach --report-listen at (default: its host)")
    vl = r.add_argument_group("vLLM (--engine vllm: real tokens through the OpenAI front "
                              "end; the A.3 rule with the model's own generations)")
    vl.add_argument("--engine", choices=tuple(KINDS), default="emulated")
    vl.add_argument("--url", help="a running front end (e.g. http://127.0.0.1:8000); "
                    "default: start a local vLLM P/D cluster with one")
    vl.add_argument("--model", help="the model directory (its vocabulary; the local "
                    "cluster's model); default SmolLM2-135M-Instruct")
    vl.add_argument("--served-model", help="the front end's model name (default: the "
                    "model directory's name)")
    vl.add_argument("--api-key-file", help="the front end's API key")
    vl.add_argument("--concurrency", type=int, default=16,
                    help="requests in flight at most")
    out = r.add_argument_group("output")
    out.add_argument("--json", metavar="PATH", help="write the report as JSON")
    out.add_argument("--plot", metavar="PATH", help="write the report's PNG plot")
    out.add_argument("--no-progress", action="store_true")
    r.set_defaults(func=_replay)


def check_output_path(path: str | None, flag: str) -> None:
    """Refuse an output file whose directory is missing or read-only before a run that
    can take minutes, rather than losing its result to a traceback at the end."""
    if not path:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise UsageError(f"{flag} {path}: directory {folder} does not exist or is not "
                         "writable")


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt inside the block, so the ``finally`` that stops a
    local cluster runs: its processes live in their own sessions and would outlive a
    parent killed by SIGTERM's default action. The previous handler comes back after."""

    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _overrides(args) -> dict:
    o = {}
    for attr, dotted in (("prefill_nodes", "cluster.prefill_nodes"),
                         ("decode_nodes", "cluster.decode_nodes"),
                         ("engines_per_node", "engine.engines_per_node"),
                         ("snic_gbit", "storage.snic_gbit_per_s")):
        v = getattr(args, attr, None)
        if v is not None:
            o[dotted] = v
    return o


def cluster_from_config(cfg, raw: dict, work_dir: str = ""):
    """A LocalCluster from a loaded Config (its [cluster] section plus every other
    section the file set, ``raw``, passed through to the processes)."""
    from dualpath.cluster.local import LocalCluster

    c = cfg.cluster
    settings = {sec: dict(kv) for sec, kv in raw.items() if sec != "cluster"}
    settings.setdefault("storage", {})["snic_gbit_per_s"] = cfg.storage.snic_gbit_per_s
    settings.setdefault("engine", {})["engines_per_node"] = cfg.engine.engines_per_node
    return LocalCluster(c.prefill_nodes, c.decode_nodes, cfg.engine.engines_per_node,
                        work_dir or c.work_dir, settings, c.start_timeout_s)


def _load(args):
    import tomllib

    from dualpath import config as _config

    cfg = _config.load(args.config, _overrides(args))
    raw = {}
    if args.config:
        with open(args.config, "rb") as fh:
            raw = tomllib.load(fh)
    return cfg, raw


def _up(args) -> int:
    if args.engine == "vllm":
        return _up_vllm(args)
    for flag, given in (("--model", args.model), ("--cores", args.cores)):
        if given:
            raise UsageError(f"{flag} is for --engine vllm")
    cfg, raw = _load(args)
    cluster = cluster_from_config(cfg, raw)
    stop = _start_then_wait_for_signals(cluster.start)
    print(f"dualpath up: scheduler {cluster.scheduler_address} (mutual TLS; `dualpath ctl "
          f"... --config {cluster.config_path}` steers it); nodes "
          + ", ".join(f"{n.node_id} ({n.role}) {n.address}" for n in cluster.nodes)
          + f"; logs {cluster.dir / 'logs'}. Ctrl-C stops.", flush=True)
    rc = 0
    try:
        rc = _until_stopped_or_dead(stop, cluster.dead, cluster.dir / "logs")
    finally:
        cluster.stop()
        cluster.cleanup(keep=rc != 0)   # a failed cluster keeps its logs
    return rc


def _start_then_wait_for_signals(start) -> threading.Event:
    """``start()`` (interrupted by SIGTERM, it stops what it began), then SIGTERM and
    SIGINT set the returned event instead of interrupting."""
    with sigterm_as_interrupt():
        start()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    return stop


def _until_stopped_or_dead(stop: threading.Event, dead, logs) -> int:
    """Wait for ``stop``; 1 as soon as ``dead()`` names a process that exited."""
    while not stop.wait(0.5):
        gone = dead()
        if gone:
            print(f"dualpath up: {', '.join(gone)} exited; stopping the cluster (logs in "
                  f"{logs})", file=sys.stderr)
            return 1
    return 0


def _up_vllm(args) -> int:
    """Scheduler, P prefill and D decode nodes each beside a vLLM instance, and the
    OpenAI front end; prints its URL; SIGTERM / Ctrl-C (or any of them dying) stops
    every process it started, vLLM's own children included."""
    from pathlib import Path

    from dualpath.cluster.local import ClusterError
    from dualpath.cluster.vllm_pd import VllmPdCluster
    from dualpath.cpus import allowed_cpus
    from dualpath.rpc import check_free
    from dualpath.vllm import models

    cfg, raw = _load(args)
    if args.model:
        model = Path(args.model)
        if not (model / "config.json").is_file():
            raise UsageError(f"--model {args.model}: no config.json there (a Hugging Face "
                             "model directory)")
    else:
        model = models.prepare(models.default_dir())["smollm2"]
    settings = {sec: dict(kv) for sec, kv in raw.items() if sec not in ("cluster", "frontend")}
    if cfg.storage.snic_gbit_per_s:
        settings.setdefault("storage", {})["snic_gbit_per_s"] = cfg.storage.snic_gbit_per_s
    fe = dict(raw.get("frontend", {}))
    fe.setdefault("listen", cfg.frontend.listen)
    check_free(fe["listen"], "frontend.listen")     # before minutes of start-up
    pd = VllmPdCluster(model, prefill_nodes=cfg.cluster.prefill_nodes,
                       decode_nodes=cfg.cluster.decode_nodes, work_dir=cfg.cluster.work_dir,
                       settings=settings, max_model_len=args.max_model_len, frontend=fe,
                       concurrency=args.concurrency, prefix_caching=args.prefix_caching,
                       cores=allowed_cpus(args.cores) if args.cores else None,
                       progress=lambda m: print(f"dualpath up: {m}", flush=True),
                       prefill_tp=args.prefill_tp, decode_tp=args.decode_tp)
    print(f"dualpath up: {pd.describe()}", flush=True)
    rc = 1                       # a start that fails keeps the whole work directory
    try:
        stop = _start_then_wait_for_signals(pd.start)
        print(f"dualpath up: OpenAI API at {pd.frontend_url}/v1 (model {model.name}); "
              f"scheduler {pd.cluster.scheduler_address}; "
              + ", ".join(f"{nid} beside vLLM {i.url}" for nid, i in pd.instances.items())
              + f"; {pd.addresses()}; logs {pd.dir / 'logs'}. Ctrl-C stops.", flush=True)
        rc = _until_stopped_or_dead(stop, pd.dead, pd.dir / "logs")
    except KeyboardInterrupt:
        rc = 0
    except ClusterError as e:
        raise ClusterError(f"{e}\n(the work directory {pd.dir} is kept)") from None
    finally:
        pd.stop()
        # A clean stop keeps the logs (where the banner said), a failure everything.
        pd.cleanup(keep=rc != 0, keep_logs=True)
        if rc == 0:
            print(f"dualpath up: stopped; logs kept in {pd.dir / 'logs'}", flush=True)
    return rc


def _replay_vllm(args) -> int:
    """Table 2 trajectories with real tokens through the OpenAI front end."""
    import asyncio
    import json
    from pathlib import Path

    from dualpath.cluster.agentic import http_generate, records_json, run_agents, summary
    from dualpath.cluster.run import make_trace
    from dualpath.vllm import models

    if args.concurrency < 1:
        raise UsageError(f"--concurrency {args.concurrency}: must be >= 1")
    check_output_path(args.json, "--json")
    model = Path(args.model) if args.model else models.prepare(models.default_dir())["smollm2"]
    try:
        vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
    except (OSError, ValueError, KeyError) as e:
        raise UsageError(f"--model {model}: no vocab_size in its config.json ({e})") from None
    key = ""
    if args.api_key_file:
        try:
            key = Path(args.api_key_file).read_text().strip()
        except OSError as e:
            raise UsageError(f"--api-key-file: {e.strerror}") from None
    try:
        trace = make_trace(args.agents, table=args.table, context_scale=args.context_scale,
                           max_rounds=args.max_rounds, seed=args.seed, path=args.trace)
    except OSError as e:
        raise UsageError(f"--trace {args.trace}: cannot read ({e.strerror})") from None
    pd = None
    url = args.url
    if not url:
        from dualpath.cluster.vllm_pd import VllmPdCluster

        _, raw = _load(args)
        settings = {sec: dict(kv) for sec, kv in raw.items()
                    if sec not in ("cluster", "frontend")}
        if args.snic_gbit is not None:
            settings.setdefault("storage", {})["snic_gbit_per_s"] = args.snic_gbit
        pd = VllmPdCluster(model, prefill_nodes=args.prefill_nodes,
                           decode_nodes=args.decode_nodes, settings=settings,
                           max_model_len=8192, frontend={})
    try:
        if pd is not None:
            with sigterm_as_interrupt():
                pd.start()
            url = pd.frontend_url

        async def go():
            gen, close = http_generate(url, args.served_model or model.name, key)
            try:
                # The hits the report expects: vLLM CPU's 128-token blocks (the front end
                # plans the real ones from frontend.block_tokens).
                return await run_agents(trace, gen, vocab=vocab, block_tokens=128,
                                        tag=f"replay{int(time.time())}",
                                        concurrency=args.concurrency)
            finally:
                await close()
        records = asyncio.run(go())
    finally:
        if pd is not None:
            pd.stop()
            pd.cleanup()
    s = summary(records)
    print("| rounds | JCT (s) | TTFT p50 / p99 (s) | TPOT p50 / p99 (ms) | generated |")
    print("|---|---|---|---|---|")
    print(f"| {s['rounds']} | {s['jct_s']:.2f} | {s['ttft_p50_s']:.3f} / "
          f"{s['ttft_p99_s']:.3f} | {1e3 * s['tpot_p50_s']:.1f} / "
          f"{1e3 * s['tpot_p99_s']:.1f} | {s['generated_tokens']} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": s, "engine": "vllm",
                                               "model": model.name,
                                               "rounds": records_json(records)}, indent=1))
    return 0


def _replay(args) -> int:
    if args.engine == "vllm":
        return _replay_vllm(args)
    if args.url or args.model:
        raise UsageError("--url and --model are for --engine vllm")
    from dualpath.cluster.replay import ReplayAborted, ReplayOptions
    from dualpath.cluster.run import make_trace, run_modes

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in modes:
        if m not in ("basic", "dualpath", "oracle"):
            raise UsageError(f"--modes: unknown mode {m!r}; use basic, dualpath, oracle")
    if args.online and not args.aps:
        raise UsageError("--online needs --aps (agents per second)")
    if args.timeout <= 0:
        raise UsageError(f"--timeout {args.timeout:g}: must be > 0 seconds")
    if args.warmup < 0:
        raise UsageError(f"--warmup {args.warmup}: must be >= 0 trajectories")
    if args.repeats < 1:
        raise UsageError(f"--repeats {args.repeats}: must be >= 1 passes")
    if args.give_up_after <= 0:
        raise UsageError(f"--give-up-after {args.give_up_after:g}: must be > 0 seconds")
    from dualpath.rpc import parse_listen

    parse_listen(args.report_listen, "--report-listen")
    if args.report_listen.startswith(("0.0.0.0:", "[::]:")) and not args.report_host:
        raise UsageError("--report-listen on every interface needs --report-host (the "
                         "address the nodes reach it at)")
    if args.snic_gbit is not None and args.snic_gbit < 0:
        # The local cluster's config check caught it; a --scheduler run divided by it.
        raise UsageError(f"--snic-gbit {args.snic_gbit:g}: must be >= 0 (0 = unlimited)")
    check_output_path(args.json, "--json")
    check_output_path(args.plot, "--plot")
    try:
        trace = make_trace(args.agents, table=args.table, context_scale=args.context_scale,
                           max_rounds=args.max_rounds, seed=args.seed, path=args.trace)
    except OSError as e:
        raise UsageError(f"--trace {args.trace}: cannot read ({e.strerror})") from None
    opts = ReplayOptions(replay_mode="online" if args.online else "offline",
                         aps=args.aps if args.online else None,
                         layerwise=False if args.no_layerwise else None,
                         read_policy=args.read_policy,
                         seed=args.seed, timeout_s=args.timeout,
                         progress=not args.no_progress, give_up_s=args.give_up_after,
                         sink_listen=args.report_listen, sink_host=args.report_host)
    if args.scheduler:
        nodes = [n for n in (args.nodes or "").split(",") if n]
        if not nodes:
            raise UsageError("--scheduler needs --nodes (prefill nodes first)")
        import grpc

        from dualpath.scheduler.client import rpc_error

        cfg, _ = _load(args)
        try:
            report, _ = run_modes(args.scheduler, nodes, args.prefill_nodes, trace, modes,
                                  opts, snic_gbit_per_s=args.snic_gbit or 0.0,
                                  tls_config=cfg.tls, node_tls=cfg.tls,
                                  warmup_agents=args.warmup, repeats=args.repeats)
        except grpc.aio.AioRpcError as e:
            raise rpc_error(e, args.scheduler) from None
        except ReplayAborted as e:
            return _partial(e, args)
    else:
        cfg, raw = _load(args)
        cluster = cluster_from_config(cfg, raw)
        with sigterm_as_interrupt():
            cluster.start()
            try:
                report, _ = run_modes(cluster.scheduler_address, cluster.node_ids(),
                                      cluster.prefill_nodes, trace, modes, opts,
                                      snic_gbit_per_s=cfg.storage.snic_gbit_per_s,
                                      tls_config=cluster.client_tls,
                                      node_tls=cluster.node_tls,
                                      node_addresses=cluster.addresses(),
                                      warmup_agents=args.warmup, repeats=args.repeats)
            except ReplayAborted as e:
                return _partial(e, args)
            finally:
                cluster.stop()
                cluster.cleanup()
    _write_report(report, args)
    bad = {m: r for m, r in report["reliability"].items()
           if r["requests_failed"] or r["requests_duplicated"]}
    every = report["all_passes"]
    if every["requests_failed"] or every["requests_duplicated"]:
        bad["all passes"] = every                  # those of passes not reported too
    if bad:
        print("dualpath: error: requests failed or were reported twice: "
              + "; ".join(f"{m}: {r['requests_failed']} failed, {r['requests_duplicated']} "
                          "duplicated" for m, r in bad.items()), file=sys.stderr)
        return 1
    return 0


def _write_report(report: dict, args) -> None:
    from dualpath.trace.report import format_table, to_json, write_plot

    print(format_table(report))
    if args.json:
        with open(args.json, "w") as fh:
            fh.write(to_json(report) + "\n")
    if args.plot:
        write_plot(report, args.plot)
        print(f"plot: {args.plot}")


def _partial(e, args) -> int:
    """A replay that could not finish: the partial report, then exit 3 (the scheduler
    unreachable) or 1."""
    from dualpath.errors import EXIT_FAIL, EXIT_UNAVAILABLE

    report = getattr(e, "report", None)
    if report is not None:
        _write_report(report, args)
        where = f"partial report{' in ' + args.json if args.json else ' above'}"
    else:
        where = "no round finished: no partial report"
    print(f"dualpath: error: {e} ({where})", file=sys.stderr)
    return EXIT_UNAVAILABLE if e.unavailable else EXIT_FAIL
