"""A node's queue of storage reads, measured in tokens (the scheduler's ``read_q``).

The scheduler picks the reading side by comparing how much each node still has to read
(paper §5, ``read_q``); its currency is tokens, so the queue counts the tokens of every
block that is queued or in flight and drops them as each block lands. Reads are served
FIFO by ``depth`` concurrent readers, each first taking the block's bytes from the
node's storage-NIC limiter (when one is set), then reading through the BlockStore's
worker pool. Without a limit, a reader takes the blocks queued behind its own as one
batch for the store's ring readers (``BlockStore.aread_many``: io_uring rings that
outlive the batches, the readers' batches taking turns, each ring refilled as its reads
land).

Threads: one asyncio loop owns a ReadQueue; call everything from that loop.
The scheduler also needs reads that are certain but not queued yet (a request waiting
for a prefill slot or buffer space), or it piles more work on a queue that only looks
short: :meth:`ReadQueue.expect` counts a request's tokens until its ``read()`` queues
them (or :meth:`ReadQueue.forget` drops them), so ``read_q_tokens`` holds both.

Layer by layer (:meth:`ReadQueue.open_layers`): a vLLM node reads its own part of a hit
a layer at a time, so layer 0 is in place after 1/L of the read and the rest overlaps
the engine's compute. Those reads go through here too: their bytes from the same
limiter, a layer of all the request's blocks at a time, and their tokens in read_q
until they landed.

Request lifecycle: ``read()`` enqueues blocks -> readers take them FIFO -> each block
lands (hit or miss) -> ``read()`` returns. Only a request's leading intact blocks are
usable, so once one of its blocks is a miss its blocks still queued are not read (they
report misses); under a storage-NIC limit a block is looked up before its bytes are
taken from the limiter, so a block that is not there costs the NIC nothing (a block
still in write-back elsewhere, say). If the caller is cancelled or a block fails
with an error, the request's queued blocks are dropped and ``read()`` waits for its
in-flight blocks before returning: once it returns, nothing writes to its buffers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from dualpath.aio import all_landed
from dualpath.errors import UsageError
from dualpath.storage.format import HEADER_BYTES
from dualpath.storage.ratelimit import RateLimiter
from dualpath.storage.store import BlockStore


@dataclass
class _Request:
    """One ``read()``'s blocks: where its first miss is, and how many were read."""

    hole: int = 1 << 62                 # index of its first block found missing or bad
    read_blocks: int = 0                # blocks whose bytes were read (hit or corrupt)

    def landed(self, index: int, ok: bool) -> None:
        if not ok:
            self.hole = min(self.hole, index)


@dataclass
class _Job:
    key: bytes
    out: object
    result: asyncio.Future
    finished: asyncio.Future
    request: _Request
    index: int
    running: bool = False

    def useless(self) -> bool:
        """Cancelled, or past its request's first miss (never usable)."""
        return self.result.cancelled() or self.index > self.request.hole


@dataclass(frozen=True)
class ReadResult:
    """Per-block outcome of one request's read, in block order."""

    hits: list[bool]                    # past the first miss: False (maybe unread)
    block_tokens: int
    read_blocks: int = 0                # blocks whose bytes came off storage

    @property
    def hit_tokens(self) -> int:
        """Tokens of the leading run of blocks that arrived intact (usable prefix)."""
        n = 0
        for ok in self.hits:
            if not ok:
                break
            n += 1
        return n * self.block_tokens

    @property
    def all_hit(self) -> bool:
        return all(self.hits)


