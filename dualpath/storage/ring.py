"""The block store's ring readers (store_io.c ``dp_sio_ring``): a thread per ring that
feeds it the blocks of every batch handed over, so the disk never idles between
batches. A ring asks its store (:class:`RingStore`, the POSIX store in store.py) for the
items of a batch and for the outcome of each block that landed; it knows nothing else
of the store. Also the page arithmetic both share (``ALIGN``, ``direct_cut``,
``aligned_bytes``).
"""

from __future__ import annotations

import errno as _errno
import logging
import mmap
import os
import queue
import threading
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Protocol

import numpy as np

from dualpath._native import ffi, lib
from dualpath.kv.layout import BlockLayout
from dualpath.storage.errors import StorageError

log = logging.getLogger("dualpath.storage")

ALIGN = 4096          # O_DIRECT alignment of addresses, lengths and offsets we use


def direct_cut(full: int, direct: bool = True) -> int:
    """The payload bytes a read lands in the block's own buffer: all of them, or with
    O_DIRECT the whole pages (the rest, under ALIGN, lands in the tail page)."""
    return full - full % ALIGN if direct else full


def aligned_bytes(nbytes: int) -> np.ndarray:
    """A page-aligned, zero-filled uint8 array (anonymous mmap; freed with the array)."""
    return np.frombuffer(mmap.mmap(-1, max(nbytes, 1)), dtype=np.uint8)[:nbytes]


class RingStore(Protocol):
    """What a ring reader needs of its store."""

    dir: os.PathLike
    layout: BlockLayout
    integrity_key: bytes | None

    @property
    def root_fd(self) -> int: ...

    def sio_items(self, keys: Sequence[bytes], bodies: Sequence[np.ndarray],
                  pages: np.ndarray): ...

    def sio_outcome(self, key: bytes, dst: np.ndarray, it, header: np.ndarray,
                    tail: np.ndarray, direct: bool) -> bool | None: ...


class _RingBatch:
    """One aread_many's blocks handed to the ring reader: their items (header and tail
    pages of their own; built by the ring's thread, :meth:`prepare`), outcomes (None: the
    filesystem refused O_DIRECT, read it again) and the future the caller awaits."""

    def __init__(self, keys: Sequence[bytes], dsts: Sequence[np.ndarray]):
        self.keys, self.dsts = keys, dsts
        self.n = len(keys)
        self.next = 0                       # items pushed to the ring so far
        self.left = self.n                  # items not yet done
        self.out: list[bool | None] = [False] * self.n
        self.error: BaseException | None = None
        self.future: Future = Future()

    def prepare(self, store: RingStore, pages: np.ndarray, cut: int) -> None:
        self.pages = pages
        self.items, self.paths = store.sio_items(self.keys, [d[:cut] for d in self.dsts],
                                                  pages)


_SIO_ITEM = ffi.sizeof("struct dp_sio_item")


