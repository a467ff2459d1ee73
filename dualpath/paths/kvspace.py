"""A node's KV of one byte format: its store namespace, read queue and DRAM pool.

Every KV byte a node moves has one format (dualpath/kv/placement.py: layers, units,
segment rows). The emulated engine knows it at start-up from its model profile; a vLLM
engine only once its worker attached and described its KV tensors. :class:`KvSpace`
binds the pieces that depend on the format: the block store's namespace for it, the read
queue in front of that store (behind the node's storage-NIC limiter) and a Full Block
pool carved from the node's pinned DRAM region, with that pool's placement (what peers
need to WRITE into it).

Threads: the node's event loop; the store runs its I/O on its own worker pools.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from dualpath.buffers.pool import BlockPool, Reservation
from dualpath.buffers.region import PinnedRegion
from dualpath.errors import UsageError
from dualpath.kv.placement import KvFormat, KvPlacement
from dualpath.kv.profiles import geometry_profile
from dualpath.paths.pending import PendingBlocks
from dualpath.storage.config import StorageConfig
from dualpath.storage.ratelimit import RateLimiter
from dualpath.storage.read_queue import ReadQueue
from dualpath.storage.store import BlockStore
from dualpath.transfer import Grant, TransferEngine


@dataclass(frozen=True)
class ReadOutcome:
    """What one request's hit read brought: ``usable`` leading blocks arrived intact (the
    rest are missing or corrupt: recompute them), ``nbytes`` read from storage (blocks
    found missing, or skipped past the first miss, read nothing), the wall-clock span."""

    usable: int
    blocks: int
    nbytes: int
    span: tuple[float, float]

    @property
    def complete(self) -> bool:
        return self.usable == self.blocks


class KvSpace:
    """See the module docstring. ``close()`` stops the read queue and the store."""

    def __init__(self, fmt: KvFormat, store: BlockStore, read_queue: ReadQueue,
                 pool: BlockPool, buffer: KvPlacement, region_name: str):
        self.fmt = fmt
        self.layout = fmt.block_layout()
        self.store = store
        self.read_queue = read_queue
        self.pool = pool
        self.buffer = buffer         # placement of the pool's slots in the node's region
        self.buffer_region = region_name     # that region's name in the transfer engine
        # The node's blocks on their way to storage, whoever writes them (pending.py):
        # its reads find them here.
        self.pending = PendingBlocks()
        # An emulated DE's write-back (paths/writeback.py), which registers its blocks in
        # ``pending``; a vLLM engine registers its saves there itself.
        self.writeback = None

    @classmethod
    def open(cls, storage: StorageConfig, namespace: str, fmt: KvFormat, *,
             region: PinnedRegion, region_name: str, limiter: RateLimiter | None,
             dtype: str = "opaque") -> KvSpace:
        """Open the store namespace ``namespace`` and carve the pool from ``region`` (which
        is registered with the node's transfer engine as ``region_name``)."""
        layout = fmt.block_layout()
        profile = geometry_profile(namespace, layout.layers, layout.token_bytes,
                                   layout.tokens, dtype)
        store = storage.open_store(profile)
        pool = BlockPool(region_name, region.array, layout, region_addr=region.addr,
                         key=f"buffers.{region_name}_mib")
        buffer = KvPlacement.full_blocks(fmt, region_name, pool.stride, pool.capacity)
        return cls(fmt, store, ReadQueue(store, limiter), pool, buffer, region_name)

    @classmethod
    def for_store(cls, store: BlockStore, read_queue: ReadQueue, pool: BlockPool,
                  region_name: str) -> KvSpace:
        """The emulated engine's space: a store and pool already made for its profile."""
        fmt = KvFormat.flat(pool.layout)
        return cls(fmt, store, read_queue, pool,
                   KvPlacement.full_blocks(fmt, region_name, pool.stride, pool.capacity),
                   region_name)

    def grant(self, transfer: TransferEngine, peer: str, res: Reservation, first: int = 0,
              stop: int | None = None) -> Grant:
        """Let ``peer`` (an identity, ``node/<id>``) WRITE into blocks ``[first, stop)``
        of ``res`` (one request's slots) and nowhere else in the buffer, until the grant
        is closed (docs/security.md, "The data plane's scope"). "" (plaintext): no
        grant, as the region is not scoped then."""
        stop = len(res) if stop is None else stop
        if stop <= first:
            return transfer.grant(peer, self.buffer_region, [])
        if not peer and transfer.scoped(self.buffer_region):
            raise UsageError(f"no identity to grant {self.buffer_region} slots to: a scoped "
                             "buffer refuses every WRITE of a writer without a grant")
        if not peer:
            return transfer.grant(peer, self.buffer_region, [])
        stride = self.pool.stride
        return transfer.grant(peer, self.buffer_region,
                              [(res.offset(i), stride) for i in range(first, stop)])

    def buffer_units(self, res: Reservation) -> list[int]:
        """Unit ids (for :func:`dualpath.kv.placement.runs`) of a reservation's blocks."""
        return self.buffer.units_of_slots(res.slots)

    async def read(self, request_id: str, keys: list[bytes], res: Reservation,
                   slots: list[int] | None = None) -> ReadOutcome:
        """Read ``keys`` into blocks ``slots`` (default: the first ``len(keys)``) of
        ``res`` through the read queue (ending ``request_id``'s expectation there);
        blocks still in this node's write-back are copied from it instead (no storage
        read, no storage-NIC bytes)."""
        t0 = time.time()
        slots = list(range(len(keys))) if slots is None else slots
        copied = set()
        pending = self.pending
        if len(pending):
            for i, key in enumerate(keys):
                src = pending.get(key)
                if src is not None:
                    np.copyto(res.flat(slots[i]), src)
                    copied.add(i)
        rest = [i for i in range(len(keys)) if i not in copied]
        got = await self.read_queue.read([keys[i] for i in rest],
                                         [res.flat(slots[i]) for i in rest],
                                         request_id=request_id)
        hits = [True] * len(keys)
        for i, ok in zip(rest, got.hits):
            hits[i] = ok
        usable = next((i for i, ok in enumerate(hits) if not ok), len(keys))
        return ReadOutcome(usable, len(keys), got.read_blocks * self.layout.full_bytes,
                           (t0, time.time()))

    async def close(self) -> None:
        await self.read_queue.close()
        self.store.close()
