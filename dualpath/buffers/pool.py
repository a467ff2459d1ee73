"""PE and DE buffers: fixed pools of Full Block slots with per-request reservations.

A :class:`BlockPool` is a slice of the process's :class:`PinnedRegion` cut into slots of
one Full Block each (stride rounded up to 4096 bytes so every slot is O_DIRECT-aligned
and a storage read lands in it directly). A request reserves the slots it needs, uses
them (storage reads, layerwise RDMA), and releases them.

Backpressure: the pool never grows. When too few slots are free, ``reserve`` waits;
waiters are served strictly first come, first served (a small request does not overtake
a large one that is waiting, so nobody starves). A request for more slots than the pool
has fails at once with :class:`PoolTooSmall` instead of waiting forever.

Reservation life cycle: granted -> (used) -> released. ``release()`` is idempotent;
a Reservation is also a context manager.

Threads: a pool is owned by one asyncio loop; reserve and release on that loop.
"""

from __future__ import annotations

import asyncio
import heapq
from collections import deque
from typing import Self

import numpy as np

from dualpath.buffers.region import PinnedRegion, Register
from dualpath.errors import UsageError
from dualpath.kv.layout import BlockLayout
from dualpath.kv.profiles import ModelProfile

SLOT_ALIGN = 4096


class PoolTooSmall(UsageError):
    """A reservation asks for more slots than the pool has in total."""


