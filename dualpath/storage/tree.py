"""The store's directory tree: namespaces, the fan-out, block file names (no policy).

    <storage.dir>/                      the store (one bound: storage.capacity_gib)
      .evictor/                         the store's evictor: its lock and publication
      <profile>-t<block tokens>/        a namespace: one KV format's blocks
        .ledger/                        what each process did to it (ledger.py)
        ab/cd/abcd....kvb               a block, by its key's hex (fan-out: 2 levels)

What :class:`~dualpath.storage.store.BlockStore` (one namespace), the store's evictor
(every namespace) and ``dualpath store`` name files by. Symlinks are never followed.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from collections.abc import Iterator

from dualpath.errors import UsageError
from dualpath.storage.backend import StoredBlock

SUFFIX = ".kvb"
NAMESPACE = re.compile(r"^(?P<name>.+)-t(?P<tokens>[1-9][0-9]*)$")
HEX = frozenset("0123456789abcdef")
BLOCK_NAME_LEN = 32 + len(SUFFIX)
_ABSENT = (errno.ENOENT, errno.ENOTDIR, errno.ELOOP)   # not there, or not ours to follow


def namespace_dirs(root: str | os.PathLike) -> list[os.DirEntry]:
    """The namespace directories of the store at ``root``, by name ([] when it is not
    there)."""
    try:
        with os.scandir(root) as it:
            found = [e for e in it if NAMESPACE.match(e.name) and
                     e.is_dir(follow_symlinks=False)]
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(found, key=lambda e: e.name)


def _fan(path: str) -> list[os.DirEntry]:
    """The two-hex-digit subdirectories of ``path`` (symlinks are not followed)."""
    try:
        with os.scandir(path) as it:
            return [e for e in it if len(e.name) == 2 and set(e.name) <= HEX and
                    e.is_dir(follow_symlinks=False)]
    except (FileNotFoundError, NotADirectoryError):
        return []


def leaf_entries(ns_dir: str | os.PathLike) -> Iterator[tuple[str, os.DirEntry]]:
    """Every entry of a namespace's fan-out leaves (``ab/cd/*``), with its leaf's four
    hex digits ("abcd"), in no order; a leaf that goes away meanwhile is skipped."""
    for top in _fan(os.fspath(ns_dir)):
        for sub in _fan(top.path):
            try:
                with os.scandir(sub.path) as it:
                    entries = list(it)
            except FileNotFoundError:
                continue
            fan = top.name + sub.name
            for e in entries:
                yield fan, e


def regular_stat(entry: os.DirEntry) -> os.stat_result | None:
    """``entry``'s stat when it is a regular file still there (not following a
    symlink); None otherwise."""
    try:
        st = entry.stat(follow_symlinks=False)
    except FileNotFoundError:
        return None
    return st if stat.S_ISREG(st.st_mode) else None


def walk_blocks(ns_dir: str | os.PathLike) -> Iterator[StoredBlock]:
    """Every block file of a namespace, in no order: its key, size and mtime. Only the
    fan-out layout's own names are listed; temp and quarantined files are skipped, and
    a file that goes away meanwhile is simply not listed."""
    for fan, e in leaf_entries(ns_dir):
        n = e.name
        if len(n) != BLOCK_NAME_LEN or not n.endswith(SUFFIX) or \
                not set(n[:32]) <= HEX or n[:4] != fan:
            continue
        st = regular_stat(e)
        if st is not None:
            yield StoredBlock(bytes.fromhex(n[:32]), st.st_size, st.st_mtime)


def block_parts(key: bytes) -> tuple[str, str, str]:
    """The two fan-out directories and the file name of block ``key``."""
    if len(key) != 16:
        raise UsageError(f"block keys are 16 bytes, got {len(key)}")
    h = key.hex()
    return h[:2], h[2:4], h + SUFFIX


def unlink_block(ns: str | os.PathLike | int, key: bytes) -> bool:
    """Remove block ``key``'s file from the namespace ``ns`` (its path, or a descriptor
    of its directory), not following a symlink in its path; False when it was not there
    (or a symlink or a file stands where its directories would); OSError when it could
    not be reached (permissions, I/O: it may still be there). Another namespace's blocks
    are removed this way by the store's evictor."""
    top, sub, name = block_parts(key)
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(top, flags, dir_fd=ns) if isinstance(ns, int) else \
            os.open(os.path.join(os.fspath(ns), top), flags)
    except OSError as e:
        if e.errno in _ABSENT:
            return False
        raise                     # EACCES, EIO, ESTALE...: the block may still be there
    try:
        try:
            dfd = os.open(sub, flags, dir_fd=fd)
        except OSError as e:
            if e.errno in _ABSENT:
                return False
            raise
        try:
            os.unlink(name, dir_fd=dfd)
            return True
        except (FileNotFoundError, IsADirectoryError):
            return False
        finally:
            os.close(dfd)
    finally:
        os.close(fd)
