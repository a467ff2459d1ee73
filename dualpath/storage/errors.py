"""Errors of the block store."""

from __future__ import annotations

import errno as _errno
import os

from dualpath.errors import DualPathError

_HINTS = {
    _errno.ENOSPC: "the filesystem holding the block store is full; free space or point "
                   "storage.dir at a larger volume",
    _errno.EDQUOT: "the disk quota of this user is exhausted",
    _errno.EROFS: "the block store directory is on a read-only filesystem; mount it "
                  "read-write or point storage.dir elsewhere",
    _errno.EACCES: "this process may not write there; check ownership and permissions",
    _errno.EPERM: "this process may not write there; check ownership and permissions",
}


class StorageError(DualPathError, OSError):
    """A block store operation failed. ``.errno`` is the OS errno, ``.path`` the file."""

    def __init__(self, err: int, what: str, path: str | os.PathLike, hint: str | None = None):
        err = abs(int(err))
        name = _errno.errorcode.get(err, str(err))
        hint = hint or _HINTS.get(err)
        msg = f"{what} {os.fspath(path)}: {name} ({os.strerror(err)})"
        super().__init__(err, msg + (f"; {hint}" if hint else ""))
        self.path = os.fspath(path)
        self.what = what

    def __str__(self) -> str:
        # OSError's own str() prefixes "[Errno N]", which the message already spells out.
        return self.strerror
