"""BlockStore: Full Blocks as files in a POSIX directory, crash-safe and checksummed.

The directory is local by default; in a cluster it is any shared mount every node sees
(3FS FUSE, CephFS, Lustre, NFS). Files are named by block key and fanned out into two
levels of 256 subdirectories::

    <root>/<profile>-t<block tokens>/ab/cd/abcd....kvb      one Full Block (format.py)
    <root>/<profile>-t<block tokens>/ab/cd/.abcd....kvb.<rand>.tmp   a write in progress
    <root>/<profile>-t<block tokens>/ab/cd/abcd....kvb.corrupt       quarantined

Writes: temp file in the same directory, write, fsync, rename, fsync the directory.
rename is atomic, so a reader sees either no block or the whole block, never a part.
A crashed writer leaves only a ``.tmp`` file, which no reader opens; :meth:`sweep_temp`
removes old ones.

Reads: one ``preadv`` of header + payload straight into the caller's buffer, with
O_DIRECT when the filesystem supports it (bypassing the page cache: reads run at the
disk's speed and do not evict the host's memory). O_DIRECT needs 4096-aligned
addresses; registered buffers (mmap) are page-aligned, anything else bounces through
an aligned per-thread buffer. A block whose header, length or hash is wrong is counted
(``stats.corrupt_blocks``), quarantined, logged and reported as a miss: the caller must
not use its buffer after a miss.

Threads: every public method may be called from any thread. Blocking calls run on the
caller's thread; ``aread``/``awrite``/``read_many`` run on the store's bounded worker
pools (``os.preadv``, ``os.fsync`` and the XXH3 hash release the GIL).
"""

from __future__ import annotations

import asyncio
import errno as _errno
import logging
import mmap
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Self

import numpy as np

from dualpath.errors import UsageError
from dualpath.kv.layout import BlockLayout
from dualpath.kv.profiles import ModelProfile
from dualpath.storage.errors import StorageError
from dualpath.storage.format import HEADER_BYTES, check_header, pack_header, payload_hash

log = logging.getLogger("dualpath.storage")

ALIGN = 4096          # O_DIRECT alignment of addresses, lengths and offsets we use
SUFFIX = ".kvb"
DIRECT_IO_MODES = ("auto", "on", "off")


@dataclass
class StoreStats:
    """Counters since the store opened (exported as metrics by the daemons)."""

    reads: int = 0
    hits: int = 0
    misses: int = 0              # no such block
    corrupt_blocks: int = 0      # bad header, length or checksum: quarantined, a miss
    read_errors: int = 0         # I/O errors other than "no such file": a miss
    bounce_reads: int = 0        # O_DIRECT reads into an unaligned buffer (one extra copy)
    bytes_read: int = 0          # payload bytes handed out
    writes: int = 0
    writes_skipped: int = 0      # the block already existed
    bytes_written: int = 0


def aligned_bytes(nbytes: int) -> np.ndarray:
    """A page-aligned, zero-filled uint8 array (anonymous mmap; freed with the array)."""
    return np.frombuffer(mmap.mmap(-1, max(nbytes, 1)), dtype=np.uint8)[:nbytes]


