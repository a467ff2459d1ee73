"""The store's ledger: what each process did to the shared store, for the others to read.

Every process that opens a block store with a capacity (and any that deletes a block)
appends to files of its own under
``<namespace>/.ledger/`` (one writer per file, so no append ever races another host's on
a networked filesystem, where O_APPEND is not atomic across clients):

    <writer>.<segment>.log     W (a block written, or found already there), E (a block
                               evicted, deleted or quarantined) and M (a read found it
                               missing): what an index of the store's keys needs
    <writer>.<segment>.hits    H (a block hit: a lookup counted it, or a read returned it):
                               what the evictor's recency needs, and nothing else reads

Records are 24 bytes (op, size, key; :data:`RECORD`); a reader consumes whole records only,
so a writer killed mid-append leaves a tail nobody misreads (it never appends to that
file again: a new process writes new files). A short write starts a new segment, as does
a segment reaching :data:`SEGMENT_BYTES`. The evictor removes segments nobody has written
for an hour (:meth:`LedgerTail.prune`); a reader that finds one gone forgets it.

The ledger is advisory, like a lookup: a record can be lost (a writer killed between its
rename and its append) or read out of order with another writer's (files are read one
after the other), so an index built from it may say a block is there that is not (its
read misses: recomputed, and the reader drops the key) or miss one that is (recomputed;
the write then finds the block and records it again). Never wrong bytes: reads check them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
import threading
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from dualpath.kv.prefix import key_tag

log = logging.getLogger("dualpath.storage")

LEDGER_DIR = ".ledger"
RECORD = struct.Struct("<cxxxI16s")    # op, size (W: bytes on disk), block key
WROTE, HIT, EVICTED, MISSED = b"W", b"H", b"E", b"M"
SEGMENT_BYTES = 64 << 20
_OPS = (WROTE, HIT, EVICTED, MISSED)


def pack(records: Iterable[tuple[bytes, int, bytes]]) -> bytes:
    return b"".join(RECORD.pack(op, size, key) for op, size, key in records)


def unpack(data: bytes | memoryview) -> Iterator[tuple[bytes, int, bytes]]:
    """Whole records of ``data``; a record whose op is not one of ours ends the file's
    useful part (a torn or foreign file)."""
    for rec in RECORD.iter_unpack(memoryview(data)[:len(data) - len(data) % RECORD.size]):
        if rec[0] not in _OPS:
            return
        yield rec


_HIT_HEAD = RECORD.pack(HIT, 0, bytes(16))[:8]
_EVICTED_HEAD = RECORD.pack(EVICTED, 0, bytes(16))[:8]
_MISSED_HEAD = RECORD.pack(MISSED, 0, bytes(16))[:8]


def _keyed(head: bytes, keys: Iterable[bytes]) -> bytes:
    """Records of ``keys`` that share their op and a size of 0 (H, E)."""
    return head + head.join(keys) if keys else b""


def writer_id() -> str:
    """This process's name in the ledger: host, pid and 32 random bits (a pid recycled
    on another boot or another host never reuses a file)."""
    host = "".join(c if c.isalnum() or c in "-_" else "_" for c in socket.gethostname())
    return f"{host[:40]}-{os.getpid()}-{os.urandom(4).hex()}"


def _unlinked(fd: int) -> bool:
    try:
        return os.fstat(fd).st_nlink == 0
    except OSError:
        return True


class LedgerWriter:
    """This process's ledger files (one ``.log`` and one ``.hits`` segment at a time).

    Records are buffered and appended by :meth:`flush` (the store's upkeep thread calls it
    every tick; :meth:`evicted` with ``now=True`` at once), each file's batch one
    ``write`` and, with ``sync``, one ``fdatasync`` (on NFS another client sees appended
    bytes only once they are flushed to the server). Buffering takes a short lock only:
    the I/O runs under another, so a caller on an event loop never waits for a flush.
    Every method may be called from any thread. A failure to append is logged and
    counted, never raised: the ledger is advisory (module docstring), the block's own
    write is what matters. The directory is made at the first append (opening a store
    on a read-only mount writes nothing).
    """

    def __init__(self, ns_dir: str | os.PathLike, *, sync: bool = True,
                 segment_bytes: int = SEGMENT_BYTES):
        self.dir = os.path.join(os.fspath(ns_dir), LEDGER_DIR)
        self.id = writer_id()
        self.sync = sync
        self.segment_bytes = segment_bytes
        self.failures = 0
        self._lock = threading.Lock()           # the buffers
        self._io = threading.Lock()             # the files: one flush at a time
        self._buf = {"log": bytearray(), "hits": bytearray()}
        # W records not yet read by the evictor, with their blocks' bytes and tenant tags
        # (buffered, then written), and their bytes in all and per tag (what a writer's
        # capacity check asks at every write: no walk of the records).
        self._marks: list[tuple[int, int, int]] = []      # (end in the log buffer, ...)
        self._written: deque[tuple[str, int, int, int]] = deque()   # (file, end, ...)
        self._unaccounted = 0
        self._unaccounted_tag: dict[int, int] = {}
        self._fds: dict[str, int] = {}
        self._offsets: dict[str, int] = {}
        self._segment = 0
        self._closed = False

    def name(self, kind: str) -> str:
        return f"{self.id}.{self._segment}.{kind}"

    def wrote(self, key: bytes, nbytes: int) -> None:
        """A block written (or found already there), ``nbytes`` on disk."""
        with self._lock:
            buf = self._buf["log"]
            buf += RECORD.pack(WROTE, nbytes, key)
            tag = key_tag(key)
            self._marks.append((len(buf), nbytes, tag))
            self._count(nbytes, tag)

    def _count(self, nbytes: int, tag: int) -> None:
        """(under ``_lock``) ``nbytes`` more (or fewer) of tag ``tag`` unaccounted."""
        self._unaccounted += nbytes
        left = self._unaccounted_tag.get(tag, 0) + nbytes
        if left:
            self._unaccounted_tag[tag] = left
        else:
            self._unaccounted_tag.pop(tag, None)

    def evicted(self, keys: Iterable[bytes], now: bool = False) -> None:
        """Blocks removed (evicted, deleted, quarantined): every index drops them, the
        evictor stops counting them."""
        self._add("log", _keyed(_EVICTED_HEAD, list(keys)), now)

    def missed(self, keys: Iterable[bytes], now: bool = False) -> None:
        """Blocks a read found missing: every index drops them (they may only be out of
        this client's sight: the evictor keeps counting them)."""
        self._add("log", _keyed(_MISSED_HEAD, list(keys)), now)

    def hit(self, keys: Iterable[bytes]) -> None:
        self._add("hits", _keyed(_HIT_HEAD, list(keys)), False)

    def _add(self, kind: str, data: bytes, now: bool) -> None:
        if data:
            with self._lock:
                self._buf[kind] += data
            if now:
                self.flush()

    def unaccounted(self, consumed: Mapping[str, int], tag: int | None = None) -> int:
        """Bytes of blocks this process wrote whose W record the evictor has not read
        yet (``consumed``: the offset it read each ``.log`` file to); with ``tag``, of
        that tenant account's blocks only."""
        mine = self.id + "."
        segs = [int(n[len(mine):].split(".", 1)[0]) for n in consumed
                if n.startswith(mine) and n.endswith(".log")]
        newest = max(segs, default=-1)        # a segment before it was read to its end
        with self._lock:
            w = self._written
            while w and (consumed.get(w[0][0], -1) >= w[0][1] or
                         int(w[0][0][len(mine):].split(".", 1)[0]) < newest):
                _, _, n, t = w.popleft()
                self._count(-n, t)
            return self._unaccounted if tag is None else self._unaccounted_tag.get(tag, 0)

    def reopen_if_removed(self) -> None:
        """Start new files if this writer's were removed (an operator's rm, a prune):
        what it appends then reaches the readers. :meth:`flush` with ``alive`` does
        this too, for the writers that mark themselves alive."""
        with self._io:
            if any(_unlinked(fd) for fd in self._fds.values()):
                self._next_segment()

    def flush(self, alive: bool = False) -> None:
        """Append what is buffered; with ``alive``, also mark this writer alive (its
        files' mtimes now, made if need be): the evictor counts the writers it shares
        the store's headroom among by those marks, and never prunes a live writer's
        files (evictor.py)."""
        with self._io:
            if alive and any(_unlinked(fd) for fd in self._fds.values()):
                self._next_segment()        # its files were removed: start new ones
            with self._lock:
                if self._closed:
                    return
                batches = {k: bytes(b) for k, b in self._buf.items() if b}
                for b in self._buf.values():
                    b.clear()
                marks, self._marks = self._marks, []
            for kind in ("log", "hits"):
                data = batches.get(kind, b"")
                if data or alive:
                    mine = marks if kind == "log" else []
                    written = self._append(kind, data, mine)
                    with self._lock:
                        self._written.extend(written)
                        for _, n, t in mine[len(written):]:   # lost with a short write:
                            self._count(-n, t)                 # never read, not counted
                    if alive and not data:
                        self._touch(kind)

    def _touch(self, kind: str) -> None:
        fd = self._fds.get(self.name(kind))
        if fd is not None:
            with contextlib.suppress(OSError):
                os.utime(fd)

    def _append(self, kind: str, data: bytes,
                marks: list[tuple[int, int, int]]) -> list[tuple[str, int, int, int]]:
        """Write ``data`` to this writer's current ``kind`` file (under ``_io``); the
        W records' (file, end offset, block bytes, tenant tag)."""
        name = self.name(kind)
        base = self._offsets.get(name, 0)
        try:
            fd = self._fds.get(name)
            if fd is None:
                # The ledger directory only, never its namespace: a namespace removed
                # meanwhile stays removed (this append fails and is counted).
                with contextlib.suppress(FileExistsError):
                    os.mkdir(self.dir, 0o755)
                fd = os.open(os.path.join(self.dir, name), os.O_WRONLY | os.O_CREAT |
                             os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
                self._fds[name] = fd
            n = os.write(fd, data) if data else 0
            if self.sync and data:
                os.fdatasync(fd)
        except OSError as e:
            n = 0
            self._failed(e)
        self._offsets[name] = base + n
        done = [(name, base + end, nbytes, tag) for end, nbytes, tag in marks if end <= n]
        if n != len(data) or (data and base + n >= self.segment_bytes):
            self._next_segment()       # a torn record ends a file: never append after it
        return done

    def _failed(self, e: OSError) -> None:
        self.failures += 1
        if self.failures == 1 or self.failures % 1000 == 0:
            log.warning("store ledger %s: %s (%d failures; lookups and eviction may be "
                        "less exact until it recovers)", self.dir, e, self.failures)

    def _next_segment(self) -> None:
        for fd in self._fds.values():
            with contextlib.suppress(OSError):   # a deferred EIO on close: still closed
                os.close(fd)
        self._fds.clear()
        self._segment += 1

    def own(self) -> set[str]:
        """The names of the files this writer appends to now."""
        with self._io:
            return {self.name("log"), self.name("hits")}

    def close(self) -> None:
        """Flush what is buffered and close (idempotent)."""
        self.flush()
        with self._io, self._lock:
            if self._closed:
                return
            self._closed = True
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


@dataclass
class LedgerTail:
    """Reads what every writer appended since the last :meth:`poll` (the files whose
    names end in one of ``kinds``). Start it at the files' current ends
    (:meth:`skip_to_end`) to read only what comes after; not thread-safe (one owner)."""

    dir: str
    kinds: tuple[str, ...] = ("log",)
    offsets: dict[str, int] = field(default_factory=dict)
    mtimes: dict[str, float] = field(default_factory=dict)    # as the last poll saw them

    @classmethod
    def of(cls, ns_dir: str | os.PathLike, *kinds: str) -> LedgerTail:
        return cls(os.path.join(os.fspath(ns_dir), LEDGER_DIR), kinds or ("log",))

    def _files(self) -> list[os.DirEntry]:
        try:
            with os.scandir(self.dir) as it:
                return [e for e in it if e.name.rsplit(".", 1)[-1] in self.kinds and
                        e.is_file(follow_symlinks=False)]
        except OSError:            # none yet, or unreadable: nothing to read this time
            return []

    def skip_to_end(self) -> None:
        for e in self._files():
            with contextlib.suppress(OSError):
                size = e.stat(follow_symlinks=False).st_size
                self.offsets[e.name] = size - size % RECORD.size

    def poll(self) -> list[tuple[str, list[tuple[bytes, int, bytes]]]]:
        """[(file name, its new records)] for each file that grew (one ``stat`` per
        file, one read per grown file); files gone are forgotten."""
        out = []
        seen = set()
        for e in self._files():
            seen.add(e.name)
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            size = st.st_size
            self.mtimes[e.name] = st.st_mtime
            start = self.offsets.get(e.name, 0)
            if size - start < RECORD.size:
                continue
            try:
                fd = os.open(e.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                want = (size - start) - (size - start) % RECORD.size
                data = os.pread(fd, want, start)
            except OSError:
                continue
            finally:
                os.close(fd)
            whole = len(data) - len(data) % RECORD.size
            self.offsets[e.name] = start + whole
            out.append((e.name, list(unpack(data[:whole]))))
        for gone in self.offsets.keys() - seen:
            del self.offsets[gone]
        for gone in self.mtimes.keys() - seen:
            del self.mtimes[gone]
        return out

    def prune(self, max_age_s: float, now: float, keep: Iterable[str] = ()) -> int:
        """Remove segments nobody wrote for ``max_age_s`` (not those in ``keep``: the
        caller's own); returns how many."""
        removed = 0
        keep = set(keep)
        for e in self._files():
            if e.name in keep:
                continue
            with contextlib.suppress(OSError):
                if now - e.stat(follow_symlinks=False).st_mtime > max_age_s:
                    os.unlink(e.path)
                    self.offsets.pop(e.name, None)
                    removed += 1
        return removed
