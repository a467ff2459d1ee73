"""The store's upkeep thread, and the one evictor of a shared store among them.

Every process that opens a store with a capacity (``storage.capacity_gib``) runs an
:class:`Upkeep` thread. Each tick it flushes the process's ledger (ledger.py), sweeps
stale temp files now and then, and tries to become the store's **evictor**: a
non-blocking POSIX lock on ``.ledger/evictor.lock`` (fcntl record locks work on NFS and
GlusterFS, and the kernel drops them with the process, so a dead evictor's successor
takes over within a tick). Exactly one process of the whole cluster holds it; it alone
decides what to evict, for every node's writes and hits.

Why a node and not the scheduler: the scheduler sees requests' hit *lengths*, never block
keys, and need not mount the store; what every node writes and hits reaches the store's
ledger anyway, and any node can take the evictor over from there.

The evictor, on taking over, reads the ledger from its current end, scans the store
(sizes; recency from mtimes), then each tick applies what every process recorded since
(W, H, E) to its :class:`~dualpath.storage.lru.LruCore`, unlinks what the core picks
(recording E so the nodes' indexes drop them) and publishes the usage to
``.ledger/usage.json``. Writers read that publication (:class:`CapacityGuard`): a write
that would take usage over the capacity, counting what each active writer may add
before the next tick, is refused (StorageError ENOSPC, a block not cached), so usage
stays under the bound between ticks. Tenant quotas (``storage.tenant_quota_gib``,
``storage.tenant_quotas``) work the same way per account: the evictor evicts an account
over its quota from its own blocks first (lru.py) and publishes each account's usage and
quota; a write that would take its account past its quota is refused.

A block being read is safe from an unlink on a local disk (an open file lives on); on a
networked filesystem a read that loses its file misses and is recomputed. What protects
an in-flight request's blocks is the lease its lookup recorded (lru.py).
"""

from __future__ import annotations

import contextlib
import errno as _errno
import fcntl
import json
import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from dualpath.kv.prefix import DEFAULT_TAG
from dualpath.storage.ledger import EVICTED, HIT, LEDGER_DIR, WROTE, LedgerTail, LedgerWriter
from dualpath.storage.lru import LruCore, Quotas

log = logging.getLogger("dualpath.storage")

USAGE_FILE = "usage.json"
LOCK_FILE = "evictor.lock"
HIT_AGE_BUCKETS = (1.0, 10.0, 60.0, 600.0, 3600.0, 86400.0, float("inf"))
PRUNE_EVERY_S = 60.0
SWEEP_EVERY_S = 300.0
ACTIVE_WRITER_S = 30.0

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
class Published:
    usage: int
    capacity: int
    writers: int
    consumed: dict[str, int]
    tenants: dict[int, int] = field(default_factory=dict)   # tag -> bytes (with quotas)
    quotas: Quotas | None = None

    def refusal(self, mine: int, tag: int, mine_tag: int) -> str | None:
        """Why a write is refused when this writer has ``mine`` bytes the evictor has
        not counted yet (``mine_tag`` of them tenant ``tag``'s, the write included);
        None when it may go ahead."""
        if self.usage + self.writers * mine > self.capacity:
            return "the store is at its bound (storage.capacity_gib)"
        q = self.quotas.of(tag) if self.quotas is not None else None
        if q is not None and self.tenants.get(tag, 0) + self.writers * mine_tag > q:
            who = "the default tenant" if tag == DEFAULT_TAG else f"tenant tag {tag:06x}"
            return f"{who} is at its quota (storage.tenant_quota_gib / tenant_quotas)"
        return None


@dataclass(frozen=True)
class StoreCapacity:
    """The bound of one store namespace and how its upkeep keeps it (StorageConfig)."""

    bytes: int
    high: float = 0.9
    low: float = 0.8
    lease_s: float = 60.0
    interval_s: float = 1.0
    temp_max_age_s: float = 600.0
    quotas: Quotas = field(default_factory=Quotas)

    def start(self, store, ledger: LedgerWriter) -> Upkeep:
        core = LruCore(self.bytes, high=self.high, low=self.low, lease_s=self.lease_s,
                       quotas=self.quotas)
        return Upkeep(store, ledger, core, interval_s=self.interval_s,
                      temp_max_age_s=self.temp_max_age_s)


