"""`dualpath node`: run one PE or DE node daemon (one process per node)."""

from __future__ import annotations

import asyncio


def register(sub) -> None:
    p = sub.add_parser("node", help="run a prefill (PE) or decode (DE) node daemon")
    p.add_argument("--role", required=True, choices=("prefill", "decode"))
    p.add_argument("--node-id", required=True, help="unique node name (its engine group id)")
    p.add_argument("--scheduler", help="scheduler host:port (default: "
                   "scheduler_client.address)")
    p.add_argument("--config", help="TOML config file ([engine], [storage], [buffers], "
                   "[transport], [transfer], [kv_lane])")
    p.add_argument("--control-listen", help="overrides engine.control_listen")
    p.add_argument("--ready-file", help="write the control address here once serving "
                   "(for supervisors)")
    p.set_defaults(func=_node)


def _node(args) -> int:
    from dualpath import config as _config
    from dualpath.engine import node

    overrides = {}
    if args.control_listen:
        overrides["engine.control_listen"] = args.control_listen
    cfg = _config.load(args.config, overrides)
    scheduler = args.scheduler or cfg.scheduler_client.address

    def ready(n) -> None:
        if args.ready_file:
            with open(args.ready_file + ".tmp", "w") as fh:
                fh.write(n.address + "\n")
            import os

            os.replace(args.ready_file + ".tmp", args.ready_file)

    try:
        import uvloop

        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    runner(node.run(cfg, args.role, args.node_id, scheduler, config_path=args.config,
                    on_ready=ready))
    return 0
