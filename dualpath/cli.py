"""The `dualpath` command line. Each subsystem adds its own subcommands.

Exit codes: 0 success, 1 runtime failure, 2 bad usage or bad config, 3 a remote
service refused or could not be reached.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from dualpath import __version__, log
from dualpath.errors import (  # noqa: F401  (the exit codes: re-exported)
    EXIT_FAIL,
    EXIT_OK,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    DualPathError,
    RemoteUnavailable,
    UsageError,
)

# Modules with `register(subparsers)`; each sets `func` on its parsers.
COMMAND_MODULES = [
    "dualpath.cli_config",
    "dualpath.cli_demo",
    "dualpath.doctor.cli",
    "dualpath.storage.cli",
    "dualpath.node.cli",
    "dualpath.cluster.cli",
    "dualpath.scheduler.cli",
    "dualpath.vllm.cli",
    "dualpath.frontend.cli",
    "dualpath.repro.cli",
    "dualpath.sim.cli",
]


def version_text() -> str:
    """The package version and what its native extension was built as (or why it does
    not load: a stale or missing build)."""
    try:
        from dualpath._native import NATIVE_VERSION, lib
    except ImportError as e:
        return f"dualpath {__version__}; native extension: {e}"
    return (f"dualpath {__version__}; native extension {NATIVE_VERSION} (verbs and TCP "
            f"providers; dma-buf memory registration "
            f"{'built in' if lib.dp_has_dmabuf() else 'not built: rdma-core < 34'})")


class _Version(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        print(version_text())
        parser.exit(0)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dualpath", description=__doc__.splitlines()[0])
    p.add_argument("--version", action=_Version, nargs=0,
                   help="the package's and the native extension's versions, then exit")
    p.add_argument("--log-level", default=None, type=str.upper, choices=log.LEVELS,
                   help="DEBUG, INFO, WARNING, ERROR (default: $DUALPATH_LOG, else INFO)")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    from dualpath.cluster.lifetime import die_with_parent

    die_with_parent()   # a local cluster's processes die with the one that started them
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_USAGE
    try:
        log.setup(args.log_level)
        rc = args.func(args)
    except UsageError as e:
        print(f"dualpath: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except RemoteUnavailable as e:
        print(f"dualpath: error: {e}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except DualPathError as e:
        print(f"dualpath: error: {e}", file=sys.stderr)
        return EXIT_FAIL
    except KeyboardInterrupt:
        return 130
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
