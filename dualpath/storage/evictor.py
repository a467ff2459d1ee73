"""The store's upkeep thread, and the one evictor of a shared store among them.

Every process that opens a store with a capacity (``storage.capacity_gib``) runs an
:class:`Upkeep` thread. Each tick it flushes the process's ledger (ledger.py), sweeps
stale temp files now and then, and tries to become the store's **evictor**: a
non-blocking POSIX lock on ``<storage.dir>/.evictor/lock`` (fcntl record locks work on
NFS and GlusterFS, and the kernel drops them with the process, so a dead evictor's
successor takes over within a tick). Exactly one process of the whole cluster holds it;
it alone decides what to evict, for every node's writes and hits, in **every namespace
of the store** (each model's KV format is one: tree.py), so the bound is the store's,
whatever models share it.

Why a node and not the scheduler: the scheduler sees requests' hit *lengths*, never block
keys, and need not mount the store; what every node writes and hits reaches the store's
ledgers anyway, and any node can take the evictor over from there.

The evictor, on taking over, reads each namespace's ledger from its current end, scans
the namespaces (sizes; recency from mtimes), then each tick applies what every process
recorded since (W, H, E) to its :class:`~dualpath.storage.lru.LruCore` (keys prefixed by
their namespace's id), unlinks what the core picks (recording E in that namespace's
ledger, so the nodes' indexes drop them) and publishes the usage (publication.py).
Writers read that publication (:class:`CapacityGuard`): a write that would take the
store past its capacity, its namespace past ``storage.namespace_quota_gib`` or its tenant
account past its quota (``storage.tenant_quota_gib``, ``tenant_quotas``), counting what
each active writer may add before the next tick, is refused (StorageError ENOSPC, a
block not cached), so usage stays under the bounds between ticks. A namespace or account
over its quota loses its own least recent blocks first (lru.py).

A block being read is safe from an unlink on a local disk (an open file lives on); on a
networked filesystem a read that loses its file misses and is recomputed. What protects
an in-flight request's blocks is the lease its lookup recorded (lru.py).
"""

from __future__ import annotations

import bisect
import errno as _errno
import fcntl
import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from dualpath.storage.ledger import EVICTED, HIT, LEDGER_DIR, WROTE, LedgerTail, LedgerWriter
from dualpath.storage.lru import LruCore, Quotas
from dualpath.storage.publication import EVICTOR_DIR, LOCK_FILE, write_publication
from dualpath.storage.tree import namespace_dirs, unlink_block, walk_blocks

log = logging.getLogger("dualpath.storage")

HIT_AGE_BUCKETS = (1.0, 10.0, 60.0, 600.0, 3600.0, 86400.0, float("inf"))
PRUNE_EVERY_S = 60.0
SWEEP_EVERY_S = 300.0
ACTIVE_WRITER_S = 30.0
RESCAN_S = 600.0
DISCOVER_S = 1.0               # new or removed namespaces are looked for this often
MAX_NAMESPACES = 1 << 16

_held: set[str] = set()             # lock files this process holds (POSIX locks are per
_held_lock = threading.Lock()       # process: a second store here must not think it holds)


@dataclass
class EvictorStats:
    evictions: int = 0
    evicted_bytes: int = 0
    takeovers: int = 0
    temp_swept: int = 0
    hit_age_counts: list[int] = field(default_factory=lambda: [0] * len(HIT_AGE_BUCKETS))
    hit_age_sum: float = 0.0


@dataclass(frozen=True)
class StoreCapacity:
    """The bound of a store and how its upkeep keeps it (StorageConfig)."""

    bytes: int
    high: float = 0.9
    low: float = 0.8
    lease_s: float = 60.0
    interval_s: float = 1.0
    temp_max_age_s: float = 600.0
    quotas: Quotas = field(default_factory=Quotas)    # of tenant accounts, by tag
    namespace_quota: int = 0                          # of each namespace; 0 = none

    def start(self, store, ledger: LedgerWriter) -> Upkeep:
        core = LruCore(self.bytes, high=self.high, low=self.low, lease_s=self.lease_s,
                       quotas=self.quotas, space_quotas=Quotas(self.namespace_quota))
        return Upkeep(store, ledger, core, interval_s=self.interval_s,
                      temp_max_age_s=self.temp_max_age_s)