@dataclass
class ReadQueue:
    """Per-node FIFO of block reads; ``read_q_tokens`` is its length in tokens."""

    store: BlockStore
    limiter: RateLimiter | None = None
    depth: int = 0                      # concurrent reads; 0 = the store's read workers
    _queue: asyncio.Queue | None = field(default=None, init=False, repr=False)
    _readers: list[asyncio.Task] = field(default_factory=list, init=False, repr=False)
    _tokens: int = field(default=0, init=False)
    _blocks: int = field(default=0, init=False)
    _expected: dict[str, int] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.depth < 0:
            raise UsageError(f"read queue depth must be >= 0, got {self.depth}")
        self.depth = self.depth or self.store.read_workers
        self.block_tokens = self.store.profile.block_tokens
        self.file_bytes = HEADER_BYTES + self.store.layout.full_bytes

    @property
    def read_q_tokens(self) -> int:
        """Tokens of blocks queued, being read, or expected (see :meth:`expect`) on this
        node: the scheduler's read_q."""
        return self._tokens + sum(self._expected.values())

    def expect(self, request_id: str, tokens: int) -> None:
        """Count ``tokens`` that request ``request_id`` will read here (replaces an
        earlier expectation of the same request)."""
        if tokens < 0:
            raise UsageError(f"expected read tokens must be >= 0, got {tokens}")
        self._expected[request_id] = tokens

    def forget(self, request_id: str) -> None:
        """Drop the expectation of ``request_id`` (it will not read here). Idempotent."""
        self._expected.pop(request_id, None)

    @property
    def read_q_blocks(self) -> int:
        return self._blocks

    async def read(self, keys: Sequence[bytes], outs: Sequence, *,
                   request_id: str = "") -> ReadResult:
        """Read ``keys`` into ``outs`` (one Full Block buffer each) FIFO; per-block hits.
        ``request_id``'s expectation, if any, ends here: its tokens are queued now."""
        if len(keys) != len(outs):
            raise UsageError(f"{len(keys)} keys but {len(outs)} buffers")
        self.forget(request_id)
        self.store.lease(keys)          # named by a plan in flight: not evicted under it
        self._start()
        loop = asyncio.get_running_loop()
        req = _Request()
        jobs = [_Job(k, o, loop.create_future(), loop.create_future(), req, i)
                for i, (k, o) in enumerate(zip(keys, outs))]
        self._tokens += len(jobs) * self.block_tokens
        self._blocks += len(jobs)
        for job in jobs:
            self._queue.put_nowait(job)
        try:
            hits = await asyncio.gather(*(j.result for j in jobs))
        except BaseException:
            for j in jobs:
                j.result.cancel()          # readers skip cancelled jobs still queued
            running = [j.finished for j in jobs if j.running and not j.finished.done()]
            if running:
                await asyncio.wait(running)
            raise
        return ReadResult(list(hits), self.block_tokens, req.read_blocks)

    def _start(self) -> None:
        if self._queue is None:
            self._queue = asyncio.Queue()
            self._readers = [asyncio.create_task(self._reader(), name=f"read-queue-{i}")
                             for i in range(self.depth)]

    async def _reader(self) -> None:
        while True:
            jobs = [await self._queue.get()]
            # Blocks queued behind it go with it as one batch, up to the store's batch
            # depth, to the store's ring readers (a lone block too: each ring keeps
            # read_batch_depth reads in flight across the batches it is handed). Under a
            # storage-NIC limit one at a time on the store's threads: a batch would wait
            # for all its bytes before its first block.
            limit = self.store.read_batch_depth if self.store.batched and (
                self.limiter is None or self.limiter.unlimited) else 1
            while len(jobs) < limit and not self._queue.empty():
                jobs.append(self._queue.get_nowait())
            try:
                live = self._skip(jobs)
                if not live:
                    continue
                for j in live:
                    j.running = True
                try:
                    if self.limiter is not None and not self.limiter.unlimited:
                        live = await self._present(live)
                        if not live:
                            continue
                        await self.limiter.acquire(self.file_bytes * len(live))
                    for j in live:
                        j.request.read_blocks += 1
                    if limit == 1:
                        oks = [await self.store.aread(live[0].key, live[0].out)]
                    else:
                        oks = await self.store.aread_many([j.key for j in live],
                                                          [j.out for j in live])
                except Exception as e:  # noqa: BLE001 - handed to the requests; reader lives on
                    for j in live:
                        if not j.result.done():
                            j.result.set_exception(e)
                else:
                    for j, ok in zip(live, oks):
                        j.request.landed(j.index, ok)
                        if not j.result.done():
                            j.result.set_result(ok)
            finally:
                for j in jobs:
                    self._tokens -= self.block_tokens
                    self._blocks -= 1
                    j.finished.set_result(None)

    @staticmethod
    def _skip(jobs: list[_Job]) -> list[_Job]:
        """The jobs worth reading; those past their request's first miss report a miss
        unread."""
        live = []
        for j in jobs:
            if not j.useless():
                live.append(j)
            elif not j.result.done():
                j.result.set_result(False)
        return live

    async def _present(self, jobs: list[_Job]) -> list[_Job]:
        """The jobs whose block is there; the others are misses, found without taking
        their bytes from the limiter (a later read of a block removed meanwhile is an
        ordinary miss)."""
        found = await self.store.arun(lambda: [self.store.contains(j.key) for j in jobs])
        for j, ok in zip(jobs, found):
            if not ok:
                j.request.landed(j.index, False)
                if not j.result.done():
                    j.result.set_result(False)
        return [j for j, ok in zip(jobs, found) if ok]

    async def open_layers(self, keys: Sequence[bytes], *, request_id: str = "") -> LayerRead:
        """Open ``keys`` for a read layer by layer (the store must be ``layered()``):
        the leading blocks found (a missing one ends them) are opened, counted in read_q
        from now until :meth:`LayerRead.run` read them or :meth:`LayerRead.close`.
        ``request_id``'s expectation, if any, ends here."""
        store = self.store
        self.forget(request_id)
        opened = await all_landed(store.arun(store.open_block, k) for k in keys)
        found = next((i for i, b in enumerate(opened) if b is None), len(keys))
        for b in opened[found:]:
            if b is not None:
                store.close_block(b)             # past the hole: unused
        read = LayerRead(self, opened[:found])
        self._tokens += found * self.block_tokens
        self._blocks += found
        return read

    def _landed(self, blocks: int) -> None:
        self._tokens -= blocks * self.block_tokens
        self._blocks -= blocks

    async def close(self) -> None:
        """Stop the readers (idempotent); call when no ``read()`` is pending."""
        for t in self._readers:
            t.cancel()
        if self._readers:
            await asyncio.gather(*self._readers, return_exceptions=True)
        self._readers = []
        self._queue = None