class CapacityGuard:
    """A writer's check against the evictor's last publication (module docstring)."""

    def __init__(self, ns_dir: str | os.PathLike, ledger: LedgerWriter, stale_s: float = 30.0):
        self.path = os.path.join(os.fspath(ns_dir), LEDGER_DIR, USAGE_FILE)
        self.ledger = ledger
        self.stale_s = stale_s
        self._seen: tuple[int, int] | None = None
        self._pub: Published | None = None

    def published(self) -> Published | None:
        """The evictor's last publication; None when there is none or it is older than
        ``stale_s`` (no evictor now: writes are not held back)."""
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        if time.time() - st.st_mtime > self.stale_s:
            return None
        if self._seen != (st.st_ino, st.st_mtime_ns):
            try:
                with open(self.path, "rb") as f:
                    d = json.loads(f.read(1 << 20))
                q = d.get("quotas")
                self._pub = Published(int(d["usage_bytes"]), int(d["capacity_bytes"]),
                                      max(1, int(d["writers"])),
                                      {str(k): int(v) for k, v in d["consumed"].items()},
                                      {int(k): int(v) for k, v in
                                       d.get("tenants", {}).items()},
                                      Quotas.from_json(q) if q else None)
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                return None
            self._seen = (st.st_ino, st.st_mtime_ns)
        return self._pub

    def refusal(self, nbytes: int, tag: int = DEFAULT_TAG) -> str | None:
        """Why a write of ``nbytes`` of tenant ``tag``'s is refused now (None: it may
        go ahead)."""
        pub = self.published()
        if pub is None:
            return None
        mine = self.ledger.unaccounted(pub.consumed) + nbytes
        mine_tag = self.ledger.unaccounted(pub.consumed, tag) + nbytes \
            if pub.quotas is not None else 0
        return pub.refusal(mine, tag, mine_tag)

    def allows(self, nbytes: int, tag: int = DEFAULT_TAG) -> bool:
        return self.refusal(nbytes, tag) is None


