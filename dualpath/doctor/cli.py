"""`dualpath doctor [--config F] [--role R] [--json]`."""

from __future__ import annotations

import json

MARK = {"ok": "ok  ", "warn": "WARN", "fail": "FAIL"}


def register(sub) -> None:
    p = sub.add_parser("doctor", help="check this host before a node starts: memlock, huge "
                       "pages, RDMA ports and GIDs, MTU, KV lane, store and O_DIRECT, "
                       "clock, ports, TLS files, NUMA")
    p.add_argument("--config", help="the node's TOML config (default: embedded defaults)")
    p.add_argument("--role", default="prefill", choices=("prefill", "decode", "both"),
                   help="the node role whose buffers to size (default prefill)")
    p.add_argument("--json", action="store_true", help="one JSON object instead of lines")
    p.set_defaults(func=_doctor)


def wanted_ports(cfg) -> list[str]:
    out = [a for a in (cfg.engine.control_listen, cfg.engine.metrics_listen) if a and
           not a.endswith(":0")]
    if cfg.transfer.tcp_port:
        out.append(f"{cfg.transfer.tcp_listen}:{cfg.transfer.tcp_port}")
    return out


def _doctor(args) -> int:
    from dualpath import config
    from dualpath.doctor import checks, facts

    cfg = config.load(args.config)
    ports = wanted_ports(cfg)
    results = checks.run_all(cfg, args.role, facts.gather(cfg, ports), ports)
    worst = checks.worst(results)
    if args.json:
        print(json.dumps({"role": args.role, "config": args.config or "(defaults)",
                          "worst": ("ok", "warn", "fail")[worst],
                          "checks": [r.as_dict() for r in results]}, indent=2))
    else:
        for r in results:
            print(f"{MARK[r.status]}  {r.check:<16} {r.detail}")
            if r.fix:
                print(f"      {'':<16} fix: {r.fix}")
    return worst
