"""BlockStore: Full Blocks as files in a POSIX directory, crash-safe and checksummed
(the POSIX :class:`~dualpath.storage.backend.BlockBackend`).

The directory is local by default; in a cluster it is any shared mount every node sees
(3FS FUSE, CephFS, Lustre, NFS). Files are named by block key and fanned out into two
levels of 256 subdirectories::

    <root>/<profile>-t<block tokens>/ab/cd/abcd....kvb      one Full Block (format.py)
    <root>/<profile>-t<block tokens>/ab/cd/.abcd....kvb.<rand>.tmp   a write in progress
    <root>/<profile>-t<block tokens>/ab/cd/abcd....kvb.corrupt       quarantined

Writes: temp file in the same directory, write, fsync, rename, fsync the directory.
rename is atomic, so a reader sees either no block or the whole block, never a part.
A written block's pages are dropped from the page cache (POSIX_FADV_DONTNEED after the
fsync, or without fsync after a bounded write-back when reads use O_DIRECT): reads
bypass it anyway, and persisting KV must not evict the host's fresh data.
A crashed writer leaves only a ``.tmp`` file, which no reader opens; :meth:`sweep_temp`
removes old ones.

Paths stay inside the store (the mount may be writable by others): every directory
below the store's root is opened with O_NOFOLLOW relative to its parent's descriptor,
and a block file with O_NOFOLLOW | O_NONBLOCK, so a symlink anywhere below the root is
refused (counted in ``stats.unsafe_paths``, a miss) and a FIFO planted in place of a
block cannot block a reader. A directory or any other non-regular file in place of a
block is a miss too; none of these says anything about O_DIRECT support.

Integrity against writers of the mount: with ``integrity_key`` (the cluster key) every
block written carries a keyed tag (Poly1305 under a per-write key, format.py) and only
blocks whose tag verifies are hits; an untagged or forged block is corrupt (quarantined,
a miss).

Reads: one ``preadv`` of header + payload straight into the caller's buffer, with
O_DIRECT when the filesystem supports it (bypassing the page cache: reads run at the
disk's speed and do not evict the host's memory). O_DIRECT needs 4096-aligned
addresses; registered buffers (mmap) are page-aligned, anything else bounces through
an aligned per-thread buffer. A block whose header, length or hash is wrong is counted
(``stats.corrupt_blocks``), quarantined, logged and reported as a miss: the caller must
not use its buffer after a miss.

Threads: every public method may be called from any thread. Blocking calls run on the
caller's thread; ``aread``/``awrite``/``read_many`` run on the store's bounded worker
pools (``os.preadv``, ``os.fsync`` and the XXH3 hash release the GIL); ``aread_many``
hands its blocks to one of the store's ``read_rings`` ring readers (taking turns), each
a thread that owns a persistent io_uring ring (csrc/store_io.c ``dp_sio_ring``) fed by
the batches it is handed.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno as _errno
import fcntl
import logging
import os
import stat
import threading
import time
from collections.abc import Container, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Self

import numpy as np

from dualpath._libc import LIBC
from dualpath._native import ffi, lib
from dualpath.aio import to_the_end
from dualpath.errors import UsageError
from dualpath.kv.layout import BlockLayout
from dualpath.kv.prefix import key_tag
from dualpath.kv.profiles import ModelProfile
from dualpath.storage.backend import StoredBlock
from dualpath.storage.errors import StorageError
from dualpath.storage.evictor import StoreCapacity, Upkeep
from dualpath.storage.format import (
    HEADER_BYTES,
    MIN_KEY_BYTES,
    check_header,
    check_tag,
    pack_header,
    payload_hash,
)
from dualpath.storage.index import KeyIndex
from dualpath.storage.ledger import LedgerTail, LedgerWriter
from dualpath.storage.publication import CapacityGuard, usage_path
from dualpath.storage.ring import ALIGN, RingReader, aligned_bytes, direct_cut
from dualpath.storage.tree import (  # noqa: F401 (SUFFIX, leaf_entries: the store's names)
    SUFFIX,
    block_parts,
    leaf_entries,
    unlink_block,
    walk_blocks,
)

log = logging.getLogger("dualpath.storage")

DIRECT_IO_MODES = ("auto", "on", "off")


@dataclass
class OpenBlock:
    """A block file opened for layer reads (:meth:`BlockStore.open_block`); its header
    checked, its payload hash still to verify (:meth:`BlockStore.finish_block`)."""

    key: bytes
    fd: int
    digest: int
    header: bytes
    direct: bool


@dataclass
class StoreStats:
    """Counters since the store opened (exported as metrics by the daemons)."""

    reads: int = 0
    hits: int = 0
    misses: int = 0              # no such block
    corrupt_blocks: int = 0      # bad header, length or checksum: quarantined, a miss
    read_errors: int = 0         # I/O errors other than "no such file": a miss
    unsafe_paths: int = 0        # a symlink or non-regular file on a block's path: a miss
    bounce_reads: int = 0        # O_DIRECT reads into an unaligned buffer (one extra copy)
    bytes_read: int = 0          # payload bytes handed out
    writes: int = 0
    writes_skipped: int = 0      # the block already existed
    writes_refused_capacity: int = 0   # storage.capacity_gib reached (evictor.py)
    bytes_written: int = 0


class _Scratch(threading.local):
    """Per-thread aligned buffers: header page, tail page, bounce buffer (lazy)."""

    def __init__(self) -> None:
        pages = aligned_bytes(2 * ALIGN)
        self.header = pages[:ALIGN]
        self.tail = pages[ALIGN:]
        self.bounce: np.ndarray | None = None
        self.pages: np.ndarray | None = None

    def pages_for(self, n: int) -> np.ndarray:
        """``n`` aligned pages (a batch's header and tail pages), kept for the thread."""
        if self.pages is None or len(self.pages) < n:
            self.pages = aligned_bytes(n * ALIGN).reshape(n, ALIGN)
        return self.pages

    def bounce_for(self, nbytes: int) -> np.ndarray:
        if self.bounce is None or self.bounce.size < nbytes:
            self.bounce = aligned_bytes(-(-nbytes // ALIGN) * ALIGN)
        return self.bounce


class BlockStore:
    """Full Blocks of one model profile in a directory. See the module docstring."""

    def __init__(self, root: str | os.PathLike, profile: ModelProfile, *,
                 read_workers: int = 8, write_workers: int = 2, direct_io: str = "auto",
                 read_batch_depth: int = 4, read_rings: int = 4,
                 verify_checksum: bool = True, fsync: bool = True,
                 integrity_key: bytes | None = None,
                 capacity: StoreCapacity | None = None, index_max_keys: int = 1_000_000):
        if direct_io not in DIRECT_IO_MODES:
            raise UsageError(f"direct_io={direct_io!r}; allowed: {', '.join(DIRECT_IO_MODES)}")
        if integrity_key is not None and len(integrity_key) < MIN_KEY_BYTES:
            raise UsageError(f"the block integrity key has {len(integrity_key)} bytes; at "
                             f"least {MIN_KEY_BYTES}")
        self.integrity_key = integrity_key
        if read_workers < 1 or write_workers < 1:
            raise UsageError("read_workers and write_workers must be >= 1")
        if not 0 <= read_rings <= 64:
            raise UsageError(f"read_rings must be 0 to 64, got {read_rings}")
        if not 0 <= read_batch_depth <= 1024:
            raise UsageError(f"read_batch_depth must be 0 (off) to 1024, got "
                             f"{read_batch_depth}")
        self.profile = profile
        self.layout = BlockLayout.of(profile)
        self.root = Path(root)
        self.dir = self.root / f"{profile.name}-t{profile.block_tokens}"
        self.direct_io = direct_io
        self.direct = direct_io != "off"      # cleared on the first EINVAL in "auto"
        self.verify_checksum = verify_checksum
        self.fsync = fsync
        self.read_workers = read_workers
        self.read_batch_depth = read_batch_depth
        self.read_rings = read_rings
        self._batched = read_batch_depth > 0
        self.stats = StoreStats()
        self._lock = threading.Lock()
        self._scratch = _Scratch()
        self._read_pool = ThreadPoolExecutor(read_workers, thread_name_prefix="dp-store-read")
        self._write_pool = ThreadPoolExecutor(write_workers, thread_name_prefix="dp-store-write")
        self._closed = False
        self._rings: list[RingReader] = []       # started by the first aread_many batch
        self._next_ring = 0
        self._ring_refused = False
        self._root_fd = -1
        self.ledger: LedgerWriter | None = None
        self.index: KeyIndex | None = None
        self.upkeep: Upkeep | None = None
        self._guard: CapacityGuard | None = None
        self.capacity = capacity
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._root_fd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            self.ledger = LedgerWriter(self.dir, sync=fsync)
        except OSError as e:
            self.close()
            raise StorageError(e.errno or _errno.EIO, "creating the block store directory",
                               self.dir) from None
        if index_max_keys > 0:
            self.index = KeyIndex(LedgerTail.of(self.dir, "log"), self._file_exists,
                                  max_keys=index_max_keys)
        if capacity is not None and capacity.bytes > 0:
            self._guard = CapacityGuard(self.root, self.dir.name, self.ledger)
            self.upkeep = capacity.start(self, self.ledger)
        elif CapacityGuard(self.root, self.dir.name, self.ledger).published() is not None:
            log.warning("block store %s: other processes bound this store (an evictor "
                        "publishes %s) but this one opens it without "
                        "storage.capacity_gib: its writes escape the bound until the "
                        "evictor's next rescan; give every process the same [storage]",
                        self.dir, usage_path(self.root))
        if self.index is not None:
            self.index.start()            # its polling thread, once nothing above can fail
        log.info("block store %s: profile %s, %d-byte full blocks, direct_io=%s, %d read "
                 "workers, integrity tags %s, index %s, capacity %s", self.dir, profile.name,
                 self.layout.full_bytes, direct_io, read_workers,
                 "on (cluster key)" if integrity_key else "off",
                 f"up to {index_max_keys} keys" if self.index is not None else "off",
                 f"{self.upkeep.core.capacity / 2**30:.2f} GiB (watermarks "
                 f"{capacity.high}/{capacity.low}, leases {capacity.lease_s:g} s)"
                 if self.upkeep is not None else "unbounded")

    # --- lifecycle ----------------------------------------------------------------------
    def close(self) -> None:
        """Wait for queued work, stop the ring reader, the worker pools and the upkeep
        thread, flush the ledger (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            rings, self._rings = self._rings, []
        for ring in rings:
            ring.close()
        self._read_pool.shutdown(wait=True)
        self._write_pool.shutdown(wait=True)
        if self.upkeep is not None:
            self.upkeep.close()
        if self.index is not None:
            self.index.close()
        if self.ledger is not None:
            self.ledger.close()
        if self._root_fd >= 0:
            os.close(self._root_fd)
            self._root_fd = -1

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- naming -------------------------------------------------------------------------
    def path_of(self, key: bytes) -> Path:
        """Where block ``key`` lives (for people and tests; I/O goes through
        :meth:`_block_dir`, which refuses symlinks)."""
        return self.dir.joinpath(*block_parts(key))

    def _block_dir(self, key: bytes, create: bool = False) -> tuple[int, str]:
        """(descriptor of the block's directory, file name): each level opened with
        O_NOFOLLOW below the root, made when ``create``. OSError: ENOENT when missing,
        ELOOP or ENOTDIR when a symlink or a file is in the way. Caller closes the fd."""
        *dirs, name = block_parts(key)
        fd = os.dup(self._root_fd)
        try:
            for d in dirs:
                flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
                try:
                    nxt = os.open(d, flags, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        raise
                    try:
                        os.mkdir(d, 0o755, dir_fd=fd)
                    except FileExistsError:
                        pass
                    nxt = os.open(d, flags, dir_fd=fd)
                os.close(fd)
                fd = nxt
        except BaseException:
            os.close(fd)
            raise
        return fd, name

    def _is_block_file(self, dfd: int, name: str) -> bool:
        try:
            return stat.S_ISREG(os.stat(name, dir_fd=dfd, follow_symlinks=False).st_mode)
        except FileNotFoundError:
            return False

    def contains(self, key: bytes) -> bool:
        """Whether block ``key`` is stored, as the index knows it or a ``stat`` finds it
        (advisory: only a read checks its bytes)."""
        if self.index is not None:
            return self.index.contains(key)
        return self._file_exists(key)

    def on_disk(self, key: bytes) -> bool:
        """Whether block ``key``'s file exists now (a ``stat``, not the index: for a
        writer deciding whether to write it again)."""
        return self._file_exists(key)

    def _file_exists(self, key: bytes) -> bool:
        try:
            dfd, name = self._block_dir(key)
        except OSError:
            return False
        try:
            return self._is_block_file(dfd, name)
        finally:
            os.close(dfd)

    def leading(self, keys: Sequence[bytes], held: Container[bytes] = ()) -> int:
        """How many of the leading ``keys`` have a block file (:meth:`contains`), or are
        in ``held`` (blocks on their way to the store): a hit's stored prefix. With an
        index (index.py) no filesystem call per block; with a capacity the blocks
        counted are hits to the evictor, leased for the request that planned them."""
        if self.index is not None:
            n = self.index.leading(keys, held)
        else:
            n = 0
            for key in keys:
                if key not in held and not self._file_exists(key):
                    break
                n += 1
        if n and self.upkeep is not None:
            self.ledger.hit(keys[:n])
        return n

    def lease(self, keys: Sequence[bytes]) -> None:
        """Record ``keys`` as hit (an in-flight request's plan names them): the evictor
        leaves them for ``storage.hit_lease_s``. Nothing without a capacity."""
        if self.upkeep is not None and keys:
            self.ledger.hit(keys)

    def delete(self, key: bytes) -> bool:
        """Remove block ``key`` for every node: the file, this process's index entry,
        and an E record in the ledger (other processes' indexes drop it). False when
        it was not there."""
        gone = self.remove_file(key)      # this process's index entry too
        if self.upkeep is not None:
            self.upkeep.forget(key)
        if self.ledger is not None:
            self.ledger.evicted([key], now=True)
        return gone

    def remove_file(self, key: bytes, strict: bool = False) -> bool:
        """Unlink block ``key``'s file only (the evictor records its E itself); False
        when it was not there. A directory that cannot be reached (permissions, I/O) is
        False too, or with ``strict`` (the evictor: the block may still be there, and
        must stay counted) the OSError."""
        if self.index is not None:
            self.index.discard(key)
        try:
            return unlink_block(self._root_fd, key)
        except OSError:
            if strict:
                raise
            return False

    # --- writes -------------------------------------------------------------------------
    def write(self, key: bytes, data, *, overwrite: bool = False) -> bool:
        """Persist one Full Block; False when it already existed (and ``overwrite`` is off).

        Raises :class:`StorageError` (with errno and path) when the block could not be
        written; no partial file is then visible under any name a reader opens.
        """
        src = self._as_block(data)
        final = self.path_of(key)
        try:
            dfd, name = self._block_dir(key, create=True)
        except OSError as e:
            err = e.errno or _errno.EIO
            # The cause first (read-only, no space, permission: StorageError says it);
            # the guess only where the errno points at the path itself.
            why = (" (a symlink or a file in the way?)"
                   if err in (_errno.ENOTDIR, _errno.ELOOP, _errno.EEXIST) else "")
            raise StorageError(err, f"writing block {key.hex()}: the directory{why} of",
                               final) from None
        fd = -1
        tmp = f".{name}.{os.urandom(6).hex()}.tmp"
        on_disk = HEADER_BYTES + src.size
        try:
            if not overwrite and self._is_block_file(dfd, name):
                self._count(writes_skipped=1)
                self._stored(key, on_disk)     # known again: an index or ledger that lost it
                return False
            why = self._guard.refusal(on_disk, key_tag(key)) \
                if self._guard is not None else None
            if why is not None:
                self._count(writes_refused_capacity=1)
                raise StorageError(_errno.ENOSPC, f"not writing block {key.hex()}",
                                   final, hint=f"{why} until its evictor frees space; "
                                   "the block is not cached")
            header = pack_header(self.profile.name, self.layout, key, payload_hash(src),
                                 self.integrity_key, src)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW |
                         os.O_CLOEXEC, 0o644, dir_fd=dfd)
            _write_all(fd, [memoryview(header), memoryview(src)])
            if self.fsync:
                os.fsync(fd)
            elif self.direct:
                _write_back(fd)
            # Reads use O_DIRECT: this block's pages would only push fresher data out of
            # the page cache. Clean after the fsync (or, without fsync, after the bounded
            # write-back above), they are dropped now. DONTNEED cannot drop dirty pages:
            # without fsync and without O_DIRECT reads (which then use the cache) it only
            # starts their write-back and the block stays cached.
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
            fd = -1
            os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
            if self.fsync:
                os.fsync(dfd)
        except StorageError:
            raise
        except OSError as e:
            if fd >= 0:
                os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dfd)
            raise StorageError(e.errno or _errno.EIO, f"writing block {key.hex()} to",
                               final) from None
        finally:
            os.close(dfd)
        self._count(writes=1, bytes_written=src.size)
        self._stored(key, on_disk)
        return True

    def _stored(self, key: bytes, on_disk: int) -> None:
        if self.index is not None:
            self.index.add(key)
        if self.upkeep is not None:
            self.ledger.wrote(key, on_disk)

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
        self._count(reads=1)
        try:
            problem = self._read_file(key, dst)
        except StorageError:
            raise
        except (_Unsafe, OSError) as e:
            self._missed(key, e)
            return False
        return self._outcome(key, dst, problem)

    def _outcome(self, key: bytes, dst: np.ndarray, problem: str | None) -> bool:
        """Count a checked read; a corrupt block is quarantined. True on a hit."""
        if problem is not None:
            self._count(corrupt_blocks=1)
            log.warning("corrupt block %s (%s): quarantined, treated as a miss",
                        self.path_of(key), problem)
            self._quarantine(key)
            return False
        self._hit(key, dst.size)
        return True

    def _hit(self, key: bytes, nbytes: int) -> None:
        # Not a hit record for the evictor: the lookup that planned this read recorded
        # one (leading), or the read queue's lease did, once per request and block.
        self._count(hits=1, bytes_read=nbytes)

    def _missed(self, key: bytes, e: BaseException) -> None:
        """Count (and, but for a plain miss, log) a read that found no usable block file."""
        path = self.path_of(key)
        if self.index is not None:
            self.index.discard(key)
        if isinstance(e, FileNotFoundError):
            self._count(misses=1)
            if self.ledger is not None and self.index is not None:
                # Every other index drops it too (it may still list it as stored).
                self.ledger.missed([key], now=self.upkeep is None)
        elif isinstance(e, _Unsafe):
            self._count(unsafe_paths=1)
            log.warning("block %s: %s; treated as a miss", path, e)
        else:
            self._count(read_errors=1)
            log.warning("reading block %s: %s; treating it as a miss", path, e)

    async def aread(self, key: bytes, out) -> bool:
        """:meth:`read_into` on the read pool."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._read_pool, self.read_into, key, out)

    def read_many(self, keys: Sequence[bytes], outs: Sequence) -> list[bool]:
        """Read blocks concurrently; one bool per key, in order. One batch on the io_uring
        ring of the calling thread where the kernel has it (:meth:`read_batch`), else the
        read pool's threads."""
        if len(keys) != len(outs):
            raise UsageError(f"{len(keys)} keys but {len(outs)} buffers")
        if self.batched:
            return self.read_batch(keys, outs)
        return list(self._read_pool.map(self.read_into, keys, outs))

    async def aread_many(self, keys: Sequence[bytes], outs: Sequence) -> list[bool]:
        """:meth:`read_many` off the event loop: the blocks handed to one of the store's
        ring readers (a thread, an io_uring ring of ``read_batch_depth`` reads in flight,
        fed by the batches it is handed and refilled as each read lands), those whose
        O_DIRECT read the filesystem refused read again buffered on the read pool; one
        batch on a read-pool thread where the ring cannot serve (O_DIRECT off, unaligned
        buffers); one read per block on the pool without io_uring. Cancelling the caller
        does not stop reads already handed over: it returns once they landed (they write
        into ``outs`` until then)."""
        if len(keys) != len(outs):
            raise UsageError(f"{len(keys)} keys but {len(outs)} buffers")
        if not keys:
            return []
        if not self.batched:
            return list(await asyncio.gather(*(self.aread(k, o) for k, o in zip(keys, outs))))
        dsts = [self._as_block(o, writable=True) for o in outs]
        ring = self._ring_reader() if self.direct and not any(
            d.ctypes.data % ALIGN for d in dsts) else None
        if ring is None:
            return await self.arun(self.read_batch, keys, outs)
        out = await to_the_end(asyncio.wrap_future(ring.submit(keys, dsts)))
        again = [j for j, ok in enumerate(out) if ok is None]
        if not again:
            return out
        # O_DIRECT refused here (now off): read them again, buffered, off the ring. A
        # plain future, not a task: a loop shutting down cancels tasks, not the thread.
        try:
            redo_f = asyncio.get_running_loop().run_in_executor(
                self._read_pool, self.read_batch, [keys[j] for j in again],
                [outs[j] for j in again])
        except RuntimeError:            # the store closed meanwhile (its pool shut down)
            return [bool(ok) for ok in out]
        for j, ok in zip(again, await to_the_end(redo_f)):
            out[j] = ok
        return out

    def _ring_reader(self) -> RingReader | None:
        """The next of the store's ``read_rings`` ring readers (batches take turns), all
        started by the first batch; None when batches are off (io_uring or openat2
        missing: logged once), read_rings is 0 (a ring per batch on the read pool) or
        the store is closed."""
        with self._lock:
            if self._rings:
                self._next_ring = (self._next_ring + 1) % len(self._rings)
                return self._rings[self._next_ring]
            if self._closed or not self._batched or self._ring_refused or not self.read_rings:
                return None
            try:
                for _ in range(self.read_rings):
                    self._rings.append(RingReader(self, self.read_batch_depth))
                return self._rings[0]
            except OSError as e:
                err = e.errno or _errno.EIO
                self._ring_refused = True
                rings, self._rings = self._rings, []
        for ring in rings:
            ring.close()
        if err in (_errno.ENOSYS, _errno.EPERM):
            self._no_batches(-err)
        else:
            log.warning("block store %s: no io_uring ring (%s); batches run one at a time",
                        self.dir, os.strerror(err))
        return None

    @property
    def root_fd(self) -> int:
        """The store root's directory descriptor (the rings open blocks beneath it)."""
        return self._root_fd

    @property
    def batched(self) -> bool:
        """Whether reads go in batches through the C loop (store_io.c): the kernel has
        io_uring and openat2 for us (checked by the first batch)."""
        return self._batched

    def read_batch(self, keys: Sequence[bytes], outs: Sequence) -> list[bool]:
        """Read blocks in one C call: each file opened beneath the store's root (no
        symlink followed) and read with O_DIRECT into its buffer, ``read_batch_depth``
        in flight on one io_uring ring; then each checked as :meth:`read_into` does.
        Blocks the calling thread; GIL released during the I/O."""
        if len(keys) != len(outs):
            raise UsageError(f"{len(keys)} keys but {len(outs)} buffers")
        dsts = [self._as_block(o, writable=True) for o in outs]
        direct = self.direct
        full = self.layout.full_bytes
        cut = direct_cut(full, direct)
        batch = [i for i, d in enumerate(dsts) if not (direct and d.ctypes.data % ALIGN)]
        out = [False] * len(keys)
        if batch:
            pages = self._scratch.pages_for(2 * len(batch))
            items, paths = self.sio_items([keys[i] for i in batch],
                                           [dsts[i][:cut] for i in batch], pages)
            key = self.integrity_key
            rc = lib.dp_sio_read(self._root_fd, items, len(batch), self.read_batch_depth,
                                 int(direct), key if key is not None else ffi.NULL,
                                 len(key or b""))
            del paths                          # kept alive through the call
            if rc in (-_errno.ENOSYS, -_errno.EPERM):
                self._no_batches(rc)
                return [self.read_into(k, o) for k, o in zip(keys, outs)]
            if rc < 0:
                raise StorageError(-rc, "reading a batch of blocks from", self.dir)
            retry = []
            for j, i in enumerate(batch):
                ok = self.sio_outcome(keys[i], dsts[i], items[j], pages[2 * j],
                                       pages[2 * j + 1], direct)
                if ok is None:
                    retry.append(i)                # buffered, by read_into
                else:
                    out[i] = ok
        else:
            retry = []
        in_batch = set(batch)
        for i in sorted(retry + [i for i in range(len(keys)) if i not in in_batch]):
            out[i] = self.read_into(keys[i], outs[i])
        return out

    def sio_outcome(self, key: bytes, dst: np.ndarray, it, header: np.ndarray,
                     tail: np.ndarray, direct: bool) -> bool | None:
        """Count and check one item the C read loop finished: True on a verified hit,
        False on a miss; None when O_DIRECT was refused (now off: read it again)."""
        if it.err == 0:
            self._count(reads=1)
            problem = self._check_file(key, dst, it.got, header, dst, tail, direct,
                                       it.hash if it.hashed else None, it.tag)
            return self._outcome(key, dst, problem)
        if direct and it.err == _errno.EINVAL and it.stage in (lib.DP_SIO_DIRECT,
                                                               lib.DP_SIO_READ):
            self._direct_unsupported(OSError(it.err, os.strerror(it.err)))
            return None
        self._count(reads=1)
        self._missed(key, _sio_error(it))
        return False

    def sio_items(self, keys: Sequence[bytes], bodies: Sequence[np.ndarray],
                   pages: np.ndarray):
        """The C read loop's items: block ``keys[j]`` read as [header page, ``bodies[j]``,
        tail page] (pages ``2j`` and ``2j + 1``), its payload hashed when checked; and the
        path strings they point to (keep them alive through the call)."""
        items = ffi.new("struct dp_sio_item[]", len(keys))
        paths = []
        for j, (key, body) in enumerate(zip(keys, bodies)):
            it = items[j]
            paths.append(ffi.new("char[]", "/".join(block_parts(key)).encode()))
            it.path = paths[-1]
            bufs = [pages[2 * j], body, pages[2 * j + 1]] if body.size else \
                [pages[2 * j], pages[2 * j + 1]]
            for k, b in enumerate(bufs):
                it.bufs[k] = ffi.cast("void *", b.ctypes.data)
                it.lens[k] = b.size
            it.nbufs = len(bufs)
            if self.verify_checksum or self.integrity_key is not None:
                it.hash_skip, it.hash_len = HEADER_BYTES, self.layout.full_bytes
        return items, paths

    def _no_batches(self, rc: int) -> None:
        with self._lock:
            if self._batched:
                self._batched = False
                log.warning("io_uring or openat2 is not available here (%s): block reads "
                            "use the read pool's threads", os.strerror(-rc))

    # --- reading a block layer by layer --------------------------------------------
    def layered(self) -> bool:
        """Whether :meth:`open_block` / :meth:`read_layer` can serve this store: each
        Layer Block is a whole number of O_DIRECT pages (or O_DIRECT is off)."""
        return not self.direct or self.layout.layer_bytes % ALIGN == 0

    def open_block(self, key: bytes) -> OpenBlock | None:
        """Open block ``key`` for :meth:`read_layer`: its header read and checked (magic,
        geometry, key, length). None when it is missing, unsafe or its header is bad
        (counted and, when bad, quarantined, as :meth:`read_into` does)."""
        path = self.path_of(key)
        self._count(reads=1)
        direct = self.direct
        try:
            fd = self._open_for_read(key, direct)
        except (_Unsafe, OSError) as e:
            self._missed(key, e)
            return None
        try:
            size = os.fstat(fd).st_size
            head = self._scratch.header
            got = _read_all(fd, [head], HEADER_BYTES, direct)
            problem = None
            if size != HEADER_BYTES + self.layout.full_bytes or got != HEADER_BYTES:
                problem = f"file holds {size} bytes, expected {HEADER_BYTES + self.layout.full_bytes}"
            else:
                problem, digest = check_header(head, self.profile.name, self.layout, key)
        except OSError as e:
            os.close(fd)
            self._count(read_errors=1)
            log.warning("reading block %s: %s; treating it as a miss", path, e)
            return None
        if problem is not None:
            os.close(fd)
            self._count(corrupt_blocks=1)
            log.warning("corrupt block %s (%s): quarantined, treated as a miss", path, problem)
            self._quarantine(key)
            return None
        return OpenBlock(key, fd, digest, bytes(head), direct)

    def read_layer(self, block: OpenBlock, layer: int, dst: np.ndarray) -> bool:
        """Read Layer Block ``layer`` of an open block into ``dst`` (page-aligned when
        O_DIRECT); False on a short read or an I/O error (the block is then bad)."""
        lb = self.layout.layer_bytes
        if dst.size != lb:
            raise UsageError(f"a layer of a {self.profile.name} block is {lb} bytes, got "
                             f"{dst.size}")
        if block.direct and dst.ctypes.data % ALIGN:
            raise UsageError("O_DIRECT layer reads need a page-aligned buffer")
        try:
            got = _read_all_at(block.fd, dst, HEADER_BYTES + layer * lb, block.direct)
        except OSError as e:
            if block.direct and e.errno == _errno.EINVAL:
                self._direct_unsupported(e)     # later blocks open without O_DIRECT
            log.warning("reading layer %d of block %s: %s", layer, self.path_of(block.key), e)
            return False
        return got == lb

    def close_block(self, block: OpenBlock) -> None:
        """Close an open block without verifying it (not needed after all; idempotent)."""
        if block.fd >= 0:
            os.close(block.fd)
            block.fd = -1

    def finish_block(self, block: OpenBlock, full: np.ndarray, ok: bool = True) -> bool:
        """Close an open block whose layers are all in ``full``: True when they verify
        (payload hash, integrity tag); a bad one is counted and quarantined."""
        self.close_block(block)
        if not ok:                           # an I/O error, not proof of a bad file
            self._count(read_errors=1)
            return False
        problem = None
        # With a cluster key the tag is the payload's check (it catches every accident
        # the XXH3 digest would, and forgeries): one pass over the bytes, not two.
        if self.verify_checksum and self.integrity_key is None and \
                payload_hash(full) != block.digest:
            problem = "payload hash mismatch"
        if problem is None and self.integrity_key is not None:
            problem = check_tag(block.header, self.integrity_key, full)
        if problem is not None:
            self._count(corrupt_blocks=1)
            log.warning("corrupt block %s (%s): quarantined, treated as a miss",
                        self.path_of(block.key), problem)
            self._quarantine(block.key)
            return False
        self._hit(block.key, full.size)
        return True

    async def arun(self, fn, *args):
        """``fn(*args)`` on the store's read pool (its blocking reads)."""
        return await asyncio.get_running_loop().run_in_executor(self._read_pool, fn, *args)

    def _read_file(self, key: bytes, dst: np.ndarray) -> str | None:
        """Read and check one file into ``dst``: the problem found, or None when good."""
        full = dst.size
        s = self._scratch
        direct = self.direct
        fd = self._open_for_read(key, direct)
        try:
            body = dst
            if direct:
                if dst.ctypes.data % ALIGN:
                    body = s.bounce_for(full)
                    self._count(bounce_reads=1)
                iov = [s.header, body[:direct_cut(full)], s.tail]
            else:
                iov = [s.header, dst, s.tail]  # the tail page only catches trailing bytes
            try:
                got = _read_all(fd, [v for v in iov if v.size], HEADER_BYTES + full, direct)
            except OSError as e:
                if not (direct and e.errno == _errno.EINVAL):
                    raise
                self._direct_unsupported(e)
                return self._read_file(key, dst)
        finally:
            os.close(fd)
        return self._check_file(key, dst, got, s.header, body, s.tail, direct)

    def _check_file(self, key: bytes, dst: np.ndarray, got: int, header: np.ndarray,
                    body: np.ndarray, tail: np.ndarray, direct: bool,
                    digest_read: int | None = None, tag_read: int = 0) -> str | None:
        """Check a file read as [header, body[:cut], tail] and put its payload in
        ``dst`` (from ``body`` when that was a bounce buffer, and the unaligned rest
        from ``tail``): the problem found, or None when good. ``digest_read``: the
        payload's XXH3-64 and ``tag_read`` its tag's verdict (1 equal, -1 not, 0 not
        computed) when the read already computed them (the C read loop)."""
        full = dst.size
        cut = direct_cut(full, direct)
        if got != HEADER_BYTES + full:
            return f"file holds {got} bytes, expected {HEADER_BYTES + full}"
        problem, digest = check_header(header, self.profile.name, self.layout, key)
        if problem is not None:
            return problem
        if cut != full:
            body[cut:full] = tail[:full - cut]
        if body is not dst:
            dst[:] = body[:full]
        if self.verify_checksum and self.integrity_key is None and (
                payload_hash(dst) if digest_read is None else digest_read) != digest:
            return "payload hash mismatch"
        if self.integrity_key is not None:
            return check_tag(header, self.integrity_key, dst, tag_read)
        return None

    def _open_for_read(self, key: bytes, direct: bool) -> int:
        """The block's file, opened without following a symlink anywhere below the root
        and only when it is a regular file (_Unsafe otherwise); O_DIRECT is set after
        that check, so only a real block file can say the filesystem refuses it."""
        try:
            dfd, name = self._block_dir(key)
        except OSError as e:
            if e.errno in (_errno.ELOOP, _errno.ENOTDIR):
                raise _Unsafe("a symlink or a file in place of its directory") from None
            raise
        try:
            fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK,
                         dir_fd=dfd)
        except OSError as e:
            if e.errno == _errno.ELOOP:
                raise _Unsafe("a symlink in place of the block") from None
            raise
        finally:
            os.close(dfd)
        try:
            mode = os.fstat(fd).st_mode
            if not stat.S_ISREG(mode):
                raise _Unsafe(f"not a regular file (mode {mode:o}) in place of the block")
            flags = os.O_RDONLY | os.O_CLOEXEC    # drop O_NONBLOCK (regular file: no-op)
            if direct:
                try:
                    fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT)
                except OSError as e:
                    if e.errno != _errno.EINVAL:
                        raise
                    self._direct_unsupported(e)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _quarantine(self, key: bytes) -> None:
        """Rename a corrupt block aside; for every index and the evictor it is gone."""
        if self.index is not None:
            self.index.discard(key)
        if self.upkeep is not None:
            self.upkeep.forget(key)
        if self.ledger is not None:
            self.ledger.evicted([key])
        try:
            dfd, name = self._block_dir(key)
        except OSError:
            return
        try:
            os.rename(name, name + ".corrupt", src_dir_fd=dfd, dst_dir_fd=dfd)
        except OSError as e:   # read-only store or already gone: the count and log remain
            log.debug("could not quarantine %s: %s", self.path_of(key), e)
        finally:
            os.close(dfd)

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
    def walk(self) -> Iterator[StoredBlock]:
        """Every block file of the store, in no order: its key, size and mtime (for
        eviction and scrubs; tree.py walk_blocks)."""
        return walk_blocks(self.dir)

    def sweep_temp(self, max_age_s: float = 600.0) -> int:
        """Remove ``.tmp`` files older than ``max_age_s`` (writers that died); returns count.

        On a shared mount another node may be writing right now: keep ``max_age_s``
        well above the longest write.
        """
        cutoff = time.time() - max_age_s
        removed = 0
        for tmp in self.dir.glob("*/*/.*.tmp"):
            if tmp.parent.is_symlink() or tmp.parent.parent.is_symlink() or \
                    tmp.is_symlink():
                continue   # never reach outside the store
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

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for k, v in deltas.items():
                setattr(self.stats, k, getattr(self.stats, k) + v)

    def stats_dict(self) -> dict[str, int]:
        with self._lock:
            out = asdict(self.stats)
        if self.index is not None:
            out.update(self.index.stats)
        if self.upkeep is not None:
            st = self.upkeep.stats
            out.update(evictions=st.evictions, evicted_bytes=st.evicted_bytes,
                       evictor_takeovers=st.takeovers, temp_swept=st.temp_swept)
        return out


def _read_all_at(fd: int, dst: np.ndarray, offset: int, direct: bool) -> int:
    """pread into ``dst`` from ``offset`` until it is full or EOF."""
    got = 0
    while got < dst.size:
        n = os.preadv(fd, [dst[got:]], offset + got)
        got += n
        if n == 0 or (direct and got % ALIGN):
            break
    return got


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


_sync_file_range = getattr(LIBC, "sync_file_range", None)
if _sync_file_range is not None:
    _sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
# SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE | SYNC_FILE_RANGE_WAIT_AFTER
_WRITE_AND_WAIT = 1 | 2 | 4


def _write_back(fd: int) -> None:
    """Write a file's dirty pages to the disk and wait for them, so they are clean and
    can be dropped (bounded write-back: no metadata and no cache flush, so not durable,
    as storage.fsync = false says); fdatasync where sync_file_range is missing."""
    if _sync_file_range is None or _sync_file_range(fd, 0, 0, _WRITE_AND_WAIT) != 0:
        os.fdatasync(fd)


def _write_all(fd: int, views: list[memoryview]) -> None:
    while views:
        n = os.writev(fd, views)
        while views and n >= len(views[0]):
            n -= len(views[0])
            views = views[1:]
        if views and n:
            views = [views[0][n:], *views[1:]]


class _Unsafe(Exception):
    """A symlink or a non-regular file on a block's path (a miss, never followed)."""


# openat2 beneath the root without symlinks: ELOOP for a symlink on the way, ENOTDIR for
# a file in place of a directory, EXDEV for a path that would leave the root.
_UNSAFE_OPEN = {_errno.ELOOP: "a symlink on the block's path",
                _errno.ENOTDIR: "a file in place of the block's directory",
                _errno.EXDEV: "a path leaving the store"}


def _sio_error(it) -> BaseException:
    """The exception :meth:`BlockStore._missed` counts for a failed batch item."""
    if it.stage == lib.DP_SIO_NOT_REGULAR:
        return _Unsafe("not a regular file in place of the block")
    if it.stage == lib.DP_SIO_OPEN and it.err in _UNSAFE_OPEN:
        return _Unsafe(_UNSAFE_OPEN[it.err])
    if it.err == _errno.ENOENT:
        return FileNotFoundError(it.err, os.strerror(it.err))
    return OSError(it.err, os.strerror(it.err))


