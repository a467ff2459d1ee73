#!/usr/bin/env python3
"""Split reads, ablated: PE-only vs choose-a-side (the paper) vs split, on one I/O-bound
1P2D cluster.

Method. One local cluster (scheduler, 1 prefill node, 2 decode nodes; separate
processes; TCP on loopback; every node's storage NIC limited to --snic-gbit) replays the
same generated trace (Table 2 '32k' row, context scaled, first --rounds rounds of
--agents trajectories, offline) in dualpath mode, three ways of reading the hits:

  pe_only  every hit read by the prefill node (read_policy prefill; layerwise on)
  side     the scheduler picks the node with the shorter read queue per request
           (paper §6.1; scheduler.split_read off)
  split    the scheduler divides each hit so that both queues drain together (the
           paper's future work; scheduler.split_read on, set through Admin.SetParams):
           each side reads its blocks and writes them into the PE

Variants alternate within each of --reps repetitions (fresh trajectory names per run,
so no run hits another's blocks); figures are medians. Model execution is emulated by
the cost model; every KV byte moves for real and the DEs verify all of it. Storage-NIC
balance = max/avg bytes over nodes in 0.5 s windows (the paper's Fig. 13 figure).

Prints a table and writes the same record as JSON (--json) with a ``summary``:
side_speedup_vs_pe_only, split_speedup_vs_pe_only, split_speedup_vs_side,
snic_max_avg_{pe_only,side,split}, bytes_mismatched.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from dualpath.cluster.local import LocalCluster
from dualpath.cluster.replay import ReplayOptions
from dualpath.cluster.run import make_trace, run_modes
from dualpath.v1 import admin_pb2

VARIANTS = {"pe_only": ("prefill", False), "side": ("", False), "split": ("", True)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agents", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--context-scale", type=float, default=0.1)
    ap.add_argument("--snic-gbit", type=float, default=0.25,
                    help="every node's storage-NIC limit (Gbit/s)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--transport", default="tcp", choices=("tcp", "auto", "verbs"))
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    if args.json:      # before the run, not after it: a missing folder is made
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    trace = make_trace(args.agents, context_scale=args.context_scale,
                       max_rounds=args.rounds, seed=args.seed)
    settings = {"transport": {"kind": args.transport},
                "storage": {"snic_gbit_per_s": args.snic_gbit}}
    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    with LocalCluster(1, 2, settings=settings) as cluster:
        stub, channel = cluster.admin()
        try:
            for rep in range(args.reps):
                order = list(VARIANTS) if rep % 2 == 0 else list(reversed(VARIANTS))
                for v in order:
                    policy, split = VARIANTS[v]
                    stub.SetParams(admin_pb2.SetParamsRequest(split_read=split), timeout=10)
                    report, _ = run_modes(
                        cluster.scheduler_address, cluster.node_ids(), 1, trace,
                        ["dualpath"], ReplayOptions(progress=False, seed=args.seed,
                                                    read_policy=policy),
                        snic_gbit_per_s=args.snic_gbit, tls_config=cluster.client_tls,
                        node_tls=cluster.node_tls, node_addresses=cluster.addresses(),
                        warmup_agents=2 if rep == 0 else 0)
                    m = report["modes"]["dualpath"]
                    runs[v].append(m)
                    print(f"  rep {rep} {v}: JCT {m['jct_s']:.2f} s, storage NIC max/avg "
                          f"{m['snic']['window_max_avg']:.2f}", file=sys.stderr, flush=True)
        finally:
            channel.close()
            cluster.stop()
            cluster.cleanup()
    out = {v: {"jct_s": statistics.median(m["jct_s"] for m in ms),
               "jct_s_reps": [m["jct_s"] for m in ms],
               "snic_max_avg": statistics.median(m["snic"]["window_max_avg"] for m in ms),
               "bytes_verified": sum(m.get("bytes_verified", 0) for m in ms),
               "bytes_mismatched": sum(m.get("bytes_mismatched", 0) for m in ms)}
           for v, ms in runs.items()}
    print(f"\nsplit reads, ablated (1P2D, emulated model, {args.agents} agents x "
          f"{args.rounds} rounds, storage NIC {args.snic_gbit:g} Gbit/s, medians of "
          f"{args.reps} alternated repetitions)")
    print("| variant | JCT (s) | speedup vs pe_only | storage NIC max/avg | KV verified (MB) "
          "| mismatched (bytes) |")
    print("|---|---|---|---|---|---|")
    base = out["pe_only"]["jct_s"]
    for v, r in out.items():
        print(f"| {v} | {r['jct_s']:.2f} | {base / r['jct_s']:.2f}x | {r['snic_max_avg']:.2f} "
              f"| {r['bytes_verified'] / 1e6:,.0f} | {r['bytes_mismatched']} |")
    summary = {"side_speedup_vs_pe_only": base / out["side"]["jct_s"],
               "split_speedup_vs_pe_only": base / out["split"]["jct_s"],
               "split_speedup_vs_side": out["side"]["jct_s"] / out["split"]["jct_s"],
               **{f"snic_max_avg_{v}": r["snic_max_avg"] for v, r in out.items()},
               "bytes_mismatched": sum(r["bytes_mismatched"] for r in out.values())}
    print("\nsummary (model execution emulated by the cost model)")
    for k, val in summary.items():
        print(f"  {k}: {val:.3f}" if isinstance(val, float) else f"  {k}: {val}")
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "variants": out,
                                               "args": vars(args)}, indent=1))
    return 0 if summary["bytes_mismatched"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
