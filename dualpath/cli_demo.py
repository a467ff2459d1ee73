"""`dualpath demo` (`make demo`): the paper's effect on this machine, on embedded defaults.

Starts a local 1P2D cluster (scheduler, one prefill node, two decode nodes, mutual TLS
with a throw-away cluster CA; TCP provider
unless a verbs device is usable; storage-NIC token buckets small enough that reading
hit KV is the bottleneck), replays the same generated agentic trace in basic, dualpath
and oracle modes, and prints JCT, speedup, storage-NIC utilisation per node and the KV
bytes the decode engines verified. Model execution is emulated by the cost model.
"""

from __future__ import annotations

import os
import time

# Sized so that basic is clearly storage-NIC bound on 2 cores and the whole run stays
# well under 3 minutes (docs/e2e.md has the measured figures).
DEMO = {"agents": 16, "max_rounds": 6, "context_scale": 0.1, "snic_gbit_per_s": 0.5,
        "table": "32k", "seed": 0}


def register(sub) -> None:
    p = sub.add_parser("demo", help="run the 1P2D demo (basic vs dualpath vs oracle)")
    p.add_argument("--out", default="out", help="directory for demo.json and demo.png")
    p.add_argument("--agents", type=int, default=DEMO["agents"])
    p.add_argument("--repeats", type=int, default=1, metavar="N",
                   help="measured passes over the modes, in alternating order; each mode "
                   "shows its median pass by JCT (every mode warms up first either way)")
    p.add_argument("--snic-gbit", type=float, default=DEMO["snic_gbit_per_s"],
                   help="emulated storage-NIC bandwidth per node (Gbit/s)")
    p.set_defaults(func=_demo)


def _demo(args) -> int:
    from dualpath.cluster.cli import check_output_path, sigterm_as_interrupt
    from dualpath.cluster.local import LocalCluster
    from dualpath.cluster.replay import ReplayOptions
    from dualpath.cluster.run import make_trace, run_modes
    from dualpath.errors import UsageError
    from dualpath.trace.report import format_table, to_json, write_plot

    t0 = time.monotonic()
    if args.snic_gbit < 0 or args.agents < 1 or args.repeats < 1:
        raise UsageError("demo: --snic-gbit must be >= 0, --agents >= 1 and --repeats >= 1")
    try:
        os.makedirs(args.out, exist_ok=True)
    except OSError as e:
        raise UsageError(f"--out {args.out}: cannot create ({e.strerror})") from None
    check_output_path(os.path.join(args.out, "demo.json"), "--out")
    trace = make_trace(args.agents, table=DEMO["table"], context_scale=DEMO["context_scale"],
                       max_rounds=DEMO["max_rounds"], seed=DEMO["seed"])
    print(f"dualpath demo: 1P2D local cluster, {args.agents} agents x {DEMO['max_rounds']} "
          f"rounds (Table 2 '32k' row, context_scale {DEMO['context_scale']}), storage NIC "
          f"{args.snic_gbit:g} Gbit/s per node; model execution emulated (cost model); every "
          "KV byte moved for real and verified by the decode engines", flush=True)
    cluster = LocalCluster(1, 2, settings={"storage": {"snic_gbit_per_s": args.snic_gbit}})
    with sigterm_as_interrupt():
        cluster.start()
        try:
            report, _ = run_modes(cluster.scheduler_address, cluster.node_ids(), 1, trace,
                                     ("basic", "dualpath", "oracle"), ReplayOptions(),
                                     snic_gbit_per_s=args.snic_gbit,
                                     tls_config=cluster.client_tls,
                                     node_tls=cluster.node_tls,
                                     node_addresses=cluster.addresses(), warmup_agents=2,
                                     repeats=args.repeats)
        finally:
            cluster.stop()
            cluster.cleanup()
    print(format_table(report))
    cmp = {c["mode"]: c for c in report["comparison"]}
    verified = report["all_passes"]["bytes_verified"]     # every pass, reported or not
    mismatched = report["all_passes"]["bytes_mismatched"]
    print(f"\ndualpath vs basic: {cmp['dualpath']['speedup_vs_basic']:.2f}x faster (ideal "
          f"(P+D)/P = 3x when storage-bound); KV bytes verified {verified / 1e6:.1f} MB, "
          f"mismatched {mismatched}")
    json_path = os.path.join(args.out, "demo.json")
    png_path = os.path.join(args.out, "demo.png")
    with open(json_path, "w") as fh:
        fh.write(to_json(report) + "\n")
    write_plot(report, png_path)
    print(f"wrote {json_path} and {png_path} in {time.monotonic() - t0:.0f} s")
    return 0 if mismatched == 0 and verified > 0 else 1
