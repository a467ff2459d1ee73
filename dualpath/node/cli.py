"""`dualpath node`: run one PE or DE node daemon (one process per node)."""

from __future__ import annotations

import asyncio
import os

from dualpath.engines import KINDS
from dualpath.errors import DualPathError, UsageError


def register(sub) -> None:
    p = sub.add_parser("node", help="run a prefill (PE) or decode (DE) node daemon")
    p.add_argument("--role", required=True, choices=("prefill", "decode", "both"),
                   help="prefill (PE) or decode (DE) node of a P/D cluster, or both: the "
                   "node of a single kv_both vLLM instance (engine.kind = 'vllm')")
    p.add_argument("--node-id", required=True, help="unique node name (its engine group id)")
    p.add_argument("--scheduler", help="scheduler host:port (default: "
                   "scheduler_client.address)")
    p.add_argument("--config", help="TOML config file ([engine], [storage], [buffers], "
                   "[transport], [transfer], [kv_lane])")
    p.add_argument("--control-listen", help="overrides engine.control_listen")
    p.add_argument("--engine", choices=tuple(KINDS), help="overrides engine.kind")
    p.add_argument("--ready-file", help="write the control address here once serving "
                   "(for supervisors)")
    p.set_defaults(func=_node)


def _node(args) -> int:
    from dualpath import config as _config
    from dualpath.node import daemon as node

    if args.ready_file:
        # Checked before anything starts: a bad path found only once the node serves
        # ended in a FileNotFoundError traceback after all the start-up work.
        folder = os.path.dirname(os.path.abspath(args.ready_file))
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            raise UsageError(f"--ready-file {args.ready_file}: directory {folder} does not "
                             "exist or is not writable")
    overrides = {}
    if args.control_listen:
        overrides["engine.control_listen"] = args.control_listen
    if args.engine:
        overrides["engine.kind"] = args.engine
    cfg = _config.load(args.config, overrides)
    scheduler = args.scheduler or cfg.scheduler_client.address

    def ready(n) -> None:
        if args.ready_file:
            try:
                with open(args.ready_file + ".tmp", "w") as fh:
                    fh.write(n.address + "\n")
                os.replace(args.ready_file + ".tmp", args.ready_file)
            except OSError as e:
                raise DualPathError(f"--ready-file {args.ready_file}: {e.strerror}") from None

    try:
        import uvloop

        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    runner(node.run(cfg, args.role, args.node_id, scheduler, config_path=args.config,
                    on_ready=ready))
    return 0
