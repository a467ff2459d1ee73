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
    from dualpath import config

    config.load(args.path)
    print(f"{args.path}: ok")
    return 0


def _docs(args) -> int:
    from dualpath import config

    print(config.docs())
    return 0


def _show(args) -> int:
    from dualpath import config

    print(json.dumps(config.load(args.path).to_dict(), indent=2, sort_keys=True))
    return 0
