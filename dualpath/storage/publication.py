"""What the store's evictor publishes each round, and the writers' check against it.

The evictor (evictor.py) writes ``<storage.dir>/.evictor/usage.json`` each round: the
store's usage and bound, each namespace's and each tenant account's usage and quota, the
processes writing, and how far it read each writer's ledger. A writer's
:class:`CapacityGuard` reads it (one ``stat`` per write, a read when it changed) and
refuses a write that would take the store, its namespace or its tenant account past a
bound, counting what every live writer may add before the next round as much as this
one has added since the publication (StorageError ENOSPC: the block is not cached).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field

from dualpath.kv.prefix import DEFAULT_TAG
from dualpath.storage.ledger import LedgerWriter
from dualpath.storage.lru import Quotas

EVICTOR_DIR = ".evictor"
USAGE_FILE = "usage.json"
LOCK_FILE = "lock"
MAX_PUBLICATION_BYTES = 16 << 20


def usage_path(root: str | os.PathLike) -> str:
    return os.path.join(os.fspath(root), EVICTOR_DIR, USAGE_FILE)


@dataclass(frozen=True)
class Published:
    usage: int
    capacity: int
    writers: int
    consumed: dict[str, int]                                  # "<namespace>/<file>" -> offset
    tenants: dict[int, int] = field(default_factory=dict)     # tag -> bytes, near quota
    quotas: Quotas | None = None                              # of tenant accounts
    spaces: dict[str, int] = field(default_factory=dict)      # namespace -> bytes
    space_quota: int = 0                                      # of each namespace; 0 none

    @classmethod
    def parse(cls, d: dict) -> Published:
        q = d.get("quotas")
        return cls(int(d["usage_bytes"]), int(d["capacity_bytes"]), max(1, int(d["writers"])),
                   {str(k): int(v) for k, v in d["consumed"].items()},
                   {int(k): int(v) for k, v in d.get("tenants", {}).items()},
                   Quotas.from_json(q) if q else None,
                   {str(k): int(v) for k, v in d.get("namespaces", {}).items()},
                   int(d.get("namespace_quota_bytes", 0)))

    def consumed_of(self, namespace: str) -> dict[str, int]:
        """How far the evictor read each of ``namespace``'s ledger files."""
        head = namespace + "/"
        return {n[len(head):]: o for n, o in self.consumed.items() if n.startswith(head)}

    def refusal(self, namespace: str, mine: int, tag: int, mine_tag: int) -> str | None:
        """Why a write into ``namespace`` is refused when this writer has ``mine`` bytes
        the evictor has not counted yet (``mine_tag`` of them tenant ``tag``'s, the write
        included); None when it may go ahead.

        The store's bound is hard: every live writer may add as much as this one before
        the next round. A quota is soft: each writer checks its own share only (the
        evictor keeps room for a block of every writer in a group at its quota, so it
        keeps turning over), and a round of every writer's writes may pass it until the
        evictor's next round. A tenant whose usage is not published is under a quarter
        of its quota."""
        if self.usage + self.writers * mine > self.capacity:
            return "the store is at its bound (storage.capacity_gib)"
        if self.space_quota and self.spaces.get(namespace, 0) + mine > self.space_quota:
            return f"namespace {namespace} is at its quota (storage.namespace_quota_gib)"
        q = self.quotas.of(tag) if self.quotas is not None else None
        if q is not None and self.tenants.get(tag, 0) + mine_tag > q:
            who = "the default tenant" if tag == DEFAULT_TAG else f"tenant tag {tag:06x}"
            return f"{who} is at its quota (storage.tenant_quota_gib / tenant_quotas)"
        return None


def read_publication(path: str) -> dict:
    """The publication's JSON object (OSError, ValueError, TypeError when unreadable)."""
    with open(path, "rb") as f:
        d = json.loads(f.read(MAX_PUBLICATION_BYTES))
    if not isinstance(d, dict):
        raise TypeError("not a JSON object")
    return d


def write_publication(root: str | os.PathLike, body: dict) -> None:
    """Publish ``body`` atomically (a temp file renamed over the last one)."""
    d = os.path.join(os.fspath(root), EVICTOR_DIR)
    tmp = os.path.join(d, f".usage.{os.urandom(4).hex()}.tmp")
    os.makedirs(d, mode=0o755, exist_ok=True)
    try:
        with open(tmp, "wb") as f:
            f.write(json.dumps(body).encode())
        os.replace(tmp, os.path.join(d, USAGE_FILE))
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


class CapacityGuard:
    """A writer's check against the evictor's last publication (module docstring)."""

    def __init__(self, root: str | os.PathLike, namespace: str, ledger: LedgerWriter,
                 stale_s: float = 30.0):
        self.path = usage_path(root)
        self.namespace = namespace
        self.ledger = ledger
        self.stale_s = stale_s
        self._seen: tuple[int, int] | None = None
        # The last publication and its consumed offsets of this namespace, one pair
        # (writer threads read it while another replaces it).
        self._last: tuple[Published, dict[str, int]] | None = None

    def published(self) -> Published | None:
        """The evictor's last publication; None when there is none or it is older than
        ``stale_s`` (no evictor now: writes are not held back)."""
        last = self._current()
        return last[0] if last is not None else None

    def _current(self) -> tuple[Published, dict[str, int]] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            self._seen = self._last = None
            return None
        if time.time() - st.st_mtime > self.stale_s:
            self._seen = self._last = None
            return None
        if self._seen != (st.st_ino, st.st_mtime_ns):
            self._seen = (st.st_ino, st.st_mtime_ns)    # read once, parsed or not
            try:
                pub = Published.parse(read_publication(self.path))
                self._last = (pub, pub.consumed_of(self.namespace))
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                self._last = None
        return self._last

    def refusal(self, nbytes: int, tag: int = DEFAULT_TAG) -> str | None:
        """Why a write of ``nbytes`` of tenant ``tag``'s is refused now (None: it may
        go ahead)."""
        last = self._current()
        if last is None:
            return None
        pub, consumed = last
        mine = self.ledger.unaccounted(consumed) + nbytes
        mine_tag = self.ledger.unaccounted(consumed, tag) + nbytes \
            if pub.quotas is not None else 0
        return pub.refusal(self.namespace, mine, tag, mine_tag)

    def allows(self, nbytes: int, tag: int = DEFAULT_TAG) -> bool:
        return self.refusal(nbytes, tag) is None
