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


def parse_modes(text: str) -> list[str]:
    from dualpath.engine.payload import MODES

    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if not modes or bad:
        raise UsageError(f"--modes {text!r}: choose from {', '.join(MODES)}")
    return modes


def _sim(args) -> int:
    from dualpath.sim.cluster import run_modes
    from dualpath.sim.hardware import Shape
    from dualpath.sim.report import format_sim_table, sim_report, write_outputs

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
