"""Structured logging to systemd's journal (its native protocol), for daemons run by a
unit: ``journalctl -u dualpath-prefill@p0 DUALPATH_NODE_ID=p0 -p warning`` then finds
what it should, with the code location of every line.

:func:`dualpath.log.setup` switches to :class:`JournalHandler` when stderr *is* the
journal (``JOURNAL_STREAM`` names stderr's device and inode, as systemd sets it for a
service), and keeps plain stderr lines otherwise. Each record is one datagram to
journald's socket: MESSAGE, PRIORITY (syslog numbering), SYSLOG_IDENTIFIER, CODE_FILE /
CODE_LINE / CODE_FUNC, LOGGER, THREAD_NAME, and the daemon's own fields
(:func:`set_fields`: DUALPATH_NODE_ID, DUALPATH_ROLE). A field with a newline uses the
protocol's length-prefixed form. A journal that cannot be reached falls back to stderr
for that record.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import struct
import sys
import traceback

SOCKET = "/run/systemd/journal/socket"
MAX_VALUE = 48 * 1024             # a datagram stays well under the socket's limit
_PRIORITY = {logging.CRITICAL: 2, logging.ERROR: 3, logging.WARNING: 4, logging.INFO: 6,
             logging.DEBUG: 7}
_fields: dict[str, str] = {}
_NAME = re.compile(r"^[A-Z0-9][A-Z0-9_]*$")


def set_fields(**fields: str) -> None:
    """Fields every later record carries (DUALPATH_NODE_ID="p0", ...)."""
    for k in fields:
        if not _NAME.match(k) or k.startswith("_"):
            raise ValueError(f"journal field name {k!r}: A-Z, 0-9 and _, not first")
    _fields.update({k: str(v) for k, v in fields.items()})


def stderr_is_journal(env=None) -> bool:
    """True when stderr is the journal's stream (JOURNAL_STREAM = "dev:inode")."""
    value = (os.environ if env is None else env).get("JOURNAL_STREAM", "")
    try:
        dev, ino = (int(x) for x in value.split(":"))
        st = os.fstat(sys.stderr.fileno())
    except (ValueError, OSError, AttributeError):
        return False
    return (st.st_dev, st.st_ino) == (dev, ino)


def encode(fields: dict[str, str]) -> bytes:
    out = bytearray()
    for k, v in fields.items():
        b = v.encode(errors="replace")[:MAX_VALUE]
        if b"\n" in b:
            out += k.encode() + b"\n" + struct.pack("<Q", len(b)) + b + b"\n"
        else:
            out += k.encode() + b"=" + b + b"\n"
    return bytes(out)


class JournalHandler(logging.Handler):
    def __init__(self, path: str = SOCKET, identifier: str = "dualpath"):
        super().__init__()
        self.path = path
        self.identifier = identifier
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)

    def fields(self, record: logging.LogRecord) -> dict[str, str]:
        msg = record.getMessage()
        if record.exc_info:
            msg += "\n" + "".join(traceback.format_exception(*record.exc_info)).rstrip()
        return {"MESSAGE": msg,
                "PRIORITY": str(_PRIORITY.get(record.levelno, 6)),
                "SYSLOG_IDENTIFIER": self.identifier,
                "CODE_FILE": record.pathname, "CODE_LINE": str(record.lineno),
                "CODE_FUNC": record.funcName, "LOGGER": record.name,
                "THREAD_NAME": record.threadName or "", **_fields}

    def emit(self, record: logging.LogRecord) -> None:
        try:
            data = encode(self.fields(record))
            self.sock.sendto(data, self.path)
        except OSError:
            sys.stderr.write(f"{record.levelname} {record.name}: {record.getMessage()}\n")
        except Exception:  # noqa: BLE001 - logging must not raise
            self.handleError(record)

    def close(self) -> None:
        self.sock.close()
        super().close()