class _Scratch(threading.local):
    """Per-thread aligned buffers: header page, tail page, bounce buffer (lazy)."""

    def __init__(self) -> None:
        pages = aligned_bytes(2 * ALIGN)
        self.header = pages[:ALIGN]
        self.tail = pages[ALIGN:]
        self.bounce: np.ndarray | None = None

    def bounce_for(self, nbytes: int) -> np.ndarray:
        if self.bounce is None or self.bounce.size < nbytes:
            self.bounce = aligned_bytes(-(-nbytes // ALIGN) * ALIGN)
        return self.bounce


class BlockStore:
    """Full Blocks of one model profile in a directory. See the module docstring."""

    def __init__(self, root: str | os.PathLike, profile: ModelProfile, *,
                 read_workers: int = 8, write_workers: int = 2, direct_io: str = "auto",
                 verify_checksum: bool = True, fsync: bool = True):
        if direct_io not in DIRECT_IO_MODES:
            raise UsageError(f"direct_io={direct_io!r}; allowed: {', '.join(DIRECT_IO_MODES)}")
        if read_workers < 1 or write_workers < 1:
            raise UsageError("read_workers and write_workers must be >= 1")
        self.profile = profile
        self.layout = BlockLayout.of(profile)
        self.root = Path(root)
        self.dir = self.root / f"{profile.name}-t{profile.block_tokens}"
        self.direct_io = direct_io
        self.direct = direct_io != "off"      # cleared on the first EINVAL in "auto"
        self.verify_checksum = verify_checksum
        self.fsync = fsync
        self.read_workers = read_workers
        self.stats = StoreStats()
        self._lock = threading.Lock()
        self._scratch = _Scratch()
        self._dirs: set[Path] = set()
        self._read_pool = ThreadPoolExecutor(read_workers, thread_name_prefix="dp-store-read")
        self._write_pool = ThreadPoolExecutor(write_workers, thread_name_prefix="dp-store-write")
        self._closed = False
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            self.close()
            raise StorageError(e.errno or _errno.EIO, "creating the block store directory",
                               self.dir) from None
        log.info("block store %s: profile %s, %d-byte full blocks, direct_io=%s, %d read workers",
                 self.dir, profile.name, self.layout.full_bytes, direct_io, read_workers)

    # --- lifecycle ----------------------------------------------------------------------
    def close(self) -> None:
        """Wait for queued work and stop the worker pools (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._read_pool.shutdown(wait=True)
        self._write_pool.shutdown(wait=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- naming -------------------------------------------------------------------------
    def path_of(self, key: bytes) -> Path:
        if len(key) != 16:
            raise UsageError(f"block keys are 16 bytes, got {len(key)}")
        h = key.hex()
        return self.dir / h[:2] / h[2:4] / (h + SUFFIX)

    def contains(self, key: bytes) -> bool:
        """Whether a block file exists (advisory: only a read checks its bytes)."""
        return self.path_of(key).is_file()

    def delete(self, key: bytes) -> bool:
        try:
            self.path_of(key).unlink()
            return True
        except FileNotFoundError:
            return False

    # --- writes -------------------------------------------------------------------------
    def write(self, key: bytes, data, *, overwrite: bool = False) -> bool:
        """Persist one Full Block; False when it already existed (and ``overwrite`` is off).

        Raises :class:`StorageError` (with errno and path) when the block could not be
        written; no partial file is then visible under any name a reader opens.
        """
        src = self._as_block(data)
        final = self.path_of(key)
        if not overwrite and final.is_file():
            self._count(writes_skipped=1)
            return False
        self._ensure_dir(final.parent)
        header = pack_header(self.profile.name, self.layout, key, payload_hash(src))
        tmp = final.with_name(f".{final.name}.{os.urandom(6).hex()}.tmp")
        fd = -1
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            _write_all(fd, [memoryview(header), memoryview(src)])
            if self.fsync:
                os.fsync(fd)
            os.close(fd)
            fd = -1
            os.rename(tmp, final)
            if self.fsync:
                _fsync_dir(final.parent)
        except OSError as e:
            if fd >= 0:
                os.close(fd)
            _unlink_quiet(tmp)
            raise StorageError(e.errno or _errno.EIO, f"writing block {key.hex()} to",
                               final) from None
        self._count(writes=1, bytes_written=src.size)
        return True

    async def awrite(self, key: bytes, data, *, overwrite: bool = False) -> bool:
        """:meth:`write` on the write pool (the caller keeps ``data`` alive until done)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._write_pool,
                                          lambda: self.write(key, data, overwrite=overwrite))

    # --- reads --------------------------------------------------------------------------
    def read_into(self, key: bytes, out) -> bool:
        """Read block ``key`` into ``out`` (a Full Block's bytes); True on a verified hit.

        On False (missing, corrupt or unreadable) the contents of ``out`` are undefined.
        """
        dst = self._as_block(out, writable=True)
        path = self.path_of(key)
        self._count(reads=1)
        try:
            problem = self._read_file(path, key, dst)
        except FileNotFoundError:
            self._count(misses=1)
            return False
        except StorageError:
            raise
        except OSError as e:
            self._count(read_errors=1)
            log.warning("reading block %s: %s; treating it as a miss", path, e)
            return False
        if problem is not None:
            self._count(corrupt_blocks=1)
            log.warning("corrupt block %s (%s): quarantined, treated as a miss", path, problem)
            _quarantine(path)
            return False
        self._count(hits=1, bytes_read=dst.size)
        return True

    async def aread(self, key: bytes, out) -> bool:
        """:meth:`read_into` on the read pool."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._read_pool, self.read_into, key, out)

    def read_many(self, keys: Sequence[bytes], outs: Sequence) -> list[bool]:
        """Read blocks concurrently on the read pool; one bool per key, in order."""
        if len(keys) != len(outs):
            raise UsageError(f"{len(keys)} keys but {len(outs)} buffers")
        return list(self._read_pool.map(self.read_into, keys, outs))

    def _read_file(self, path: Path, key: bytes, dst: np.ndarray) -> str | None:
        """Read and check one file into ``dst``: the problem found, or None when good."""
        full = dst.size
        s = self._scratch
        direct = self.direct
        fd = self._open_for_read(path, direct)
        try:
            body = dst
            if direct:
                if dst.ctypes.data % ALIGN:
                    body = s.bounce_for(full)
                    self._count(bounce_reads=1)
                cut = full - full % ALIGN     # the tail page takes the unaligned rest
                iov = [s.header, body[:cut], s.tail]
            else:
                cut = full
                iov = [s.header, dst, s.tail]  # the tail page only catches trailing bytes
            try:
                got = _read_all(fd, [v for v in iov if v.size], HEADER_BYTES + full, direct)
            except OSError as e:
                if not (direct and e.errno == _errno.EINVAL):
                    raise
                self._direct_unsupported(e)
                return self._read_file(path, key, dst)
        finally:
            os.close(fd)
        if got != HEADER_BYTES + full:
            return f"file holds {got} bytes, expected {HEADER_BYTES + full}"
        problem, digest = check_header(s.header, self.profile.name, self.layout, key)
        if problem is not None:
            return problem
        if cut != full:
            body[cut:full] = s.tail[:full - cut]
        if body is not dst:
            dst[:] = body[:full]
        if self.verify_checksum and payload_hash(dst) != digest:
            return "payload hash mismatch"
        return None

    def _open_for_read(self, path: Path, direct: bool) -> int:
        if not direct:
            return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            return os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECT)
        except OSError as e:
            if e.errno != _errno.EINVAL:
                raise
            self._direct_unsupported(e)
            return os.open(path, os.O_RDONLY | os.O_CLOEXEC)

    def _direct_unsupported(self, e: OSError) -> None:
        if self.direct_io == "on":
            raise StorageError(e.errno, "O_DIRECT is not supported (storage.direct_io = 'on') "
                               "by the filesystem of", self.dir) from None
        with self._lock:
            if self.direct:
                self.direct = False
                log.warning("O_DIRECT is not supported by the filesystem of %s (%s); "
                            "using buffered reads", self.dir, os.strerror(e.errno))

    # --- maintenance --------------------------------------------------------------------
    def sweep_temp(self, max_age_s: float = 600.0) -> int:
        """Remove ``.tmp`` files older than ``max_age_s`` (writers that died); returns count.

        On a shared mount another node may be writing right now: keep ``max_age_s``
        well above the longest write.
        """
        cutoff = time.time() - max_age_s
        removed = 0
        for tmp in self.dir.glob("*/*/.*.tmp"):
            try:
                if tmp.stat().st_mtime <= cutoff:
                    tmp.unlink()
                    removed += 1
            except FileNotFoundError:
                pass
        return removed

    # --- helpers ------------------------------------------------------------------------
    def _as_block(self, buf, writable: bool = False) -> np.ndarray:
        arr = buf if isinstance(buf, np.ndarray) else np.frombuffer(buf, dtype=np.uint8)
        if arr.dtype != np.uint8 or not arr.flags.c_contiguous:
            raise UsageError("block buffers must be contiguous uint8")
        arr = arr.reshape(-1)
        if arr.size != self.layout.full_bytes:
            raise UsageError(f"a {self.profile.name} full block is {self.layout.full_bytes} "
                             f"bytes, buffer has {arr.size}")
        if writable and not arr.flags.writeable:
            raise UsageError("read buffer is not writable")
        return arr

    def _ensure_dir(self, d: Path) -> None:
        if d in self._dirs:
            return
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StorageError(e.errno or _errno.EIO, "creating directory", d) from None
        with self._lock:
            self._dirs.add(d)

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for k, v in deltas.items():
                setattr(self.stats, k, getattr(self.stats, k) + v)

    def stats_dict(self) -> dict[str, int]:
        with self._lock:
            return asdict(self.stats)


def _read_all(fd: int, views: list[np.ndarray], want: int, direct: bool) -> int:
    """preadv from offset 0 until ``want`` bytes, EOF, or the views are full.

    A short O_DIRECT read is EOF (the next offset would be unaligned anyway).
    """
    got = 0
    while got < want and views:
        asked = sum(v.size for v in views)
        n = os.preadv(fd, views, got)
        got += n
        if n == 0 or (direct and n < asked):
            break
        while views and n >= views[0].size:   # drop filled views, trim a partial one
            n -= views[0].size
            views = views[1:]
        if views and n:
            views = [views[0][n:], *views[1:]]
    return got


def _write_all(fd: int, views: list[memoryview]) -> None:
    while views:
        n = os.writev(fd, views)
        while views and n >= len(views[0]):
            n -= len(views[0])
            views = views[1:]
        if views and n:
            views = [views[0][n:], *views[1:]]


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unlink_quiet(p: Path) -> None:
    try:
        os.unlink(p)
    except OSError:
        pass


def _quarantine(p: Path) -> None:
    try:
        os.replace(p, p.with_name(p.name + ".corrupt"))
    except OSError as e:   # read-only store or already gone: the count and log remain
        log.debug("could not quarantine %s: %s", p, e)
