"""The keys a process knows to be in the store: lookups without a filesystem call per block.

A lookup (``leading``) counts a prompt's leading keys in memory. Only a key not known
here costs a ``stat`` of its file (found: remembered), so a lookup of an indexed prefix
costs one call at most (at its first unknown key), where the store alone costs one per
block, each a round trip to the metadata service of a networked filesystem.

What keeps it true, in the process that answers the lookups (each node and vLLM
engine process: no service on the path of a lookup):
- its own writes, deletes and quarantines, at once;
- every other process's evictions, deletes and read misses, read from the store's
  ledger (ledger.py; its ``.log`` files) every ``refresh_s`` by a thread of its own
  (one ``stat`` per writer's file), so a lookup on an event loop never waits for that
  I/O (without the thread, the first lookup after ``refresh_s`` polls);
- a read that finds a key's file gone drops it (the read is a miss: recomputed).
A restart starts empty and learns keys as lookups stat them; it never reports a key
the store did not hold when it was stat'ed. The index is advisory like the lookups
before it: a key evicted and not yet read from the ledger is a hit here and a miss at
its read (recomputed, never wrong bytes: reads check the bytes).

Memory is bounded by ``max_keys`` (~100 bytes each): past it the index starts over.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Container, Sequence

from dualpath.storage.ledger import EVICTED, MISSED, WROTE, LedgerTail

log = logging.getLogger("dualpath.storage")


class KeyIndex:
    def __init__(self, tail: LedgerTail, exists: Callable[[bytes], bool], *,
                 max_keys: int = 1_000_000, refresh_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic, background: bool = False):
        self._tail = tail
        self._tail.skip_to_end()
        self._exists = exists
        self.max_keys = max_keys
        self.refresh_s = refresh_s
        self._clock = clock
        self._next = clock() + refresh_s
        self._keys: set[bytes] = set()
        self._poll = threading.Lock()
        self.stats = {"index_stat_calls": 0, "index_resets": 0, "index_ledger_polls": 0}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if background:
            self.start()

    def start(self) -> None:
        """Poll the ledger on a thread of its own from now on (lookups then never do)."""
        if self._thread is None and not self._stop.is_set():
            self._thread = threading.Thread(target=self._run, name="dp-store-index",
                                            daemon=True)
            self._thread.start()

    def _run(self) -> None:
        failing = 0
        while not self._stop.wait(self.refresh_s):
            try:
                self.refresh(force=True)
                failing = 0
            except Exception:
                failing += 1
                if failing == 1 or failing % 100 == 0:
                    log.exception("store index: polling the ledger (%d rounds failing)",
                                  failing)

    def close(self) -> None:
        """Stop the polling thread (idempotent)."""
        self._stop.set()
        t, self._thread = self._thread, None
        if t is not None:
            t.join()

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, key: bytes) -> None:
        if len(self._keys) >= self.max_keys:
            self._keys = set()
            self.stats["index_resets"] += 1
        self._keys.add(key)

    def discard(self, key: bytes) -> None:
        self._keys.discard(key)

    def contains(self, key: bytes) -> bool:
        if key in self._keys:
            return True
        self.stats["index_stat_calls"] += 1
        if self._exists(key):
            self.add(key)
            return True
        return False

    def leading(self, keys: Sequence[bytes], held: Container[bytes] = ()) -> int:
        """How many leading ``keys`` are known here, found by a stat, or in ``held``."""
        if self._thread is None:
            self.refresh()
        n = 0
        known = self._keys
        for key in keys:
            if key in known or key in held or self.contains(key):
                n += 1
                continue
            break
        return n

    def refresh(self, force: bool = False) -> None:
        """Apply the ledger's new W and E records, when ``refresh_s`` has passed (with
        ``force``, now: after a poll under way, if one is)."""
        now = self._clock()
        if not force and now < self._next:
            return
        if not self._poll.acquire(blocking=force):
            return                      # another thread is polling: use what we know
        try:
            self._next = now + self.refresh_s
            self.stats["index_ledger_polls"] += 1
            # Files are read one after another, so their records' order across files
            # is lost: within a poll a removal wins over a write (a wrong "absent" costs
            # a stat; a wrong "present" a failed read).
            added, removed = set(), set()
            for _, records in self._tail.poll():
                for op, _, key in records:
                    if op == EVICTED or op == MISSED:
                        removed.add(key)
                    elif op == WROTE:
                        added.add(key)
            for key in added - removed:
                if len(self._keys) >= self.max_keys:
                    break
                self._keys.add(key)
            self._keys.difference_update(removed)
        finally:
            self._poll.release()
