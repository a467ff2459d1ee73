"""`dualpath sim`: replay a trace on a simulated cluster (docs/sim.md); print the replay
table plus the scheduler's CPU per decision, write the record as JSON and a PNG."""

from __future__ import annotations

import argparse

from dualpath.errors import UsageError

GBIT = 1e9 / 8
GIB = 1 << 30


def add_hardware_args(p: argparse.ArgumentParser) -> None:
    """Flags that change a preset's hardware figures (shared with `dualpath plan`)."""
    h = p.add_argument_group("hardware (a preset, then overrides)")
    h.add_argument("--hardware", default="local", choices=("local", "paper"),
                   help="local: this repository's local cluster (demo profile, one engine "
                   "a node); paper: 8 GPUs a node, 400 Gbit/s NICs, DS 660B")
    h.add_argument("--model", help="model profile (dualpath.kv.profiles)")
    h.add_argument("--engines-per-node", type=int, help="GPUs (engines) per node")
    h.add_argument("--snic-gbit", type=float, help="storage NIC per node, each direction, "
                   "Gbit/s (0: unlimited)")
    h.add_argument("--cnic-gbit", type=float, help="compute NIC per GPU, Gbit/s")
    h.add_argument("--pe-buffer-gib", type=float, help="PE node DRAM buffer, GiB")
    h.add_argument("--de-buffer-gib", type=float, help="DE node DRAM buffer, GiB")
    h.add_argument("--speed-scale", type=float, help="emulated GPU speed factor")
    h.add_argument("--fetch-interval-ms", type=float, help="leaders' fetch period")
    h.add_argument("--quota-ms", type=int, help="the PE's compute quota")


def hardware_from_args(args) -> object:
    from dualpath.sim.hardware import PRESETS

    hw = PRESETS[args.hardware]
    over = {}
    for flag, name, f in (("model", "model", str), ("engines_per_node", "engines_per_node", int),
                          ("snic_gbit", "snic_bytes_per_s", lambda v: v * GBIT),
                          ("cnic_gbit", "cnic_bytes_per_s", lambda v: v * GBIT),
                          ("pe_buffer_gib", "pe_buffer_bytes", lambda v: int(v * GIB)),
                          ("de_buffer_gib", "de_buffer_bytes", lambda v: int(v * GIB)),
                          ("speed_scale", "speed_scale", float),
                          ("fetch_interval_ms", "fetch_interval_s", lambda v: v / 1000),
                          ("quota_ms", "compute_quota_ms", int)):
        v = getattr(args, flag, None)
        if v is not None:
            over[name] = f(v)
    return hw.with_(**over) if over else hw


def add_trace_args(p: argparse.ArgumentParser, agents: int = 24, rounds: int = 4) -> None:
    t = p.add_argument_group("trace")
    t.add_argument("--trace", metavar="FILE.jsonl", help="a JSONL trace (docs/traces.md); "
                   "default: the Table 2 generator")
    t.add_argument("--agents", type=int, default=agents, help="trajectories (agents)")
    t.add_argument("--table", default="32k", help="Table 2 row: 32k, 48k, 64k")
    t.add_argument("--context-scale", type=float, default=0.1)
    t.add_argument("--max-rounds", type=int, default=rounds,
                   help="first rounds of each trajectory (0: all)")
    t.add_argument("--seed", type=int, default=0)


def trace_from_args(args):
    from dualpath.cluster.run import make_trace

    if args.agents is not None and args.agents < 1:
        raise UsageError(f"--agents must be >= 1, got {args.agents}")
    if args.max_rounds is not None and args.max_rounds < 0:
        raise UsageError(f"--max-rounds must be >= 0 (0: all rounds), got {args.max_rounds}")
    if not args.context_scale > 0:
        raise UsageError(f"--context-scale must be > 0, got {args.context_scale}")
    return make_trace(args.agents, table=args.table, context_scale=args.context_scale,
                      max_rounds=args.max_rounds, seed=args.seed, path=args.trace)


def register(sub) -> None:
    p = sub.add_parser("sim", help="replay a trace on a simulated cluster (discrete-event, "
                       "the real scheduler core; every figure simulated)")
    p.add_argument("--prefill-nodes", type=int, default=1)
    p.add_argument("--decode-nodes", type=int, default=2)
    add_hardware_args(p)
    add_trace_args(p)
    r = p.add_argument_group("run")
    r.add_argument("--modes", default="basic,dualpath,oracle")
    r.add_argument("--aps", type=float, help="online: Poisson agent arrivals per second "
                   "(default: offline, every agent at once)")
    r.add_argument("--split-read", action="store_true", help="the scheduler's split reads")
    r.add_argument("--window-s", type=float, default=1.0,
                   help="storage-NIC balance window (s)")
    o = p.add_argument_group("output")
    o.add_argument("--json", metavar="PATH")
    o.add_argument("--plot", metavar="PATH")
    p.set_defaults(func=_sim)
    register_plan(sub)


def parse_modes(text: str) -> list[str]:
    from dualpath.paths.payload import MODES

    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if not modes or bad:
        raise UsageError(f"--modes {text!r}: choose from {', '.join(MODES)}")
    return modes


