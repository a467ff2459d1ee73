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
- Groups with quotas: a block is its tenant account's (the tag its key carries:
  dualpath/kv/prefix.py key_tag) and its namespace's (the evictor prefixes each key with
  its namespace's id: :func:`space_of`). A group whose usage plus a reserve (what the
  writers may add to it in a round, at most half its quota) passes ``high`` x its quota
  loses its own least recent unleased blocks down to ``low`` x its quota (or the quota
  less the reserve) first, whatever the rest of the store holds: one tenant's or one
  model's working set never pushes another's out past its quota, and a group at its
  quota keeps turning over (its writers are never refused for good).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field

from dualpath.kv.prefix import KEY_BYTES, key_tag


def space_of(key: bytes) -> bytes:
    """The namespace prefix of an evictor's key (b"" for a bare block key)."""
    return key[:-KEY_BYTES]


@dataclass(frozen=True)
class Quotas:
    """Bytes each group may hold: ``named`` (group -> bytes; 0 = no quota for it) over
    ``default`` (every other group; 0 = none)."""

    default: int = 0
    named: Mapping[Hashable, int] = field(default_factory=dict)

    def of(self, group: Hashable) -> int | None:
        q = self.named.get(group, self.default)
        return q or None

    def __bool__(self) -> bool:
        return bool(self.default) or any(self.named.values())

    def to_json(self) -> dict:
        return {"default": self.default, "named": {str(t): q for t, q in self.named.items()}}

    @classmethod
    def from_json(cls, d: dict) -> Quotas:
        return cls(int(d["default"]), {int(t): int(q) for t, q in d["named"].items()})


class _Group:
    """Blocks by a function of their key: bytes and blocks per group, and with quotas
    each group's blocks least recent first."""

    def __init__(self, of: Callable[[bytes], Hashable], quotas: Quotas | None):
        self.of = of
        self.quotas = quotas if quotas else None
        self.usage: dict[Hashable, int] = {}
        self.blocks: dict[Hashable, int] = {}
        self.order: dict[Hashable, OrderedDict[bytes, None]] = {}

    def add(self, key: bytes, delta: int, new: bool) -> None:
        g = self.of(key)
        self.usage[g] = self.usage.get(g, 0) + delta
        if new:
            self.blocks[g] = self.blocks.get(g, 0) + 1
            if self.quotas is not None:
                self.order.setdefault(g, OrderedDict())[key] = None

    def touch(self, key: bytes) -> None:
        if self.quotas is not None:
            self.order[self.of(key)].move_to_end(key)

    def remove(self, key: bytes, n: int) -> None:
        g = self.of(key)
        left = self.blocks[g] - 1         # by blocks, not bytes: a block may be 0 bytes
        if left:
            self.blocks[g] = left
            self.usage[g] -= n
        else:
            del self.blocks[g]
            del self.usage[g]
        if self.quotas is not None:
            mine = self.order[g]
            del mine[key]
            if not mine:
                del self.order[g]

    def over(self, high: float, low: float, reserve: int) -> list[tuple[Hashable, float]]:
        """[(group, goal)] of the groups whose usage plus ``reserve`` (at most half their
        quota) is over ``high`` x their quota; the goal is ``low`` x it, or the quota
        less the reserve when that is lower."""
        if self.quotas is None:
            return []
        out = []
        for g, used in self.usage.items():
            q = self.quotas.of(g)
            if q is None:
                continue
            r = min(reserve, q / 2)
            if used + r > high * q:
                out.append((g, max(0.0, min(low * q, q - r))))
        return out

    def clear(self) -> None:
        self.usage.clear()
        self.blocks.clear()
        self.order.clear()


