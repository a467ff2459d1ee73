"""The scheduler's journal: what must survive a restart, in SQLite (WAL mode).

Why SQLite: it is embedded (no second daemon to run and fail), its transactions are
atomic and crash-safe, and in WAL mode a commit is an append to one file: a SIGKILL at
any instant leaves the last committed transaction in place and nothing half-written.
Python ships it. A log of our own would need the framing, checksums and compaction that
SQLite already has.

What is journaled (docs/reliability.md): a request when it is submitted (with its spec
and payload), every change of its attempt number or its failed and lost counts, its end
(outcome, attempt, reason, payload digest), that its submitter took the result
(reported), the trimming of old ended requests, and the lease and arrival counters (so
lease ids and arrival order never repeat after a restart). Not journaled: placements, PREFILL_DONE and
engine loads: after a restart the groups' claims say what is running (the scheduler
reconciles), and a request nobody claims runs again under a new attempt number.

When: the core appends events to ``Scheduler.journal`` while it handles a call; the
service turns them into a :class:`Batch` of plain rows at once (nothing in it refers to
the core's objects any more, so the core may go on changing them) and
:meth:`Journal.write_batches` writes one or several calls' batches in ONE transaction
(group commit, :mod:`dualpath.scheduler.groupcommit`: the calls of one event-loop turn
together, each call's answer waiting until its batch, and every batch before it, is
committed). So an acknowledged submission, and a DECODE_DONE before
its submitter can see it, are on disk. ``sync = "normal"`` survives the process being
killed at any instant (the commit is in the WAL file; fsync at checkpoints); ``"full"``
fsyncs every commit and so also survives power loss, at the price of one fsync per
group commit.

Layout (schema 3; 2 had no ``lost`` columns): integer keys only, so every insert appends
at the right edge of its B-tree and no index on the text id has to be kept. ``requests`` holds the live ones,
keyed by arrival number ``seq`` (updated in place at an attempt change); at its end a
request's row moves to ``ended``, keyed by ``finish_seq`` (its payload dropped, the
core's digest of it kept), and the trim of the oldest ended ones is a range delete at
the left edge. An id submitted again after the scheduler forgot it gets a new seq:
:meth:`Journal.load` keeps the newest row of an id. Trimming is lazy: ended rows are
deleted ``TRIM_CHUNK`` at a time, so the file holds up to that many ended rows more than
``finished_requests_kept``, and ``load`` returns them all (the caller keeps the newest
``finished_requests_kept``, as the core does). A schema-1 file (one table keyed by the
text id) is converted on open, in one transaction, and so is a schema-2 file (its live
requests lost no attempt yet: 0).

The journal file is locked while open (``locking_mode = EXCLUSIVE``): a second scheduler
on the same file fails at start-up instead of interleaving its writes.

Threads: the thread that opened it (the daemon's event loop) only.
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

from dualpath.errors import DualPathError
from dualpath.scheduler.core.model import Finished, Outcome, Params, Request
from dualpath.scheduler.core.scheduler import Scheduler

SCHEMA_VERSION = 3
SYNC_MODES = ("normal", "full")
# Ended rows are deleted this many at a time (one range delete instead of one per end).
TRIM_CHUNK = 1024
# Checkpoint (copy the WAL into the database) every this many WAL pages, not SQLite's
# 1,000: a page rewritten many times between checkpoints is copied once (measured: the
# journal's CPU per request -25 %); the WAL file stays under ~40 MiB.
WAL_AUTOCHECKPOINT_PAGES = 10_000

_SCHEMA = """
CREATE TABLE IF NOT EXISTS requests (    -- live requests
    seq INTEGER PRIMARY KEY,             -- arrival number: unique per request, the rowid
    id TEXT NOT NULL,
    prompt_tokens INTEGER NOT NULL,
    hit_tokens INTEGER NOT NULL,
    max_new_tokens INTEGER NOT NULL,
    payload BLOB NOT NULL,
    attempt INTEGER NOT NULL,
    failures INTEGER NOT NULL,
    error TEXT NOT NULL,
    lost INTEGER NOT NULL DEFAULT 0      -- attempts lost with a node (schema 3)
);
CREATE TABLE IF NOT EXISTS ended (       -- ended requests, in the order they ended
    finish_seq INTEGER PRIMARY KEY,      -- the rowid
    seq INTEGER NOT NULL,
    id TEXT NOT NULL,
    outcome INTEGER NOT NULL,            -- dualpath.v1.RequestState
    attempt INTEGER NOT NULL,
    failures INTEGER NOT NULL,
    error TEXT NOT NULL,
    prompt_tokens INTEGER NOT NULL,
    hit_tokens INTEGER NOT NULL,
    max_new_tokens INTEGER NOT NULL,
    payload_crc INTEGER NOT NULL,
    reported INTEGER NOT NULL,
    lost INTEGER NOT NULL DEFAULT 0      -- attempts lost with a node (schema 3)
);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
"""

# Schema 2 -> 3: the live requests' lost attempts (none counted before).
_MIGRATE_2 = """
ALTER TABLE requests ADD COLUMN lost INTEGER NOT NULL DEFAULT 0;
ALTER TABLE ended ADD COLUMN lost INTEGER NOT NULL DEFAULT 0;
"""

# Schema 1 (one table keyed by the text id) -> 3, in one transaction.
_MIGRATE_1 = """
ALTER TABLE requests RENAME TO requests_1;
DROP INDEX IF EXISTS requests_finish;
""" + _SCHEMA + """
INSERT INTO requests SELECT seq, id, prompt_tokens, hit_tokens, max_new_tokens,
    COALESCE(payload, x''), attempt, failures, error, 0 FROM requests_1 WHERE outcome = 0;