def slot_stride(layout: BlockLayout) -> int:
    """Bytes between slot starts: a Full Block rounded up to SLOT_ALIGN."""
    return -(-layout.full_bytes // SLOT_ALIGN) * SLOT_ALIGN


class Reservation:
    """Slots held by one request. Block ``i`` of the request lives in slot ``slots[i]``."""

    def __init__(self, pool: BlockPool, slots: list[int]):
        self.pool = pool
        self.slots = tuple(slots)
        self._released = False
        self._handed: set[int] = set()    # blocks moved to reservations of their own

    def __len__(self) -> int:
        return len(self.slots)

    @property
    def released(self) -> bool:
        return self._released

    def offset(self, i: int) -> int:
        """Byte offset of block ``i`` in the pool's region (RDMA: region addr + offset)."""
        return self.pool.region_offset + self.slots[i] * self.pool.stride

    def addr(self, i: int) -> int:
        """Virtual address of block ``i`` (inside the registered region)."""
        return self.pool.region_addr + self.offset(i)

    def flat(self, i: int) -> np.ndarray:
        """Block ``i``'s Full Block bytes as a flat uint8 view."""
        self._check_live()
        if i in self._handed:
            raise UsageError(f"block {i} was handed over to a reservation of its own")
        s = self.slots[i] * self.pool.stride
        return self.pool.memory[s:s + self.pool.layout.full_bytes]

    def block(self, i: int) -> np.ndarray:
        """Block ``i`` as a ``[layers, tokens, bytes]`` view."""
        return self.flat(i).reshape(self.pool.layout.full_shape)

    def blocks(self) -> list[np.ndarray]:
        return [self.block(i) for i in range(len(self.slots))]

    def hand_over(self, blocks) -> list[Reservation]:
        """Move ``blocks`` (indices) each into a one-slot reservation of its own (its new
        owner releases it); this one keeps and later releases the rest."""
        self._check_live()
        out = []
        for i in blocks:
            if i in self._handed or not 0 <= i < len(self.slots):
                raise UsageError(f"block {i} cannot be handed over")
            self._handed.add(i)
            out.append(Reservation(self.pool, [self.slots[i]]))
        return out

    def hand_over_range(self, first: int, stop: int) -> Reservation:
        """Move blocks ``[first, stop)`` into one reservation of their own (its block i is
        block ``first + i`` here; its new owner releases it); this one keeps and later
        releases the rest."""
        self._check_live()
        idx = range(first, stop)
        if not 0 <= first < stop <= len(self.slots) or any(i in self._handed for i in idx):
            raise UsageError(f"blocks [{first}, {stop}) cannot be handed over")
        self._handed.update(idx)
        return Reservation(self.pool, [self.slots[i] for i in idx])

    def release(self) -> None:
        """Give the slots back (idempotent); waiting reservations may then proceed."""
        if not self._released:
            self._released = True
            self.pool._free([s for i, s in enumerate(self.slots) if i not in self._handed])

    def _check_live(self) -> None:
        if self._released:
            raise UsageError("reservation already released")

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class BlockPool:
    """Fixed Full Block slots over ``memory`` (a view into a pinned region)."""

    def __init__(self, name: str, memory: np.ndarray, layout: BlockLayout, *,
                 region_addr: int = 0, region_offset: int = 0, key: str = ""):
        self.name = name
        self.key = key          # the config key that sizes it (named when it is too small)
        self.layout = layout
        self.stride = slot_stride(layout)
        self.capacity = memory.size // self.stride
        if self.capacity < 1:
            raise UsageError(f"{name}: {memory.size} bytes hold no {layout.full_bytes}-byte "
                             f"block; make the buffer larger")
        self.memory = memory
        self.region_addr = region_addr
        self.region_offset = region_offset
        self._free_slots = list(range(self.capacity))    # a heap: lowest slots first
        self._waiters: deque[tuple[int, asyncio.Future]] = deque()

    @property
    def free(self) -> int:
        return len(self._free_slots)

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def try_reserve(self, nblocks: int) -> Reservation | None:
        """Reserve now or return None (also None while others wait: no barging)."""
        self.check_size(nblocks)
        if self._waiters or nblocks > len(self._free_slots):
            return None
        return self._take(nblocks)

    async def reserve(self, nblocks: int) -> Reservation:
        """Reserve ``nblocks`` slots, waiting (FIFO) while the pool is short."""
        got = self.try_reserve(nblocks)
        if got is not None:
            return got
        fut = asyncio.get_running_loop().create_future()
        entry = (nblocks, fut)
        self._waiters.append(entry)
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                fut.result().release()          # granted just as we were cancelled
            elif entry in self._waiters:
                self._waiters.remove(entry)
                self._grant()                   # the head may have changed
            raise

    def check_size(self, nblocks: int) -> None:
        """PoolTooSmall unless a reservation of ``nblocks`` can ever be granted (a caller
        that sizes a request checks before any per-block work)."""
        if nblocks < 1:
            raise UsageError(f"{self.name}: reserve at least one block, got {nblocks}")
        if nblocks > self.capacity:
            fix = (f"raise {self.key} (now {self.memory.size >> 20} MiB; {nblocks} blocks "
                   f"need {-(-nblocks * self.stride // (1 << 20))} MiB)" if self.key
                   else "enlarge the buffer or split the request")
            raise PoolTooSmall(f"{self.name}: a request needs {nblocks} blocks of "
                               f"{self.layout.full_bytes} bytes but the pool holds "
                               f"{self.capacity}; {fix}")

    def _take(self, n: int) -> Reservation:
        return Reservation(self, [heapq.heappop(self._free_slots) for _ in range(n)])

    def _free(self, slots) -> None:
        for s in slots:
            heapq.heappush(self._free_slots, s)
        self._grant()

    def _grant(self) -> None:
        while self._waiters:
            n, fut = self._waiters[0]
            if fut.cancelled():
                self._waiters.popleft()
                continue
            if n > len(self._free_slots):
                return
            self._waiters.popleft()
            fut.set_result(self._take(n))


class NodeBuffers:
    """The PE buffer and the DE buffer of one process, carved from one pinned region."""

    def __init__(self, profile: ModelProfile, *, pe_bytes: int, de_bytes: int,
                 huge_pages: str = "auto", lock: bool = True, register: Register | None = None):
        layout = BlockLayout.of(profile)
        stride = slot_stride(layout)
        pe = -(-pe_bytes // stride) * stride if pe_bytes else 0
        de = -(-de_bytes // stride) * stride if de_bytes else 0
        if pe + de == 0:
            raise UsageError("PE and DE buffers are both empty")
        self.region = PinnedRegion(pe + de, huge_pages=huge_pages, lock=lock, register=register,
                                   what="PE/DE buffers")
        self.pe = (BlockPool("PE buffer", self.region.view(0, pe), layout,
                             region_addr=self.region.addr, region_offset=0) if pe else None)
        self.de = (BlockPool("DE buffer", self.region.view(pe, de), layout,
                             region_addr=self.region.addr, region_offset=pe) if de else None)

    @classmethod
    def from_config(cls, cfg, profile: ModelProfile,
                    register: Register | None = None) -> NodeBuffers:
        """From a :class:`dualpath.buffers.config.BuffersConfig`."""
        return cls(profile, pe_bytes=cfg.pe_buffer_mib << 20, de_bytes=cfg.de_buffer_mib << 20,
                   huge_pages=cfg.huge_pages, lock=cfg.mlock, register=register)

    def close(self) -> None:
        """Close the region (idempotent); reservations must have been released."""
        self.pe = self.de = None
        self.region.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
