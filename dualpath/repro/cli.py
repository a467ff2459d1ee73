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
    p.add_argument("figure", choices=[*FIGURES, "all"],
                   help="which figure (all: every one, in order)")
    p.add_argument("--quick", action="store_true",
                   help="the small scale (a minute or two a figure), not the full one")
    p.add_argument("--out", default="repro-out", help="directory for FIG.json and FIG.png "
                   "(default: ./repro-out)")
    p.set_defaults(func=_repro)


def _cell(v) -> str:
    if isinstance(v, float):
        return f"{v:.3f}"
    if isinstance(v, dict):
        return ", ".join(f"{k} {_cell(x)}" for k, x in v.items())
    return str(v)


def format_record(rec: dict) -> str:
    """The printed table: the points, then each headline beside the paper's."""
    from dualpath.scheduler.cli import table

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
            print(format_record(rec))
            print(f"wrote {base}.json and {base}.png in {rec['wall_s']:.0f} s\n", flush=True)
    return 0
