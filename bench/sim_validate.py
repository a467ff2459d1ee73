#!/usr/bin/env python3
"""The simulator (dualpath/sim) against the local cluster it models.

Method. Calibrate: replay one trace (Table 2 '32k' row, seed 7) on real local 1P2D
and 2P1D clusters in basic, dualpath and oracle (real processes, every KV byte moved and
verified, model execution emulated, storage NICs at 0.25 Gbit/s so the runs are
I/O-bound as the repro figures are), then choose the simulator's host model (CPU per
request and per byte on this host's cores, the fetch round trip: dualpath/sim/
validate.py GRID) that minimises the largest error on those runs of the two figures
validated, each over its target (a relative JCT error / 0.10, a role's storage-NIC
utilisation error / 0.05). Validate: replay
another trace the calibration never saw (the '48k' row, seed 11) on 1P1D, 1P2D and
2P1D clusters in the three modes, simulate each with the calibrated model, and report
every figure's error.

Both sides are random where the cluster is: which leader fetches first after a burst,
a fetch's round trip, the scheduler's ties. So each real figure is the mean of
--repeats passes over the modes on one cluster (the first pass after a warm-up), and
each simulated one the mean over --seeds seeds. The errors: JCT (relative, of the
means); each role's mean storage-NIC utilisation (absolute: the target's figure, what
a plan sizes); and, reported beside it, one node's utilisation with the nodes of a role
ranked on each side (which of two interchangeable nodes got more is a fetch's timing),
and the real runs' own spread of a node's utilisation and of JCT. The host's load during
each real run (the cluster's and the driver's CPU time over wall time and this host's
cores; the highest pass's) is reported beside it: a figure measured while the host's
CPU was the bottleneck says little about the simulator.

Prints a fixed unit-labelled table and writes the same record with --json PATH; its
"summary" holds jct_rel_error_max and snic_util_abs_error_max (validation runs only;
the targets: 0.10 and 0.05).

--real-from PATH takes the real figures from an earlier record of this bench instead of
running the clusters (calibration and validation both; the record names the file): a
change to the simulator is then judged on the same real runs as the code before it,
without their run-to-run noise, and on several records in a few minutes each.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from statistics import fmean

from dualpath.sim.validate import (
    HOST_CORES,
    JCT_TARGET,
    UTIL_TARGET,
    Case,
    calibrate,
    errors,
    host_model,
    real_runs,
    sim_runs,
)

MODES = ("basic", "dualpath", "oracle")


def cases(quick: bool) -> tuple[list[Case], list[Case]]:
    """The calibration cases and the validation ones. Calibration sees two shapes, one
    short of decode nodes and one of prefill nodes: on one shape alone, host models
    that fit it equally well predicted the others' dualpath JCT 0.5-4% apart (stop 30)."""
    agents, rounds = (8, 3) if quick else (16, 4)
    cal = [Case("32k", 7, agents, rounds, 0.1, p, d, 0.25) for p, d in ((1, 2), (2, 1))]
    val = [Case("48k", 11, agents, rounds, 0.07, p, d, 0.25)
           for p, d in ((1, 1), (1, 2), (2, 1))]
    return cal, val