class _Space:
    """One namespace as the evictor sees it: its ledger, and the prefix of its blocks'
    keys in the core."""

    def __init__(self, name: str, path: str, sid: int, writer: LedgerWriter | None):
        self.name = name
        self.dir = path
        self.prefix = sid.to_bytes(2, "big")
        self.tail = LedgerTail(os.path.join(path, LEDGER_DIR), ("log", "hits"))
        self.writer = writer        # the E records of its evictions (made when needed)
        self.borrowed = writer is not None      # the store's own ledger: not closed here

    def close(self) -> None:
        """Close the ledger writer made for it (not the store's own)."""
        if self.writer is not None and not self.borrowed:
            self.writer.close()


class Upkeep:
    """See the module docstring. ``store`` is the BlockStore it keeps (its ``root``,
    ``dir``, ``remove_file``, ``sweep_temp``, ``fsync``); one owner, idempotent close."""

    def __init__(self, store, ledger: LedgerWriter, core: LruCore, *,
                 interval_s: float = 1.0, temp_max_age_s: float = 600.0,
                 ledger_keep_s: float = 3600.0, start: bool = True):
        self.store = store
        self.ledger = ledger
        self.core = core
        self.interval_s = interval_s
        self.temp_max_age_s = temp_max_age_s
        self.ledger_keep_s = ledger_keep_s
        self.stats = EvictorStats()
        self.root = os.fspath(store.root)
        self.namespace = os.path.basename(os.fspath(store.dir))
        self._evictor_dir = os.path.join(self.root, EVICTOR_DIR)
        self._lock_path = os.path.realpath(os.path.join(self._evictor_dir, LOCK_FILE))
        self._lock_fd = -1
        self._spaces: dict[str, _Space] = {}
        self._by_prefix: dict[bytes, _Space] = {}
        self._unscannable: set[str] = set()
        self._next_discover = 0.0
        self._next_rescan = time.monotonic() + RESCAN_S
        # A process not marked alive for this long is gone (it marks every round).
        self._alive_s = max(ACTIVE_WRITER_S, 10 * interval_s)
        self._rate = 0.0          # most bytes one writer wrote in a round (decaying)
        self._block = 0           # largest block seen
        self._next_prune = 0.0
        self._next_sweep = time.monotonic() + SWEEP_EVERY_S
        self._mu = threading.Lock()               # one tick at a time
        self._forgotten: deque[bytes] = deque()   # deleted here: off the core next round
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if start:
            self._thread = threading.Thread(target=self._run, name="dp-store-upkeep",
                                            daemon=True)
            self._thread.start()

    @property
    def holds(self) -> bool:
        """Whether this process is the store's evictor now."""
        return self._lock_fd >= 0

    def _run(self) -> None:
        failing = 0
        while not self._stop.wait(self.interval_s):
            try:
                self.tick()
                failing = 0
            except Exception:                      # the next tick tries again
                failing += 1
                if failing == 1 or failing % 100 == 0:
                    log.exception("store upkeep of %s (%d rounds failing)", self.store.dir,
                                  failing)

    def tick(self) -> None:
        """One round: flush the ledger; as the evictor, account, evict and publish."""
        with self._mu:
            self.ledger.flush(alive=True)
            if self.holds and not self._still_ours():
                self._let_go()      # its lock file was removed: another may lock a new one
            if not self.holds and not self._take():
                self._sweep()
                return
            now = time.time()
            self._discover(now)
            own = self._spaces.get(self.namespace)
            while self._forgotten:
                key = self._forgotten.popleft()
                if own is not None:
                    self.core.removed(own.prefix + key)
            self._apply(now)
            writers = self.writers(now)
            victims = self.core.victims(now, self.reserve(now, writers),
                                        writers * self._block)
            if victims:
                self._evict(victims, now)
            self._publish(now, writers)
            if time.monotonic() >= self._next_prune:
                self._next_prune = time.monotonic() + PRUNE_EVERY_S
                self._prune(now)
            self._sweep()

    # --- the lock ------------------------------------------------------------------------
    def _take(self) -> bool:
        with _held_lock:
            if self._lock_path in _held:
                return False
            try:
                os.makedirs(self._evictor_dir, mode=0o755, exist_ok=True)
                fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW |
                             os.O_CLOEXEC, 0o644)
            except OSError:
                return False
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno not in (_errno.EAGAIN, _errno.EACCES):
                    log.warning("store %s: cannot lock %s (%s); this node will not evict",
                                self.root, self._lock_path, e)
                return False
            try:
                self._bootstrap()
            except BaseException:       # not the evictor with half a picture: let go
                os.close(fd)
                self._close_spaces()
                raise
            _held.add(self._lock_path)
            self._lock_fd = fd
        self.stats.takeovers += 1
        log.info("store %s: this process is the evictor now (capacity %.2f GiB, %d "
                 "namespaces, %d blocks, %.2f GiB used)", self.root,
                 self.core.capacity / 2**30, len(self._spaces), len(self.core),
                 self.core.usage / 2**30)
        return True

    def _still_ours(self) -> bool:
        """Whether the lock file held is still the one at the lock's path."""
        try:
            return os.stat(self._lock_path).st_ino == os.fstat(self._lock_fd).st_ino
        except OSError:
            return False

    def _let_go(self) -> None:
        with _held_lock:
            if self._lock_fd >= 0:
                os.close(self._lock_fd)
                self._lock_fd = -1
                _held.discard(self._lock_path)
        self._close_spaces()

    # --- the store's namespaces ------------------------------------------------------------
    def _bootstrap(self) -> None:
        """The store as it is: every namespace's ledger end first, then a scan of it
        (what is written meanwhile is read from the ledger after it, twice at worst:
        harmless)."""
        self._close_spaces()
        self.core.clear()
        self._discover()

    def _discover(self, now: float | None = None) -> None:
        """Namespaces new since it last looked (at most every :data:`DISCOVER_S`) are
        scanned into the core; one that was removed is forgotten; one nobody writes with
        a capacity (no W records reach the ledger) is scanned again every
        :data:`RESCAN_S`. A namespace that cannot be listed or scanned (permissions,
        I/O) is left out and tried again when it next looks: never the whole store's
        eviction stopped for it."""
        if now is not None and self._spaces and time.monotonic() < self._next_discover:
            return
        self._next_discover = time.monotonic() + DISCOVER_S
        try:
            found = namespace_dirs(self.root)
        except OSError as e:
            log.warning("store %s: cannot list its namespaces (%s); evicting from those "
                        "known", self.root, e)
            return
        names = {e.name for e in found}
        for name in [n for n in self._spaces if n not in names]:
            space = self._spaces.pop(name)
            del self._by_prefix[space.prefix]
            self.core.forget_prefix(space.prefix)
            space.close()
        if now is not None and time.monotonic() >= self._next_rescan:
            self._next_rescan = time.monotonic() + RESCAN_S
            self._rescan_unwritten(now)
        for e in found:
            if e.name in self._spaces:
                continue
            if len(self._by_prefix) >= MAX_NAMESPACES:
                continue
            sid = next(i for i in range(len(self._by_prefix) + 1)
                       if i.to_bytes(2, "big") not in self._by_prefix)
            own = e.name == self.namespace
            space = _Space(e.name, e.path, sid, self.ledger if own else None)
            try:
                space.tail.skip_to_end()
                blocks = sorted(walk_blocks(e.path), key=lambda b: b.mtime)
            except OSError as err:
                if e.name not in self._unscannable:
                    self._unscannable.add(e.name)
                    log.warning("store %s: cannot scan namespace %s (%s); it is not "
                                "evicted from until it can be", self.root, e.name, err)
                continue
            self._unscannable.discard(e.name)
            for b in blocks:
                self.core.wrote(space.prefix + b.key, b.nbytes, b.mtime)
                self._block = max(self._block, b.nbytes)
            self._spaces[e.name] = space
            self._by_prefix[space.prefix] = space

    def _rescan_unwritten(self, now: float) -> None:
        """Namespaces with no live writer of the ledger (written, if at all, by
        processes without a capacity, whose writes it never hears of): what is on disk
        now, the blocks the core does not know added at their mtimes, those gone
        forgotten."""
        alive = self._alive(now)
        for space in list(self._spaces.values()):
            if any(n.split(".", 1)[0] in alive for n in space.tail.mtimes):
                continue
            try:
                on_disk = {space.prefix + b.key: b for b in walk_blocks(space.dir)}
            except OSError:
                continue
            known = [k for k in self.core.all_keys() if k[:2] == space.prefix]
            for k in known:
                if k not in on_disk:
                    self.core.removed(k)
            for k, b in on_disk.items():
                if k not in self.core:
                    self.core.wrote(k, b.nbytes, b.mtime)

    def _close_spaces(self) -> None:
        for space in self._spaces.values():
            space.close()
        self._spaces.clear()
        self._by_prefix.clear()

    def _own_ids(self) -> set[str]:
        """The ledger writer ids of this process's own records (applied when made)."""
        return {s.writer.id for s in self._spaces.values() if s.writer is not None} | \
            {self.ledger.id}

    def _apply(self, now: float) -> None:
        core = self.core
        mine = self._own_ids()
        wrote: dict[str, int] = {}
        for space in self._spaces.values():
            p = space.prefix
            # Each writer's W records before its H records (two files): a hit on a block
            # needs the block known first.
            polled = sorted(space.tail.poll(), key=lambda nr: nr[0].endswith(".hits"))
            for name, records in polled:
                if name.endswith(".hits"):          # H records only: one batch
                    self._count_ages(core.hit_many([p + key for op, _, key in records
                                                    if op == HIT], now))
                    continue
                writer = name.split(".", 1)[0]
                ours = writer in mine       # our own E records were applied when made
                for op, size, key in records:
                    if op == WROTE:
                        core.wrote(p + key, size, now)
                        wrote[writer] = wrote.get(writer, 0) + size
                        self._block = max(self._block, size)
                    elif op == HIT:
                        self._count_ages(core.hit_many([p + key], now))
                    elif op == EVICTED and not ours:
                        core.removed(p + key)
        self._rate = max(0.9 * self._rate, max(wrote.values(), default=0))

    def _alive(self, now: float) -> set[str]:
        """The writer ids of the processes that have a namespace of the store open (each
        marks its files alive every round: ledger.py); not this evictor's own records
        of evictions in other namespaces."""
        evictions = {s.writer.id for s in self._spaces.values()
                     if s.writer is not None and not s.borrowed}
        return {name.split(".", 1)[0] for s in self._spaces.values()
                for name, t in s.tail.mtimes.items()
                if name.endswith(".log") and now - t < self._alive_s} - evictions

    def _prune(self, now: float) -> None:
        # Never a live writer's files, however long since it last wrote; never ours.
        alive = self._alive(now)
        for space in self._spaces.values():
            keep = {n for n in space.tail.mtimes if n.split(".", 1)[0] in alive}
            if space.writer is not None:
                keep |= space.writer.own()
            space.tail.prune(self.ledger_keep_s, now, keep)

    def writers(self, now: float) -> int:
        """The processes that have the store open, plus one for a process that opens it
        now."""
        return 1 + len(self._alive(now))

    def reserve(self, now: float, writers: int | None = None) -> int:
        """What the writers may add before the next round, with a margin: the space
        eviction keeps free so that :class:`CapacityGuard` seldom refuses a write; at
        most (1 - low watermark) of the capacity (a small store with fast writers would
        otherwise be emptied each round: its writers are refused a little instead)."""
        if writers is None:
            writers = self.writers(now)
        want = 2 * writers * max(self._rate, self._block)
        core = self.core          # never so much that eviction would empty the store
        return int(min(want, (1.0 - core.low) * core.capacity, core.high * core.capacity / 2))

    def forget(self, key: bytes) -> None:
        """A block this process deleted (its E record is skipped: applied at the next
        round; never waits for a round under way)."""
        self._forgotten.append(key)

    def _count_ages(self, ages: list[float]) -> None:
        s = self.stats
        s.hit_age_sum += sum(ages)
        counts, bounds = s.hit_age_counts, HIT_AGE_BUCKETS
        for age in ages:
            counts[bisect.bisect_left(bounds, age)] += 1

    def _evict(self, victims: list[tuple[bytes, int]], now: float) -> None:
        gone: dict[bytes, list[bytes]] = {}
        for pkey, nbytes in victims:
            space = self._by_prefix[pkey[:2]]
            key = pkey[2:]
            try:
                if space.name == self.namespace:
                    self.store.remove_file(key, strict=True)   # its index entry too
                else:
                    unlink_block(space.dir, key)
            except OSError as e:        # still there: counted again, tried next round
                log.warning("store %s: evicting %s of %s: %s", self.root, key.hex(),
                            space.name, e)
                self.core.wrote(pkey, nbytes, now)
                continue
            gone.setdefault(space.prefix, []).append(key)
            self.stats.evictions += 1
            self.stats.evicted_bytes += nbytes
        for prefix, keys in gone.items():
            space = self._by_prefix[prefix]
            if space.writer is None:
                space.writer = LedgerWriter(space.dir, sync=self.ledger.sync)
            elif not space.borrowed:
                space.writer.reopen_if_removed()
            space.writer.evicted(keys, now=True)

    def _publish(self, now: float, writers: int) -> None:
        core = self.core
        names = {s.prefix: s.name for s in self._spaces.values()}
        body = {"usage_bytes": core.usage, "capacity_bytes": core.capacity,
                "writers": writers,
                "consumed": {f"{s.name}/{n}": o for s in self._spaces.values()
                             for n, o in s.tail.offsets.items() if n.endswith(".log")},
                "evictor": self.ledger.id, "time": now,
                "namespaces": {names[p]: n for p, n in core.space_usage.items()
                               if p in names}}
        quotas = core.quotas
        if quotas is not None:
            # The accounts near their quota only: as many as capacity / quota at most,
            # however many accounts there are (a caller's salt can make one).
            body["quotas"] = quotas.to_json()
            body["tenants"] = {str(t): n for t, n in core.tenant_usage.items()
                               if (q := quotas.of(t)) is not None and 4 * n >= q}
        if core.spaces.quotas is not None:
            body["namespace_quota_bytes"] = core.spaces.quotas.default
        try:
            write_publication(self.root, body)
        except OSError as e:
            log.warning("store %s: publishing usage: %s", self.root, e)

    def _sweep(self) -> None:
        if time.monotonic() < self._next_sweep:
            return
        self._next_sweep = time.monotonic() + SWEEP_EVERY_S
        self.stats.temp_swept += self.store.sweep_temp(self.temp_max_age_s)

    def gauges(self) -> dict[str, float]:
        """For a scrape (read without waiting for a round: a round may walk the store)."""
        return {"evictor": float(self.holds),
                "usage_bytes": float(self.core.usage) if self.holds else 0.0,
                "capacity_bytes": float(self.core.capacity),
                "blocks": float(len(self.core)) if self.holds else 0.0}

    def close(self) -> None:
        """Stop the thread, flush the ledger, let go of the evictor's lock (idempotent)."""
        self._stop.set()
        t, self._thread = self._thread, None
        if t is not None:
            t.join()
        with self._mu:
            self.ledger.flush()
            self._let_go()
