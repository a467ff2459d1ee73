"""The block-backend protocol: what a node asks of the storage its KV lives in.

Blocks are keyed by their chained prefix key (dualpath/kv/prefix.py) within one KV
format's namespace (a profile and block size: a backend is opened per format). One
implementation today: :class:`~dualpath.storage.store.BlockStore`, a POSIX directory on
a local disk or any shared mount (its io_uring reader is dualpath/storage/ring.py).
Another (an object store, a KV service) implements this protocol and is picked in
``StorageConfig.open_store``; every read still goes through the node's read queue
(dualpath/storage/read_queue.py: the storage-NIC limiter and read_q in one place).

A block is whole or absent to a reader; a corrupt one (its checksum or tag fails) is a
miss, never an error: the caller recomputes it. Errors that are not misses (a full or
read-only store on write) raise :class:`~dualpath.storage.errors.StorageError` with
errno.

Threads: every method may be called from any thread; the blocking ones from the
event loop through :meth:`BlockBackend.arun`.
"""

from __future__ import annotations

from collections.abc import Container, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class StoredBlock:
    """A block as the backend lists it (:meth:`BlockBackend.walk`)."""

    key: bytes
    nbytes: int                 # on disk, header included
    mtime: float                # last written (seconds since the epoch)


class BlockBackend(Protocol):
    read_workers: int           # concurrent reads it serves well (the read queue's jobs)

    # which leading keys exist
    def contains(self, key: bytes) -> bool:
        """Whether block ``key`` exists (advisory: only a read checks its bytes)."""

    def leading(self, keys: Sequence[bytes], held: Container[bytes] = ()) -> int:
        """How many leading ``keys`` exist or are in ``held`` (on their way in)."""

    def lease(self, keys: Sequence[bytes]) -> None:
        """``keys`` are named by a request in flight: hits, kept from eviction a while."""

    # read whole
    def read_batch(self, keys: Sequence[bytes], outs: Sequence) -> list[bool]:
        """Each block into its out buffer; False for a miss (absent or corrupt)."""

    # read layer by layer
    def layered(self) -> bool:
        """Whether :meth:`open_block` / :meth:`read_layer` serve layer reads."""

    def open_block(self, key: bytes) -> Any | None:
        """A block opened for layer reads (its header checked), or None for a miss."""

    def read_layer(self, block: Any, layer: int, dst) -> bool:
        """Layer ``layer`` of an opened block into ``dst``."""

    def finish_block(self, block: Any, full, ok: bool = True) -> bool:
        """Verify the whole block as read into ``full`` and close it; False: corrupt."""

    def close_block(self, block: Any) -> None:
        """Close an opened block unread (idempotent)."""

    # write, delete, walk
    def write(self, key: bytes, data, *, overwrite: bool = False) -> bool:
        """Persist one Full Block atomically; False when it existed already."""

    def delete(self, key: bytes) -> bool:
        """Remove block ``key``; False when it was not there."""

    def walk(self) -> Iterator[StoredBlock]:
        """Every stored block, in no order (for eviction and scrubs)."""

    # running
    async def arun(self, fn, *args):
        """``fn(*args)`` on the backend's read pool."""

    def stats_dict(self) -> dict[str, int]:
        """Its counters, for /metrics."""

    def close(self) -> None:
        """Wait for queued work and release everything (idempotent)."""