def recorded_real(path: str) -> tuple[list[tuple[Case, dict]], list[tuple[Case, dict]]]:
    """The calibration and validation runs of an earlier record: (case, real figures by
    mode) as :func:`real_runs` gives them. The cases are found by name among this
    bench's own (full and --quick), so a record of other cases is refused."""
    with open(path) as fh:
        rec = json.load(fh)
    known = {c.name(): c for quick in (False, True) for cs in cases(quick) for c in cs}
    runs: dict[tuple[str, str], dict] = {}
    for row in rec.get("rows", ()):
        case = known.get(row["case"])
        if case is None:
            raise SystemExit(f"{path}: case {row['case']!r} is none of this bench's")
        runs.setdefault((row["kind"], row["case"]), {})[row["mode"]] = {
            "jct_s": fmean(row["jct_real_runs_s"]), "jct_runs_s": row["jct_real_runs_s"],
            "snic_util": row["snic_util_real"], "snic_util_role": row["snic_util_role_real"],
            # Records before the per-pass figures were kept carry only their spread.
            "snic_util_runs": row.get("snic_util_real_runs"),
            "snic_util_real_spread": row["snic_util_real_spread"],
            "host_cpu_load": row["host_cpu_load"], "wall_s": row["real_wall_s"]}
    out: dict[str, list[tuple[Case, dict]]] = {"calibration": [], "validation": []}
    for (kind, name), real in runs.items():
        out[kind].append((known[name], real))
    if not out["calibration"] or not out["validation"]:
        raise SystemExit(f"{path}: no calibration or no validation runs recorded")
    return out["calibration"], out["validation"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="8 agents x 3 rounds per run")
    ap.add_argument("--repeats", type=int,
                    help="real passes over the modes per case (their mean is compared; "
                         "default 3)")
    ap.add_argument("--seeds", type=int, default=8,
                    help="simulator seeds per case and mode (their mean is compared)")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--real-from", metavar="PATH",
                    help="the real figures of an earlier --json record (no cluster runs)")
    args = ap.parse_args()
    if args.real_from and (args.quick or args.repeats is not None):
        ap.error("--real-from takes the cases and their passes from the record: "
                 "not with --quick or --repeats")
    args.repeats = 3 if args.repeats is None else args.repeats
    if args.repeats < 1 or args.seeds < 1:
        ap.error(f"--repeats and --seeds must be >= 1, got {args.repeats} and {args.seeds}")
    seeds = range(args.seeds)
    t0 = time.monotonic()
    if args.real_from:
        cal_runs, val_runs = recorded_real(args.real_from)
        cal, val = [c for c, _ in cal_runs], [c for c, _ in val_runs]
        args.repeats = len(cal_runs[0][1][MODES[0]]["jct_runs_s"])
        print(f"real figures from {args.real_from} (no cluster runs)", flush=True)
    else:
        cal, val = cases(args.quick)
        cal_runs, val_runs = [], [(c, None) for c in val]
        for case in cal:
            print(f"calibration: {case.name()} on the local cluster ...", flush=True)
            cal_runs.append((case, real_runs(case, MODES, args.repeats)))
    hw, cal_err = calibrate(cal_runs, seeds=seeds)
    print(f"calibrated host model: {host_model(hw)} (largest error over its target on the "
          f"calibration runs {cal_err:.3f})", flush=True)
    rows = []
    for case, real, kind in [*((c, r, "calibration") for c, r in cal_runs),
                             *((c, r, "validation") for c, r in val_runs)]:
        if real is None:
            print(f"validation: {case.name()} on the local cluster ...", flush=True)
            real = real_runs(case, MODES, args.repeats)
        sim = sim_runs(case, MODES, hw, seeds)
        for m, e in errors(real, sim).items():
            rows.append({"kind": kind, "case": case.name(), "mode": m, **e,
                         "host_cpu_load": real[m]["host_cpu_load"],
                         "real_wall_s": real[m]["wall_s"],
                         "snic_util_real": real[m]["snic_util"],
                         "snic_util_real_runs": real[m]["snic_util_runs"],
                         "snic_util_sim": sim[m]["snic_util"],
                         "snic_util_role_real": real[m]["snic_util_role"],
                         "snic_util_role_sim": sim[m]["snic_util_role"],
                         "jct_real_runs_s": real[m]["jct_runs_s"],
                         "jct_sim_runs_s": sim[m]["jct_runs_s"]})
    head = (f"{'kind':<11} {'case':<28} {'mode':<9} {'JCT real(s)':>11} {'JCT sim(s)':>10} "
            f"{'JCT err':>8} {'real JCT spread':>15} {'SNIC util err, role':>19} "
            f"{'node':>6} {'real node spread':>16} {'host CPU load':>13}")
    print("\nsimulated vs real (local cluster, model execution emulated)")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['kind']:<11} {r['case']:<28} {r['mode']:<9} {r['jct_real_s']:11.2f} "
              f"{r['jct_sim_s']:10.2f} {r['jct_rel_error']:8.3f} "
              f"{r['jct_real_spread']:15.3f} {r['snic_util_abs_error_max']:19.3f} "
              f"{r['snic_util_node_abs_error_max']:6.3f} {r['snic_util_real_spread']:16.3f} "
              f"{r['host_cpu_load']:13.2f}")
    print(f"(real: mean of {args.repeats} passes; simulated: mean of {args.seeds} seeds; "
          "JCT in seconds, errors and spreads as fractions)")
    v = [r for r in rows if r["kind"] == "validation"]
    summary = {
        "jct_rel_error_max": max(r["jct_rel_error"] for r in v),
        "snic_util_abs_error_max": max(r["snic_util_abs_error_max"] for r in v),
        "snic_util_node_abs_error_max": max(r["snic_util_node_abs_error_max"] for r in v),
        "snic_util_real_spread_max": max(r["snic_util_real_spread"] for r in v),
        "jct_real_spread_max": max(r["jct_real_spread"] for r in v),
        "jct_rel_error_mean": sum(r["jct_rel_error"] for r in v) / len(v),
        "real_repeats": args.repeats, "sim_seeds": args.seeds,
        "calibration_error_over_target_max": cal_err,
        "host_cpu_load_max": max(r["host_cpu_load"] for r in rows),
        "host_cores": HOST_CORES,
        "target_jct_rel_error": JCT_TARGET, "target_snic_util_abs_error": UTIL_TARGET,
    }
    summary["targets_met"] = (summary["jct_rel_error_max"] <= JCT_TARGET
                              and summary["snic_util_abs_error_max"] <= UTIL_TARGET)
    print("\nsummary (validation runs only): " + ", ".join(
        f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in summary.items()))
    rec = {"bench": "sim_validate", "method": __doc__, "host_model": host_model(hw),
           "real_from": args.real_from,
           "calibration_cases": [c.name() for c in cal],
           "validation_cases": [c.name() for c in val],
           "rows": rows, "summary": summary, "wall_s": time.monotonic() - t0}
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rec, fh, indent=2)
            fh.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
