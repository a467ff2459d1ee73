"""Logging set-up shared by every daemon and CLI command: plain lines on stderr, or
structured records in systemd's journal when stderr is the journal (dualpath/journald.py)."""

from __future__ import annotations

import logging
import os
import sys

from dualpath import journald
from dualpath.errors import UsageError

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time of the record, not the stream it
    was when logging was set up (which a test harness may have closed since)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def setup(level: str | None = None, name: str = "dualpath") -> logging.Logger:
    """Configure root logging once (idempotent) and return the ``name`` logger."""
    level = (level or os.environ.get("DUALPATH_LOG", "INFO")).upper()
    if level not in LEVELS:
        # A typo in the environment was a ValueError traceback from logging.
        raise UsageError(f"DUALPATH_LOG = {level!r}: allowed values are " + ", ".join(LEVELS))
    root = logging.getLogger()
    if not getattr(root, "_dualpath_configured", False):
        if journald.stderr_is_journal():      # a systemd service: structured records
            handler: logging.Handler = journald.JournalHandler()
        else:
            handler = _StderrHandler()
            handler.setFormatter(logging.Formatter(
                "%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s"))
        root.addHandler(handler)
        root._dualpath_configured = True  # type: ignore[attr-defined]
    root.setLevel(level)
    return logging.getLogger(name)
