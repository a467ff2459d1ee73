"""`dualpath repro FIG|all [--quick] [--out DIR]`: run a paper figure on the local
cluster; print its table, write DIR/FIG.json (with a ``summary``) and DIR/FIG.png."""

from __future__ import annotations

import json
import os
import time


def register(sub) -> None:
    from dualpath.repro.figures import FIGURES

    p = sub.add_parser("repro", help="reproduce a figure of the paper on the local cluster "
                       "(model execution emulated)")
    p.add_argument("figure", choices=[*FIGURES, "all", "table3"],
                   help="which figure (all: every one, in order; table3 runs on the "
                   "simulator, dualpath/sim, and is not part of all)")
    p.add_argument("--quick", action="store_true",
                   help="the small scale (a minute or two a figure), not the full one")
    p.add_argument("--out", default="repro-out", help="directory for FIG.json and FIG.png "
                   "(default: ./repro-out)")
    p.add_argument("--json", metavar="PATH", help="also write the record here")
    t = p.add_argument_group("table3 (simulated)")
    t.add_argument("--agents-per-pe-node", type=int, help="default 1000 (48K agents at "
                   "48P96D, the paper's); --quick: 8")
    t.add_argument("--max-rounds", type=int, help="first rounds of each trajectory "
                   "(default all; --quick: 12)")
    t.add_argument("--shapes", help="offline shapes, e.g. 2P4D,4P8D,48P96D (default: "
                   "2P4D to 48P96D)")
    t.add_argument("--speed-horizon-s", type=float, help="cut the 48P96D run at this "
                   "simulated time (its speed and CPU then cover that part only)")
    t.add_argument("--online-aps", type=float, help="the online 44P88D run's agents/s")
    t.add_argument("--online-agents", type=int, help="its agents (0: no online run)")
    p.set_defaults(func=_repro)


def _cell(v) -> str:
    if isinstance(v, float):
        return f"{v:.3f}"
    if isinstance(v, dict):
        return ", ".join(f"{k} {_cell(x)}" for k, x in v.items())
    return str(v)


def format_record(rec: dict) -> str:
    """The printed table: the points, then each headline beside the paper's."""
    from dualpath.scheduler.render import table

    pts = rec["points"]
    cols = list(dict.fromkeys(c for p in pts for c in p))   # points may differ in kind
    lines = [f"{rec['figure']}: {rec['title']}", f"scale: {rec['scale']['described']}",
             table([c.upper() for c in cols],
                   [[_cell(p.get(c, "-")) for c in cols] for p in pts]),
             "", table(["HEADLINE", "OURS", "PAPER"],
                       [[k, _cell(v), _cell(rec["paper"].get(k, "-"))]
                        for k, v in rec["summary"].items()])]
    return "\n".join(lines)


def _repro(args) -> int:
    from dualpath.cluster.cli import sigterm_as_interrupt
    from dualpath.errors import UsageError
    from dualpath.repro import plot
    from dualpath.repro.figures import FIGURES, FULL, QUICK

    try:
        os.makedirs(args.out, exist_ok=True)
    except OSError as e:
        raise UsageError(f"--out {args.out}: cannot create ({e.strerror})") from None
    if not os.access(args.out, os.W_OK):
        raise UsageError(f"--out {args.out}: not writable")
    if args.figure == "table3":
        return _table3(args)
    given = [f for f in _TABLE3_FLAGS if getattr(args, f) is not None]
    if given:
        raise UsageError(f"--{given[0].replace('_', '-')} is for table3 only")
    scale = QUICK if args.quick else FULL
    names = list(FIGURES) if args.figure == "all" else [args.figure]
    with sigterm_as_interrupt():
        for name in names:
            t0 = time.monotonic()
            rec = FIGURES[name](scale)
            rec["wall_s"] = round(time.monotonic() - t0, 1)
            base = os.path.join(args.out, name)
            with open(base + ".json", "w") as fh:
                json.dump(rec, fh, indent=2)
                fh.write("\n")
            plot.write(rec, base + ".png")
            if args.json:
                _write_json(rec, args.json)
            print(format_record(rec))
            print(f"wrote {base}.json and {base}.png in {rec['wall_s']:.0f} s\n", flush=True)
    return 0


_TABLE3_FLAGS = ("agents_per_pe_node", "max_rounds", "shapes", "speed_horizon_s",
                 "online_aps", "online_agents")


def _write_json(rec: dict, path: str) -> None:
    with open(path, "w") as fh:
        json.dump(rec, fh, indent=2)
        fh.write("\n")


def _table3(args) -> int:
    from dataclasses import replace

    from dualpath.errors import UsageError
    from dualpath.repro import plot
    from dualpath.repro.table3 import QUICK3, Table3Scale, table3
    from dualpath.sim.hardware import Shape

    sc = QUICK3 if args.quick else Table3Scale()
    over = {}
    for flag in _TABLE3_FLAGS:
        if flag == "shapes":
            continue
        v = getattr(args, flag)
        if v is not None:
            if flag == "online_aps" and not v > 0:
                # 0 would be an offline run under the online run's name.
                raise UsageError(f"--online-aps must be > 0, got {v}")
            if v < 0 or (flag == "agents_per_pe_node" and v < 1):
                raise UsageError(f"--{flag.replace('_', '-')} must be >= "
                                 f"{1 if flag == 'agents_per_pe_node' else 0}, got {v}")
            over[flag] = v
    if args.shapes:
        shapes = [Shape.parse(x) for x in args.shapes.split(",") if x.strip()]
        over["shapes"] = tuple((s.prefill_nodes, s.decode_nodes) for s in shapes)
    sc = replace(sc, **over)
    if sc.speed_horizon_s and (48, 96) not in sc.shapes:
        raise UsageError("--speed-horizon-s cuts the 48P96D run, and --shapes has none "
                         f"({', '.join(f'{p}P{d}D' for p, d in sc.shapes)})")
    rec = table3(sc)
    base = os.path.join(args.out, "table3")
    _write_json(rec, base + ".json")
    if args.json:
        _write_json(rec, args.json)
    plot.write(rec, base + ".png")
    print(format_record(rec))
    print(f"wrote {base}.json and {base}.png in {rec['wall_s']:.0f} s", flush=True)
    return 0