class LruCore:
    def __init__(self, capacity: int, *, high: float = 0.9, low: float = 0.8,
                 lease_s: float = 60.0, quotas: Quotas | None = None,
                 space_quotas: Quotas | None = None):
        """``quotas``: of tenant accounts (by tag); ``space_quotas``: of namespaces (by
        the prefix of the evictor's keys)."""
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
        self.tenants = _Group(key_tag, quotas)
        self.spaces = _Group(space_of, space_quotas)
        self._groups = (self.tenants, self.spaces)

    @property
    def quotas(self) -> Quotas | None:
        return self.tenants.quotas

    @property
    def tenant_usage(self) -> dict[int, int]:
        """Bytes of each tenant account (tag)."""
        return self.tenants.usage

    @property
    def space_usage(self) -> dict[bytes, int]:
        """Bytes of each namespace (prefix)."""
        return self.spaces.usage

    def __len__(self) -> int:
        return len(self._blocks)

    def clear(self) -> None:
        self.usage = 0
        self._blocks.clear()
        self._touched.clear()
        self._leases.clear()
        for g in self._groups:
            g.clear()

    def __contains__(self, key: bytes) -> bool:
        return key in self._blocks

    def wrote(self, key: bytes, nbytes: int, now: float) -> None:
        """Block ``key`` is on disk with ``nbytes`` (again: its size is updated)."""
        old = self._blocks.get(key)
        self.usage += nbytes - (old or 0)
        for g in self._groups:
            g.add(key, nbytes - (old or 0), old is None)
        self._blocks[key] = nbytes
        if old is None:
            self._touched[key] = now
        else:
            self._touch(key, now)

    def hit(self, key: bytes, now: float) -> float | None:
        """A hit on ``key``: most recent now, leased; the seconds since its last touch
        (its hit age), or None for a block not known here."""
        ages = self.hit_many((key,), now)
        return ages[0] if ages else None

    def hit_many(self, keys, now: float) -> list[float]:
        """:meth:`hit` of each of ``keys``; the hit ages of those known here (one call
        for a ledger file's batch of H records: the evictor's hot loop)."""
        blocks, touched, leases = self._blocks, self._touched, self._leases
        until = now + self.lease_s
        grouped = [g for g in self._groups if g.quotas is not None]
        ages = []
        for key in keys:
            if key not in blocks:
                continue
            ages.append(max(0.0, now - touched[key]))
            blocks.move_to_end(key)
            touched[key] = now
            leases[key] = until
            for g in grouped:
                g.touch(key)
        return ages

    def _touch(self, key: bytes, now: float) -> None:
        self._blocks.move_to_end(key)
        self._touched[key] = now
        for g in self._groups:
            g.touch(key)

    def removed(self, key: bytes) -> int:
        """Forget ``key`` (deleted, evicted, or found missing); its bytes."""
        n = self._blocks.pop(key, None)
        if n is None:
            return 0
        self.usage -= n
        for g in self._groups:
            g.remove(key, n)
        del self._touched[key]
        self._leases.pop(key, None)
        return n

    def all_keys(self) -> list[bytes]:
        return list(self._blocks)

    def forget_prefix(self, prefix: bytes) -> int:
        """Forget every block of the namespace ``prefix`` (its directory is gone); the
        bytes forgotten."""
        return sum(self.removed(k) for k in [k for k in self._blocks
                                             if space_of(k) == prefix])

    def over(self, reserve: int = 0) -> bool:
        return self.usage + reserve > self.high * self.capacity

    def over_quota(self, reserve: int = 0) -> list[tuple[_Group, Hashable, float]]:
        """[(group kind, group, goal)] of the groups over their quota's high watermark,
        ``reserve`` (what one round of every writer adds to one group) counted."""
        return [(g, name, goal) for g in self._groups
                for name, goal in g.over(self.high, self.low, reserve)]

    def victims(self, now: float, reserve: int = 0,
                group_reserve: int = 0) -> list[tuple[bytes, int]]:
        """The blocks to evict now, least recent first, each forgotten here (the caller
        removes them); [] while usage plus ``reserve`` (what writers may add before the
        next round) is under the high watermark and every group under its quota's
        (``group_reserve`` counted: lru.py's module docstring)."""
        out = []
        for group, name, goal in self.over_quota(group_reserve):
            mine = group.order.get(name)
            if mine is None:            # emptied by an earlier group's picks this round
                continue
            out += self._pick(((k, self._blocks[k]) for k in mine),
                              group.usage.get(name, 0), goal, now)
        if self.over(reserve):
            goal = max(0.0, min(self.low * self.capacity, self.capacity - reserve))
            out += self._pick(iter(self._blocks.items()), self.usage, goal, now)
        return out

    def _pick(self, blocks, usage: int, goal: float, now: float) -> list[tuple[bytes, int]]:
        """The least recent unleased of ``blocks`` (least recent first) that take
        ``usage`` down to ``goal``, forgotten here."""
        picked, freed = [], 0
        for key, nbytes in blocks:                   # no copy: stops at the goal
            if usage - freed <= goal:
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