class LayerRead:
    """Blocks opened for a read layer by layer (:meth:`ReadQueue.open_layers`); its
    owner runs it once or closes it."""

    def __init__(self, queue: ReadQueue, blocks: list):
        self.queue, self.blocks = queue, blocks
        self.found = len(blocks)

    async def run(self, outs: Sequence[np.ndarray], layers: int, layer_bytes: int,
                  landed: Callable[[int], None],
                  as_read: Callable[[int, np.ndarray], np.ndarray] | None = None
                  ) -> list[bool]:
        """Read every block into its Full Block buffer ``outs[i]``, layer ``l`` of all of
        them before layer ``l + 1`` (each layer's bytes from the limiter first);
        ``landed(l + 1)`` once layer ``l`` of every block is in. Then each block's
        payload is verified (``as_read(i, outs[i])``: the bytes to check, by default
        ``outs[i]``): True per block that was read whole and intact. On an error or a
        cancel, returns or raises only once no read writes into ``outs`` any more."""
        q, store, blocks = self.queue, self.queue.store, self.blocks
        if len(outs) != len(blocks):
            raise UsageError(f"{len(blocks)} blocks opened but {len(outs)} buffers")
        # One pool job reads a layer of several blocks (a job per block and layer cost
        # the loop ~1,000 executor round trips for a 2K-token SmolLM2 hit), as many jobs
        # per layer as the pool has readers, so the disk still sees that many reads.
        n = len(blocks)
        per = -(-n // store.read_workers) if n else 1
        chunks = [range(j, min(j + per, n)) for j in range(0, n, per)]
        lb = layer_bytes

        def read_chunk(chunk: range, layer: int) -> list[bool]:
            return [store.read_layer(blocks[i], layer,
                                     outs[i][layer * lb:(layer + 1) * lb]) for i in chunk]
        good = [True] * n
        try:
            for layer in range(layers):
                if q.limiter is not None:
                    await q.limiter.acquire(lb * n)
                got = await all_landed(store.arun(read_chunk, c, layer) for c in chunks)
                for i, g in enumerate(g for part in got for g in part):
                    good[i] = good[i] and g
                landed(layer + 1)
            return await all_landed(
                store.arun(store.finish_block, b,
                           as_read(i, outs[i]) if as_read is not None else outs[i], good[i])
                for i, b in enumerate(blocks))
        finally:
            self.close()

    def close(self) -> None:
        """Close the blocks (those not verified: unread) and take them out of read_q
        (idempotent)."""
        for b in self.blocks:
            self.queue.store.close_block(b)
        if self.found:
            self.queue._landed(self.found)
            self.found = 0