def _sim(args) -> int:
    from dualpath.sim.cluster import run_modes
    from dualpath.sim.hardware import Shape
    from dualpath.sim.report import format_sim_table, sim_report, write_outputs

    if args.prefill_nodes < 1 or args.decode_nodes < 1:
        raise UsageError(f"--prefill-nodes and --decode-nodes must be >= 1, got "
                         f"{args.prefill_nodes} and {args.decode_nodes}")
    shape = Shape(args.prefill_nodes, args.decode_nodes)
    hw = hardware_from_args(args)
    modes = parse_modes(args.modes)
    if args.aps is not None and not args.aps > 0:
        raise UsageError(f"--aps must be > 0, got {args.aps}")
    trace = trace_from_args(args)
    results = run_modes(shape, hw, trace, modes, online_aps=args.aps,
                        split_read=args.split_read, window_s=args.window_s, seed=args.seed)
    rep = sim_report(results, shape, hw, trace, online_aps=args.aps)
    print(format_sim_table(rep))
    write_outputs(rep, args.json, args.plot)
    return 0


def register_plan(sub) -> None:
    p = sub.add_parser("plan", help="choose P/D, DRAM buffers and alpha/beta for a trace "
                       "and hardware by simulation; write a deploy TOML")
    p.add_argument("--nodes", type=int, default=6, help="nodes to split into P + D")
    add_hardware_args(p)
    add_trace_args(p, agents=24, rounds=4)
    s = p.add_argument_group("sweep")
    s.add_argument("--buffer-gib", default="", help="DRAM buffer sizes per node to try, "
                   "comma-separated GiB (default: the preset's, a quarter and 4x of it)")
    s.add_argument("--alpha-x", default="0.5,1,2", help="alpha multiples of the derived α")
    s.add_argument("--beta-x", default="0.5,1,2", help="beta multiples of the derived β")
    s.add_argument("--tolerance", type=float, default=0.05,
                   help="the simulated range: JCT within this fraction of the best")
    o = p.add_argument_group("output")
    o.add_argument("--deploy", metavar="PATH", default="plan-deploy.toml",
                   help="the deploy TOML for the choice (default ./plan-deploy.toml)")
    o.add_argument("--json", metavar="PATH")
    p.set_defaults(func=_plan)


def _floats(flag: str, text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"{flag} {text!r}: comma-separated numbers") from None


def _plan(args) -> int:
    import json

    from dualpath.scheduler.cli import table
    from dualpath.sim.plan import deploy_toml, plan

    if args.nodes < 2:
        raise UsageError(f"--nodes must be >= 2 (one prefill and one decode), got "
                         f"{args.nodes}")
    hw = hardware_from_args(args)
    trace = trace_from_args(args)
    bufs = ([int(g * GIB) for g in _floats("--buffer-gib", args.buffer_gib)]
            if args.buffer_gib else [hw.pe_buffer_bytes, hw.pe_buffer_bytes // 4,
                                     hw.pe_buffer_bytes * 4])
    if not 0 <= args.tolerance < 1:
        raise UsageError(f"--tolerance must be in [0, 1), got {args.tolerance}")

    def say(c) -> None:
        print(f"  {c.stage:<10} {c.shape!s:<7} buffer {c.buffer_bytes / GIB:6.2f} GiB "
              f"alpha x{c.alpha_x:g} beta x{c.beta_x:g}: JCT {c.jct_s:9.1f} s (simulated)",
              flush=True)
    print(f"dualpath plan: {args.nodes} nodes of {hw.engines_per_node} GPUs, {hw.model}, "
          f"{len(trace.trajectories)} agents; every JCT simulated", flush=True)
    res = plan(trace, hw, args.nodes, buffers_bytes=bufs,
               alpha_xs=_floats("--alpha-x", args.alpha_x),
               beta_xs=_floats("--beta-x", args.beta_x), tolerance=args.tolerance,
               seed=args.seed, progress=say)
    cols = ["stage", "shape", "buffer_gib", "alpha_x", "beta_x", "jct_s",
            "tokens_per_s_per_gpu", "snic_util_mean", "pe_buffer_low_fraction"]
    print(table([c.upper() for c in cols],
                [[f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c]) for c in cols]
                 for r in res["candidates"]]))
    ch = res["chosen"]
    print(f"\nrecommended: {ch['shape']}, DRAM buffers {ch['buffer_gib']:.2f} GiB per node, "
          f"alpha {ch['alpha_tokens']} tokens (x{ch['alpha_x']:g}), beta "
          f"{ch['beta_tokens']} tokens (x{ch['beta_x']:g}): simulated JCT "
          f"{ch['jct_s']:.1f} s")
    print(f"P/D range, analytic (§4.2): {res['analytic_pd_range']['described']}")
    print(f"P/D range, simulated:       {res['simulated_pd_range']['described']}")
    print(f"working set (§8.2):         {res['working_set']['described']}")
    text = deploy_toml(res, hw)
    with open(args.deploy, "w") as fh:
        fh.write(text)
    print(f"wrote {args.deploy}")
    res["deploy_toml"] = text
    res["summary"] = {"recommended_shape": ch["shape"], "recommended_jct_s": ch["jct_s"],
                      "analytic_pd_range": res["analytic_pd_range"]["described"],
                      "simulated_pd_range": res["simulated_pd_range"]["described"],
                      "working_set_bytes": res["working_set"]["bytes"]}
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=2)
            fh.write("\n")
    return 0