INSERT INTO ended SELECT finish_seq, seq, id, outcome, attempt, failures, error,
    prompt_tokens, hit_tokens, max_new_tokens, payload_crc, reported, 0
    FROM requests_1 WHERE outcome != 0;
DROP TABLE requests_1;
"""

_SQL = {
    "new": "INSERT INTO requests VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
    "attempt": "UPDATE requests SET attempt = ?, failures = ?, error = ?, lost = ? "
               "WHERE seq = ?",
    "end": "INSERT INTO ended VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
    "gone": "DELETE FROM requests WHERE seq = ?",           # with each end
    "reported": "UPDATE ended SET reported = 1 WHERE finish_seq = ?",
    "trim": "DELETE FROM ended WHERE finish_seq <= ?",
    "lease": "INSERT OR REPLACE INTO meta VALUES ('next_lease', ?)",
    "seq": "INSERT OR REPLACE INTO meta VALUES ('next_seq', ?)",
}


def _row(kind: str, x) -> tuple:
    if kind == "new":
        return (x.seq, x.request_id, x.prompt_tokens, x.hit_tokens, x.max_new_tokens,
                x.payload, x.attempt, x.failures, x.error, x.lost)
    if kind == "attempt":
        return (x.attempt, x.failures, x.error, x.lost, x.seq)
    if kind == "end":
        k = x.spec_key
        return (x.finish_seq, x.seq, x.request_id, int(x.outcome), x.attempt, x.failures,
                x.error, k[0], k[1], k[2], k[3], int(x.reported), x.lost)
    return (x.finish_seq,)    # reported


class Batch:
    """What one or more calls journaled, as plain rows (values copied from the core's
    objects when it is made, so a later change of the core cannot leak into it): runs of
    rows of one kind in the order of the events, and the newest trim point, lease id and
    arrival number. Rows of different requests commute; two events of one request keep
    their order. Trims are applied after the rows (equivalent: a trim only deletes rows
    that ended at or before it, and a row that ends later ends after it)."""

    __slots__ = ("calls", "lease", "runs", "seq", "trim")

    def __init__(self, events: list[tuple] = ()):
        self.runs: list[tuple[str, list[tuple]]] = []
        self.trim: int | None = None
        self.lease: int | None = None
        self.seq: int | None = None
        self.calls = 0
        if events:
            self.add(events)

    def add(self, events: list[tuple]) -> None:
        runs = self.runs
        kind, rows = (runs[-1] if runs else (None, None))
        for ev in events:
            k, x = ev[0], ev[1]
            if k == "trim":
                self.trim = x if self.trim is None else max(self.trim, x)
                continue
            if k == "lease":
                self.lease = x
                continue
            if k == "new":
                self.seq = x.seq
            if k != kind:
                kind, rows = k, []
                runs.append((k, rows))
            rows.append(_row(k, x))  # type: ignore[union-attr]
        self.calls += 1

    def merge(self, other: Batch) -> None:
        """Append ``other`` (journaled after this one)."""
        for kind, rows in other.runs:
            if self.runs and self.runs[-1][0] == kind:
                self.runs[-1][1].extend(rows)
            else:
                self.runs.append((kind, list(rows)))
        if other.trim is not None:
            self.trim = other.trim if self.trim is None else max(self.trim, other.trim)
        self.lease = other.lease if other.lease is not None else self.lease
        self.seq = other.seq if other.seq is not None else self.seq
        self.calls += other.calls

    def __bool__(self) -> bool:
        return bool(self.runs) or self.trim is not None or self.lease is not None


class JournalError(DualPathError):
    """The journal cannot be opened, read or written (the message names the file)."""


class Journal:
    """One open journal file. See the module docstring."""

    def __init__(self, path: str | Path, sync: str = "normal"):
        if sync not in SYNC_MODES:
            raise JournalError(f"journal sync {sync!r}: allowed {', '.join(SYNC_MODES)}")
        self.path = Path(path)
        self._db: sqlite3.Connection | None = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # It holds payloads: private from the start (SQLite gives its -wal and -shm
            # files the database file's mode).
            os.close(os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600))
            self._db = sqlite3.connect(self.path, isolation_level=None)
            db = self._db
            db.execute("PRAGMA locking_mode = EXCLUSIVE")
            mode = db.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if mode != "wal":
                raise JournalError(f"journal {self.path}: SQLite refused WAL mode ({mode})")
            db.execute(f"PRAGMA synchronous = {sync.upper()}")
            db.execute(f"PRAGMA wal_autocheckpoint = {WAL_AUTOCHECKPOINT_PAGES}")
            db.execute("BEGIN IMMEDIATE")     # takes the exclusive lock now
            version = db.execute("PRAGMA user_version").fetchone()[0]
            if version == 1:
                db.executescript("BEGIN;" + _MIGRATE_1 + "PRAGMA user_version = 3; COMMIT;")
            elif version == 2:
                db.executescript("BEGIN;" + _MIGRATE_2 + "PRAGMA user_version = 3; COMMIT;")
            elif version in (0, SCHEMA_VERSION):
                db.executescript(_SCHEMA)     # (executescript commits)
            else:
                raise JournalError(f"journal {self.path}: schema version {version}, this "
                                   f"scheduler reads {SCHEMA_VERSION} (and converts 1 "
                                   "and 2)")
            db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        except sqlite3.OperationalError as e:
            self.close()
            hint = " (another scheduler has it open?)" if "locked" in str(e) else ""
            raise JournalError(f"journal {self.path}: {e}{hint}") from None
        except sqlite3.DatabaseError as e:
            self.close()
            raise JournalError(f"journal {self.path}: {e}") from None
        except OSError as e:
            self.close()
            raise JournalError(f"journal {self.path}: {e.strerror or e}") from None
        except JournalError:
            self.close()
            raise
        self.sync = sync
        self.commits = 0
        self.trim_chunk = TRIM_CHUNK
        self._trimmed = 0      # rows ended at or before this are deleted

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    def write(self, events: list[tuple]) -> None:
        """Apply ``events`` (one call's, in order) in one transaction."""
        if events:
            self.write_batches([Batch(events)])

    def write_batches(self, batches: list[Batch]) -> None:
        """Apply ``batches`` (in order) in ONE transaction; each run of rows of one kind
        goes through one executemany."""
        if not any(batches):
            return
        b = batches[0]
        if len(batches) > 1:
            b = Batch()
            for x in batches:
                b.merge(x)
        db = self._db
        if db is None:
            raise JournalError(f"journal {self.path}: write after close")
        try:
            db.execute("BEGIN")
            for kind, rows in b.runs:
                db.executemany(_SQL[kind], rows)
                if kind == "end":
                    db.executemany(_SQL["gone"], [(r[1],) for r in rows])
            if b.seq is not None:
                db.execute(_SQL["seq"], (b.seq,))
            if b.lease is not None:
                db.execute(_SQL["lease"], (b.lease,))
            trimmed = self._trimmed
            if b.trim is not None and b.trim - trimmed >= self.trim_chunk:
                db.execute(_SQL["trim"], (b.trim,))
                trimmed = b.trim
            db.execute("COMMIT")
        except sqlite3.Error as e:
            if db.in_transaction:
                db.rollback()
            raise JournalError(f"journal {self.path}: write failed: {e}") from None
        self._trimmed = trimmed
        self.commits += 1

    def load(self) -> tuple[list[Request], list[Finished], int, int]:
        """(live requests, ended ones in the order they ended, next arrival number, next
        lease id) as recorded; of an id recorded twice, the newer row."""
        db = self._db
        if db is None:
            raise JournalError(f"journal {self.path}: read after close")
        live: dict[str, Request] = {}
        ended: dict[str, Finished] = {}
        top_seq = 0
        for (seq, rid, prompt, hit, max_new, payload, attempt, failures,
             error, lost) in db.execute("SELECT * FROM requests"):
            live[rid] = Request(rid, prompt, hit, max_new, payload, seq, attempt=attempt,
                                failures=failures, lost=lost, error=error)
            top_seq = max(top_seq, seq)
        for (finish_seq, seq, rid, outcome, attempt, failures, error, prompt, hit, max_new,
             crc, reported, lost) in db.execute("SELECT * FROM ended"):
            top_seq = max(top_seq, seq)
            other = live.get(rid) or ended.get(rid)
            if other is not None and other.seq > seq:
                continue                  # the id was submitted again since
            live.pop(rid, None)
            ended[rid] = Finished(rid, Outcome(outcome), attempt, failures, error,
                                  (prompt, hit, max_new, crc), 0.0, finish_seq,
                                  bool(reported), seq, lost=lost)
        meta = dict(db.execute("SELECT key, value FROM meta"))
        return (sorted(live.values(), key=lambda r: r.seq),
                sorted(ended.values(), key=lambda f: f.finish_seq),
                max(top_seq, meta.get("next_seq", 0)), meta.get("next_lease", 0))


def open_scheduler(params: Params, journal: Journal | None, now: float, **kw) -> Scheduler:
    """A Scheduler journaling into ``journal`` and holding what it recorded (or a plain
    one without a journal)."""
    if journal is None:
        return Scheduler(params, **kw)
    s = Scheduler(params, journaling=True, **kw)
    live, ended, seq, lease = journal.load()
    for f in ended:
        f.finished_at = now
    keep = params.finished_requests_kept
    s.restore(live, ended[max(0, len(ended) - keep):] if keep else [], next_seq=seq,
              next_lease=lease, now=now)
    return s
