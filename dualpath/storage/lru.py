"""What to evict from a store over its bound: least recently hit first (pure code).

The core of the evictor (dualpath/storage/evictor.py feeds it the ledger's records and
the store's scan, and unlinks what it picks). Time is passed in, never read.

- Usage is the sum of every known block's bytes on disk.
- Recency: a block's last hit, or its write when never hit. A lookup that counts a block
  as a hit, and a read queue taking a request's blocks, are hits (the ledger's H
  records; once per request and block, not again at each read).
- A hit leases the block for ``lease_s``: a block a request's plan names (the lookup
  that planned it recorded the hit) is not picked until the lease ends, however old the
  rest of its recency is. A request whose read comes later than that may find it gone:
  its read misses and the tokens are recomputed (never wrong bytes).
- Over ``high`` x capacity (less a ``reserve``: what the writers may add before the
  evictor's next round), the least recent unleased blocks are picked until usage is at
  ``low`` x capacity (or the capacity less the reserve, when that is lower), or only
  leased blocks are left.
"""

from __future__ import annotations

from collections import OrderedDict


class LruCore:
    def __init__(self, capacity: int, *, high: float = 0.9, low: float = 0.8,
                 lease_s: float = 60.0):
        if capacity <= 0:
            raise ValueError(f"capacity must be > 0 bytes, got {capacity}")
        if not 0.0 < low <= high <= 1.0:
            raise ValueError(f"need 0 < low ({low}) <= high ({high}) <= 1")
        self.capacity = capacity
        self.high = high
        self.low = low
        self.lease_s = lease_s
        self.usage = 0
        self._blocks: OrderedDict[bytes, int] = OrderedDict()   # least recent first
        self._touched: dict[bytes, float] = {}
        self._leases: dict[bytes, float] = {}

    def __len__(self) -> int:
        return len(self._blocks)

    def clear(self) -> None:
        self.usage = 0
        self._blocks.clear()
        self._touched.clear()
        self._leases.clear()

    def __contains__(self, key: bytes) -> bool:
        return key in self._blocks

    def wrote(self, key: bytes, nbytes: int, now: float) -> None:
        """Block ``key`` is on disk with ``nbytes`` (again: its size is updated)."""
        old = self._blocks.get(key)
        self.usage += nbytes - (old or 0)
        self._blocks[key] = nbytes
        if old is None:
            self._touched[key] = now
        else:
            self._touch(key, now)

    def hit(self, key: bytes, now: float) -> float | None:
        """A hit on ``key``: most recent now, leased; the seconds since its last touch
        (its hit age), or None for a block not known here."""
        if key not in self._blocks:
            return None
        age = max(0.0, now - self._touched[key])
        self._touch(key, now)
        self._leases[key] = now + self.lease_s
        return age

    def _touch(self, key: bytes, now: float) -> None:
        self._blocks.move_to_end(key)
        self._touched[key] = now

    def removed(self, key: bytes) -> int:
        """Forget ``key`` (deleted, evicted, or found missing); its bytes."""
        n = self._blocks.pop(key, None)
        if n is None:
            return 0
        self.usage -= n
        del self._touched[key]
        self._leases.pop(key, None)
        return n

    def over(self, reserve: int = 0) -> bool:
        return self.usage + reserve > self.high * self.capacity

    def victims(self, now: float, reserve: int = 0) -> list[tuple[bytes, int]]:
        """The blocks to evict now, least recent first, each forgotten here (the caller
        removes them); [] while usage plus ``reserve`` (what writers may add before the
        next round) is under the high watermark."""
        if not self.over(reserve):
            return []
        goal = max(0.0, min(self.low * self.capacity, self.capacity - reserve))
        picked, freed = [], 0
        for key, nbytes in self._blocks.items():      # no copy: stops at the goal
            if self.usage - freed <= goal:
                break
            until = self._leases.get(key)
            if until is not None:
                if until > now:
                    continue
                del self._leases[key]
            picked.append(key)
            freed += nbytes
        return [(key, self.removed(key)) for key in picked]

    def oldest_age(self, now: float) -> float:
        """Seconds since the least recent block's last touch (0 when empty)."""
        for key in self._blocks:
            return max(0.0, now - self._touched[key])
        return 0.0
