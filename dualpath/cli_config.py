"""`dualpath config check|docs|show`."""

from __future__ import annotations

import json


def register(sub) -> None:
    p = sub.add_parser("config", help="validate, document or show the configuration")
    csub = p.add_subparsers(dest="config_cmd", metavar="ACTION", required=True)
    c = csub.add_parser("check", help="validate a TOML config file")
    c.add_argument("path")
    c.set_defaults(func=_check)
    d = csub.add_parser("docs", help="print every config key as Markdown")
    d.set_defaults(func=_docs)
    s = csub.add_parser("show", help="print the effective config as JSON")
    s.add_argument("path", nargs="?")
    s.set_defaults(func=_show)


def _check(args) -> int:
    """Exit 0 for a valid file (with a ``warning:`` line on stderr for each risky but
    valid setting: a section's ``warnings()``), 2 for an invalid one."""
    import sys

    from dualpath import config

    cfg = config.load(args.path)
    warned = [w for sec in cfg.sections.values() if hasattr(sec, "warnings")
              for w in sec.warnings()]
    for w in warned:
        print(f"{args.path}: warning: {w}", file=sys.stderr)
    print(f"{args.path}: ok" + (f" ({len(warned)} warning{'s' * (len(warned) > 1)})"
                                if warned else ""))
    return 0


def _docs(args) -> int:
    from dualpath import config

    print(config.docs())
    return 0


def _show(args) -> int:
    from dualpath import config

    print(json.dumps(config.load(args.path).to_dict(), indent=2, sort_keys=True))
    return 0