class Upkeep:
    """See the module docstring. ``store`` is the BlockStore it keeps (its ``dir``,
    ``walk``, ``remove_file``, ``sweep_temp``, ``index``); one owner, idempotent close."""

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
        self._ledger_dir = os.path.join(os.fspath(store.dir), LEDGER_DIR)
        self._lock_path = os.path.realpath(os.path.join(self._ledger_dir, LOCK_FILE))
        self._lock_fd = -1
        self._tail = LedgerTail(self._ledger_dir, ("log", "hits"))
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
            while self._forgotten:
                self.core.removed(self._forgotten.popleft())
            self._apply(now)
            victims = self.core.victims(now, self.reserve(now))
            if victims:
                self._evict(victims, now)
            self._publish(now)
            if time.monotonic() >= self._next_prune:
                self._next_prune = time.monotonic() + PRUNE_EVERY_S
                # Never a live writer's files, however long since it last wrote.
                alive = self._alive(now)
                keep = {n for n in self._tail.mtimes if n.split(".", 1)[0] in alive}
                self._tail.prune(self.ledger_keep_s, now, keep | self.ledger.own())
            self._sweep()

    def _take(self) -> bool:
        with _held_lock:
            if self._lock_path in _held:
                return False
            try:
                os.makedirs(self._ledger_dir, mode=0o755, exist_ok=True)
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
                                self.store.dir, self._lock_path, e)
                return False
            try:
                self._bootstrap()
            except BaseException:       # not the evictor with half a picture: let go
                os.close(fd)
                raise
            _held.add(self._lock_path)
            self._lock_fd = fd
        self.stats.takeovers += 1
        log.info("store %s: this process is the evictor now (capacity %.2f GiB, %d blocks, "
                 "%.2f GiB used)", self.store.dir, self.core.capacity / 2**30,
                 len(self.core), self.core.usage / 2**30)
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

    def _bootstrap(self) -> None:
        """The store as it is: the ledger's end first, then a scan (what is written
        meanwhile is read from the ledger after it, twice at worst: harmless)."""
        self._tail = LedgerTail(self._ledger_dir, ("log", "hits"))
        self._tail.skip_to_end()
        self.core.clear()
        blocks = sorted(self.store.walk(), key=lambda b: b.mtime)
        for b in blocks:
            self.core.wrote(b.key, b.nbytes, b.mtime)
            self._block = max(self._block, b.nbytes)

    def _apply(self, now: float) -> None:
        me = self.ledger.id + "."
        core = self.core
        wrote: dict[str, int] = {}
        # Each writer's W records before its H records (two files): a hit on a block
        # needs the block known first.
        for name, records in sorted(self._tail.poll(), key=lambda nr: nr[0].endswith(".hits")):
            mine = name.startswith(me)    # our own E records were applied when made
            writer = name.split(".", 1)[0]
            for op, size, key in records:
                if op == WROTE:
                    core.wrote(key, size, now)
                    wrote[writer] = wrote.get(writer, 0) + size
                    self._block = max(self._block, size)
                elif op == HIT:
                    age = core.hit(key, now)
                    if age is not None:
                        self._count_age(age)
                elif op == EVICTED and not mine:
                    core.removed(key)
        self._rate = max(0.9 * self._rate, max(wrote.values(), default=0))

    def _alive(self, now: float) -> set[str]:
        """The writer ids of the processes that have the store open (each marks its
        files alive every round: ledger.py)."""
        return {name.split(".", 1)[0] for name, t in self._tail.mtimes.items()
                if name.endswith(".log") and now - t < self._alive_s}

    def writers(self, now: float) -> int:
        """The processes that have the store open, plus one for a process that opens it
        now."""
        return 1 + len(self._alive(now))

    def reserve(self, now: float) -> int:
        """What the writers may add before the next round, with a margin: the space
        eviction keeps free so that :class:`CapacityGuard` seldom refuses a write; at
        most (1 - low watermark) of the capacity (a small store with fast writers would
        otherwise be emptied each round: its writers are refused a little instead)."""
        want = 2 * self.writers(now) * max(self._rate, self._block)
        core = self.core          # never so much that eviction would empty the store
        return int(min(want, (1.0 - core.low) * core.capacity, core.high * core.capacity / 2))

    def forget(self, key: bytes) -> None:
        """A block this process deleted (its E record is skipped: applied at the next
        round; never waits for a round under way)."""
        self._forgotten.append(key)

    def _count_age(self, age: float) -> None:
        s = self.stats
        s.hit_age_sum += age
        for i, bound in enumerate(HIT_AGE_BUCKETS):
            if age <= bound:
                s.hit_age_counts[i] += 1
                break

    def _evict(self, victims: list[tuple[bytes, int]], now: float) -> None:
        gone = []
        for key, nbytes in victims:
            try:
                self.store.remove_file(key)
            except OSError as e:        # still there: counted again, tried next round
                log.warning("store %s: evicting %s: %s", self.store.dir, key.hex(), e)
                self.core.wrote(key, nbytes, now)
                continue
            gone.append(key)
            self.stats.evictions += 1
            self.stats.evicted_bytes += nbytes
        self.ledger.evicted(gone, now=True)

    def _publish(self, now: float) -> None:
        consumed = {n: o for n, o in self._tail.offsets.items() if n.endswith(".log")}
        core = self.core
        body = {"usage_bytes": core.usage, "capacity_bytes": core.capacity,
                "writers": self.writers(now), "consumed": consumed,
                "evictor": self.ledger.id, "time": now,
                "tenants": {str(t): n for t, n in core.tenant_usage.items()}}
        if core.quotas is not None:
            body["quotas"] = core.quotas.to_json()
        body = json.dumps(body).encode()
        tmp = os.path.join(self._ledger_dir, f".usage.{os.urandom(4).hex()}.tmp")
        try:
            os.makedirs(self._ledger_dir, mode=0o755, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(body)
            os.replace(tmp, os.path.join(self._ledger_dir, USAGE_FILE))
        except OSError as e:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            log.warning("store %s: publishing usage: %s", self.store.dir, e)

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
