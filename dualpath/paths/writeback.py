"""A DE node's write-back: new KV blocks on their way to storage, paced by the storage
NIC's write direction when given a limiter (the emulated engine's one persistence path;
paper §2: the decoding engines "store their KV-Cache in distributed storage to enable
reuse across turns"). The emulated DE gives it the node's limiter (a vLLM decode node's
saves are paced the same way, engines/vllm/engine.py).

A block comes in with the DE-buffer slot that holds it (its owner hands the slot over)
and goes out once written, through the write direction of the node's storage-NIC
limiter: writes never take the read direction's bandwidth (the NIC is full duplex,
storage/ratelimit.py) and go on after the request's last token, outside its latency.
A block's ``rank`` orders the queue (lower first, then in order of addition): the
emulated DE ranks a request's blocks by how many it writes, so the few blocks of a later
round are not queued behind a first round's whole prompt (shortest first, which lets the
most agents' next rounds start soonest; docs/e2e.md). Until a block is written this
node's own reads find it here (read-your-writes:
:meth:`dualpath.paths.kvspace.KvSpace.read` copies it instead of reading storage);
another node finds it missing and computes it (the degrade path of every read).

A block that cannot be written (disk full, I/O error) is skipped and counted: the
request is unaffected, only that block is not cached. :meth:`drain` waits until nothing
is pending; :meth:`close` waits a few seconds for that, then stops, leaving what is still
pending unwritten (a cache, not a journal: a later round computes it again).

Threads: the node's event loop; the store writes on its own pool.
"""

from __future__ import annotations

import asyncio
import itertools
import logging

import numpy as np

from dualpath.aio import waited_out
from dualpath.buffers.pool import Reservation
from dualpath.paths.pending import PendingBlocks
from dualpath.storage.format import HEADER_BYTES
from dualpath.storage.ratelimit import RateLimiter
from dualpath.storage.store import BlockStore

log = logging.getLogger("dualpath.node")

#: Blocks written at once (the store's write pool does the I/O).
WRITERS = 2


class WriteBack:
    """See the module docstring."""

    def __init__(self, store: BlockStore, limiter: RateLimiter | None,
                 pending: PendingBlocks, metrics=None, writers: int = WRITERS):
        self.store = store
        self.limiter = limiter
        self.metrics = metrics
        self.file_bytes = HEADER_BYTES + store.layout.full_bytes
        # The node's index of blocks on their way to disk (its KvSpace's): reads look
        # there; ``_pending`` is this write-back's own queue state, key -> its slot.
        self.index = pending
        self._pending: dict[bytes, Reservation] = {}
        self._done: dict[bytes, asyncio.Future] = {}
        self._queue: asyncio.PriorityQueue[tuple[int, int, bytes]] = asyncio.PriorityQueue()
        self._seq = itertools.count()
        self._writers = writers
        self._tasks: list[asyncio.Task] = []
        self._idle = asyncio.Event()
        self._idle.set()
        self._closed = False
        self.failed = 0

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, key: bytes, slot: Reservation, rank: int = 0) -> asyncio.Future:
        """Persist the block in ``slot`` (one slot, ownership passes here) under ``key``;
        the future resolves once it is written or skipped. Blocks of a lower ``rank`` go
        first, in order of addition within a rank."""
        done = self._done.get(key)
        if done is not None or self._closed:      # the same block again, or stopping
            slot.release()
            if done is None:
                done = asyncio.get_running_loop().create_future()
                done.set_result(None)
            return done
        done = self._done[key] = asyncio.get_running_loop().create_future()
        self._pending[key] = slot
        self.index.add(key, slot)
        self._queue.put_nowait((rank, next(self._seq), key))
        self._idle.clear()
        if not self._tasks:
            self._tasks = [asyncio.ensure_future(self._write())
                           for _ in range(self._writers)]
        return done

    def get(self, key: bytes) -> np.ndarray | None:
        """The bytes of ``key`` while it waits to be written (a view: copy it before
        awaiting anything), else None."""
        return self.index.get(key)

    async def _write(self) -> None:
        m = self.metrics
        while True:
            _, _, key = await self._queue.get()
            slot = self._pending.get(key)
            try:
                if slot is None:
                    continue
                if self.limiter is not None:
                    await self.limiter.acquire_write(self.file_bytes)
                write = asyncio.ensure_future(self.store.awrite(key, slot.flat(0)))
                try:
                    # A close() cancelling us waits for the write under way: its thread
                    # reads the slot until it is done.
                    await asyncio.shield(write)
                except asyncio.CancelledError:
                    await waited_out(write)
                    if not write.cancelled():
                        write.exception()    # retrieved: the stop is what matters now
                    raise
                except OSError as err:      # StorageError is one; the next block may fit
                    self.failed += 1
                    if m is not None:
                        m.persist_failed.inc()
                    if self.failed == 1 or self.failed % 100 == 0:
                        log.warning("not caching block %s (%d so far): %s", key.hex()[:16],
                                    self.failed, err)
                    continue
                if m is not None:
                    m.persisted.inc()
                    m.written_bytes.inc(self.store.layout.full_bytes)
            finally:
                if slot is not None and self._pending.get(key) is slot:
                    del self._pending[key]
                    self.index.remove(key, slot)
                    slot.release()
                    done = self._done.pop(key, None)
                    if done is not None and not done.done():
                        done.set_result(None)
                if not self._pending:
                    self._idle.set()

    async def drain(self, timeout_s: float | None = None) -> bool:
        """Wait until every block added so far is written (or skipped); False when
        ``timeout_s`` passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    async def close(self, drain_s: float = 5.0) -> None:
        """Stop writing (idempotent), after up to ``drain_s`` for what is pending; the
        slots of blocks still pending then go back unwritten."""
        if not self._closed and self._pending:
            await self.drain(drain_s)
        self._closed = True
        for t in self._tasks:
            t.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        for key, slot in self._pending.items():
            self.index.remove(key, slot)
            slot.release()
        self._pending.clear()
        for done in self._done.values():
            if not done.done():
                done.set_result(None)
        self._done.clear()
        self._idle.set()