class RingReader:
    """One of the store's ring readers: a thread that owns a ``dp_sio_ring`` and feeds it
    the blocks of every batch handed to it (:meth:`submit`), each slot refilled from the
    ring's backlog as its read lands, so the disk never idles between batches or behind
    a batch's slowest read.

    The thread: builds the items of each batch that arrives (off the caller's event
    loop) and pushes them into the ring's backlog, steps the ring
    (wait for a landing, refill, hash what landed; a batch that arrives during the wait
    is pushed after it), checks each landed block as the store's own batches do (``sio_outcome``)
    and completes a batch's future when its last block is done. ``close()`` (idempotent)
    stops it once what was handed over has landed and frees the ring.
    Threads: submit from any thread; close from one."""

    BACKLOG = 4096              # items pushed to the ring, not yet opened

    def __init__(self, store: RingStore, depth: int):
        key = store.integrity_key
        ring = lib.dp_sio_ring_create(store.root_fd, depth, self.BACKLOG, 1,
                                      key if key is not None else ffi.NULL, len(key or b""))
        if ring == ffi.NULL:
            err = ffi.errno
            raise OSError(err, os.strerror(err))
        self.store, self.depth, self._ring = store, depth, ring
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._spare: list[np.ndarray] = []  # header/tail pages of finished batches (thread)
        self._closed = False
        self._close_lock = threading.Lock()     # a batch is queued before the stop or not
        self._thread = threading.Thread(target=self._run, name="dp-store-ring", daemon=True)
        self._thread.start()

    def submit(self, keys: Sequence[bytes], dsts: Sequence[np.ndarray]) -> Future:
        """Queue page-aligned block reads (O_DIRECT); a future of their outcomes."""
        b = _RingBatch(keys, dsts)
        b.future.set_running_or_notify_cancel()     # it cannot be cancelled: the ring
        with self._close_lock:                      # writes into dsts until it is done
            if self._closed:    # queued behind the stop, nothing would ever complete it
                raise StorageError(_errno.EBADF, "reading from the closed block store",
                                   self.store.dir)
            self._queue.put(b)
        return b.future

    def _pages(self, n: int) -> np.ndarray:
        for i, p in enumerate(self._spare):
            if len(p) >= n:
                return self._spare.pop(i)
        return aligned_bytes(max(n, 16) * ALIGN).reshape(-1, ALIGN)

    def close(self) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(None)
        self._thread.join()
        lib.dp_sio_ring_destroy(self._ring)

    def _run(self) -> None:
        waiting: deque[_RingBatch] = deque()        # batches not wholly pushed yet
        owner: dict[int, tuple[_RingBatch, int]] = {}
        done = ffi.new("struct dp_sio_item *[]", 2 * self.depth)
        cut = direct_cut(self.store.layout.full_bytes)
        stopping = False
        while True:
            busy = lib.dp_sio_ring_inflight(self._ring)
            if not busy and not waiting:
                if stopping:
                    return
                b = self._queue.get()               # idle: sleep until a batch comes
                if b is None:
                    return
                self._take(b, waiting, cut)
            while True:
                try:
                    b = self._queue.get_nowait()
                except queue.Empty:
                    break
                if b is None:
                    stopping = True
                else:
                    self._take(b, waiting, cut)
            # Every batch goes to the ring's backlog at once: its slots are refilled
            # from there as reads land, whoever's batch comes next.
            while waiting:
                b = waiting[0]
                pushed = lib.dp_sio_ring_push(self._ring, b.items + b.next, b.n - b.next)
                if pushed < 0:
                    self._fail(waiting, StorageError(-pushed, "queueing block reads for",
                                                     self.store.dir))
                    break
                base = int(ffi.cast("uintptr_t", b.items))
                for j in range(b.next, b.next + pushed):
                    owner[base + j * _SIO_ITEM] = (b, j)
                b.next += pushed
                if b.next < b.n:
                    break                           # the backlog is full
                waiting.popleft()
            got = lib.dp_sio_ring_step(self._ring, done, len(done), 1)
            if got < 0:
                log.error("block store %s: io_uring_enter failed: %s", self.store.dir,
                          os.strerror(-got))
                continue
            for k in range(got):
                b, j = owner.pop(int(ffi.cast("uintptr_t", done[k])))
                self._landed(b, j)

    def _take(self, b: _RingBatch, waiting: deque[_RingBatch], cut: int) -> None:
        """A batch that arrived: its items built here, then it waits for the ring."""
        pages = self._pages(2 * b.n)
        try:
            b.prepare(self.store, pages, cut)
        except Exception as e:  # noqa: BLE001 - handed to the batch's caller
            self._spare.append(pages)
            b.future.set_exception(e)
            return
        waiting.append(b)

    def _fail(self, waiting: deque[_RingBatch], e: BaseException) -> None:
        """Give up on the items not pushed yet (the ring refused them)."""
        log.error("%s", e)
        while waiting:
            b = waiting.popleft()
            b.error = e
            b.left -= b.n - b.next
            b.next = b.n
            self._finish(b)

    def _landed(self, b: _RingBatch, j: int) -> None:
        try:
            # None (O_DIRECT refused): aread_many reads it again, off this thread.
            b.out[j] = self.store.sio_outcome(b.keys[j], b.dsts[j], b.items[j],
                                               b.pages[2 * j], b.pages[2 * j + 1], True)
        except BaseException as e:          # noqa: BLE001 - handed to the batch's caller
            b.error = b.error or e
        b.left -= 1
        self._finish(b)

    def _finish(self, b: _RingBatch) -> None:
        if b.left:
            return
        self._spare.append(b.pages)
        if b.error is not None:
            b.future.set_exception(b.error)
        else:
            b.future.set_result(b.out)
