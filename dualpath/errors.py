"""The exception family. Errors cross the C boundary once, here, typed and with errno.

C returns ``-errno`` (or NULL with ``errno`` set, as each function in ``csrc/dp.h``
says); :func:`check` and :func:`check_ptr` turn those into :class:`RdmaError`.
"""

from __future__ import annotations

import errno as _errno
import os

#: The command line's exit codes (dualpath/cli.py): success, a runtime failure, bad usage
#: or config (UsageError), a remote service unreachable or refusing (RemoteUnavailable).
EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_UNAVAILABLE = 0, 1, 2, 3


class DualPathError(Exception):
    """Base of every error DualPath raises on purpose."""


class UsageError(DualPathError, ValueError):
    """The caller passed something invalid; nothing was done."""


class ConfigError(UsageError):
    """A configuration value is wrong. The message names the key, the value and what is allowed."""


class RemoteUnavailable(DualPathError):
    """A remote service (the scheduler, a node) could not be reached or refused the
    caller (TLS, token); the CLI exits 3."""


class RdmaError(DualPathError, OSError):
    """A verbs (or TCP provider) call failed. ``.errno`` holds the C errno."""

    def __init__(self, err: int, what: str):
        err = abs(int(err))
        name = _errno.errorcode.get(err, str(err))
        super().__init__(err, f"{what}: {name} ({os.strerror(err)})")
        self.what = what

    def __str__(self) -> str:
        # OSError's own str() prefixes "[Errno N]", which the message already spells out.
        return self.strerror


class TransferError(DualPathError):
    """A transfer (or part of it) failed; ``.status`` is the completion status."""

    def __init__(self, message: str, *, status: int = 0, errno: int = 0):
        super().__init__(message)
        self.status = status
        self.errno = errno


class TransferTimeout(TransferError, TimeoutError):
    """A transfer did not complete within its bound."""


def check(rc: int, what: str) -> int:
    """Return ``rc`` when it is >= 0, else raise RdmaError(-rc)."""
    if rc < 0:
        raise RdmaError(-rc, what)
    return rc


def check_ptr(ptr, what: str, ffi):
    """Return ``ptr`` when it is not NULL, else raise RdmaError(errno)."""
    if ptr == ffi.NULL:
        raise RdmaError(ffi.errno or _errno.EIO, what)
    return ptr
