"""`dualpath frontend`: the OpenAI HTTP API in front of a cluster's scheduler."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal

from dualpath.errors import DualPathError, UsageError
from dualpath.sdnotify import Notifier

log = logging.getLogger("dualpath.frontend")


def register(sub) -> None:
    p = sub.add_parser("frontend", help="serve the OpenAI HTTP API (/v1/completions, "
                       "/v1/chat/completions, /v1/models, /health) in front of a "
                       "cluster's scheduler")
    p.add_argument("--config", help="TOML config ([frontend], [scheduler_client], [tls])")
    p.add_argument("--listen", help="overrides frontend.listen")
    p.add_argument("--scheduler", help="overrides scheduler_client.address")
    p.add_argument("--ready-file", help="write the API's URL here once serving")
    p.set_defaults(func=_frontend)


async def serve(cfg, scheduler: str, ready_file: str = "") -> None:
    """Serve until SIGTERM/SIGINT, then close (in-flight streams end with the process)."""
    from dualpath import tls
    from dualpath.frontend.server import FrontEnd

    tls.log_mode(cfg.tls, "front end", log)
    fe = FrontEnd(cfg.frontend, scheduler, cfg.tls)
    notifier, watchdog = Notifier(), None     # systemd's Type=notify (deploy/*.service)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    try:
        url = await fe.start()
        log.info("front end up: %s; TLS towards the scheduler %s; engine: whatever the "
                 "cluster's nodes serve (vLLM)", url, tls.mode(cfg.tls))
        if ready_file:
            tmp = ready_file + ".tmp"
            with open(tmp, "w") as fh:  # noqa: ASYNC230 - once, at start-up, one line
                fh.write(url + "\n")
            os.replace(tmp, ready_file)
        notifier.ready(f"serving the OpenAI API at {url}; scheduler {scheduler}")
        watchdog = asyncio.create_task(notifier.watchdog(), name="sd-watchdog")
        await stop.wait()
        notifier.stopping("stopping")
        log.info("front end: stopping")
    finally:
        if watchdog is not None:
            watchdog.cancel()
        notifier.close()
        await fe.close()


def _frontend(args) -> int:
    from dualpath import config as _config

    overrides = {}
    if args.listen:
        overrides["frontend.listen"] = args.listen
    if args.ready_file:
        folder = os.path.dirname(os.path.abspath(args.ready_file))
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            raise UsageError(f"--ready-file {args.ready_file}: directory {folder} does not "
                             "exist or is not writable")
    cfg = _config.load(args.config, overrides)
    try:
        asyncio.run(serve(cfg, args.scheduler or cfg.scheduler_client.address,
                          args.ready_file or ""))
    except OSError as e:
        raise DualPathError(f"front end: {e}") from None
    return 0
