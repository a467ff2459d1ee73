"""The scheduler's journal: what must survive a restart, in SQLite (WAL mode).

Why SQLite: it is embedded (no second daemon to run and fail), its transactions are
atomic and crash-safe, and in WAL mode a commit is an append to one file: a SIGKILL at
any instant leaves the last committed transaction in place and nothing half-written.
Python ships it. A log of our own would need the framing, checksums and compaction that
SQLite already has.

What is journaled (docs/reliability.md): a request when it is submitted (with its spec
and payload), every change of its attempt number or failure count, its end (outcome,
attempt, reason), that its submitter took the result (reported), the trimming of old
ended requests, and the lease and arrival counters (so lease ids and arrival order never
repeat after a restart). Not journaled: placements, PREFILL_DONE and engine loads: after
a restart the groups' claims say what is running (the scheduler reconciles), and a
request nobody claims runs again under a new attempt number.

When: the core appends events to ``Scheduler.journal`` while it handles a call; the
service writes them with :meth:`Journal.write`, one transaction, before it answers. So an
acknowledged submission, and a DECODE_DONE before its submitter can see it, are on disk.
``sync = "normal"`` survives the process being killed at any instant (the commit is in
the WAL file; fsync at checkpoints); ``"full"`` fsyncs every commit and so also survives
power loss, at the price of one fsync per call that changed durable state.

The journal file is locked while open (``locking_mode = EXCLUSIVE``): a second scheduler
on the same file fails at start-up instead of interleaving its writes.

Threads: the thread that opened it (the daemon's event loop) only.
"""

from __future__ import annotations

import os
import sqlite3
import zlib
from pathlib import Path

from dualpath.errors import DualPathError
from dualpath.scheduler.core.model import Finished, Outcome, Params, Request
from dualpath.scheduler.core.scheduler import Scheduler

SCHEMA_VERSION = 1
SYNC_MODES = ("normal", "full")
_LIVE = 0

_SCHEMA = """
CREATE TABLE IF NOT EXISTS requests (
    id TEXT PRIMARY KEY,
    seq INTEGER NOT NULL,
    prompt_tokens INTEGER NOT NULL,
    hit_tokens INTEGER NOT NULL,
    max_new_tokens INTEGER NOT NULL,
    payload BLOB,                     -- NULL once ended (the digest is enough then)
    payload_crc INTEGER NOT NULL,
    attempt INTEGER NOT NULL,
    failures INTEGER NOT NULL,
    error TEXT NOT NULL,
    outcome INTEGER NOT NULL,         -- 0 live, else dualpath.v1.RequestState
    finish_seq INTEGER NOT NULL,
    reported INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS requests_finish ON requests (finish_seq) WHERE outcome != 0;
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
"""

_SQL = {
    "new": "INSERT OR REPLACE INTO requests VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 0, 0, 0)",
    "attempt": "UPDATE requests SET attempt = ?, failures = ?, error = ? WHERE id = ?",
    "end": "UPDATE requests SET outcome = ?, attempt = ?, failures = ?, error = ?, "
           "finish_seq = ?, reported = ?, payload = NULL WHERE id = ?",
    "reported": "UPDATE requests SET reported = 1 WHERE id = ?",
    "trim": "DELETE FROM requests WHERE outcome != 0 AND finish_seq <= ?",
    "lease": "INSERT OR REPLACE INTO meta VALUES ('next_lease', ?)",
    "seq": "INSERT OR REPLACE INTO meta VALUES ('next_seq', ?)",
}


def _row(kind: str, ev: tuple) -> tuple:
    x = ev[1]
    if kind == "new":
        return (x.request_id, x.seq, x.prompt_tokens, x.hit_tokens, x.max_new_tokens,
                x.payload, zlib.crc32(x.payload), x.attempt, x.failures, x.error)
    if kind == "attempt":
        return (x.attempt, x.failures, x.error, x.request_id)
    if kind == "end":
        return (int(x.outcome), x.attempt, x.failures, x.error, x.finish_seq,
                int(x.reported), x.request_id)
    return (x,)


class JournalError(DualPathError):
    """The journal cannot be opened, read or written (the message names the file)."""


class Journal:
    """One open journal file. See the module docstring."""

    def __init__(self, path: str | Path, sync: str = "normal"):
        if sync not in SYNC_MODES:
            raise JournalError(f"journal sync {sync!r}: allowed {', '.join(SYNC_MODES)}")
        self.path = Path(path)
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
            db.execute("BEGIN IMMEDIATE")     # takes the exclusive lock now
            db.executescript(_SCHEMA)         # (executescript commits)
            version = db.execute("PRAGMA user_version").fetchone()[0]
            if version not in (0, SCHEMA_VERSION):
                raise JournalError(f"journal {self.path}: schema version {version}, this "
                                   f"scheduler reads {SCHEMA_VERSION}")
            db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        except sqlite3.OperationalError as e:
            hint = " (another scheduler has it open?)" if "locked" in str(e) else ""
            raise JournalError(f"journal {self.path}: {e}{hint}") from None
        except sqlite3.DatabaseError as e:
            raise JournalError(f"journal {self.path}: {e}") from None
        except OSError as e:
            raise JournalError(f"journal {self.path}: {e.strerror or e}") from None
        self.sync = sync
        self.commits = 0

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    def write(self, events: list[tuple]) -> None:
        """Apply ``events`` (the core's, in order) in one transaction; runs of one kind go
        through one executemany."""
        if not events:
            return
        db = self._db
        try:
            db.execute("BEGIN")
            i, n = 0, len(events)
            while i < n:
                kind = events[i][0]
                j = i
                while j < n and events[j][0] == kind:
                    j += 1
                if kind == "lease":
                    db.execute(_SQL[kind], (events[j - 1][1],))
                else:
                    db.executemany(_SQL[kind], [_row(kind, ev) for ev in events[i:j]])
                    if kind == "new":
                        db.execute(_SQL["seq"], (events[j - 1][1].seq,))
                i = j
            db.execute("COMMIT")
        except sqlite3.Error as e:
            if db.in_transaction:
                db.rollback()
            raise JournalError(f"journal {self.path}: write failed: {e}") from None
        self.commits += 1

    def load(self) -> tuple[list[Request], list[Finished], int, int]:
        """(live requests, ended ones in the order they ended, next arrival number, next
        lease id) as recorded."""
        db = self._db
        live, ended = [], []
        top_seq = 0
        for (rid, seq, prompt, hit, max_new, payload, crc, attempt, failures, error,
             outcome, finish_seq, reported) in db.execute(
                "SELECT * FROM requests ORDER BY seq"):
            top_seq = max(top_seq, seq)
            if outcome == _LIVE:
                live.append(Request(rid, prompt, hit, max_new, payload or b"", seq,
                                    attempt=attempt, failures=failures, error=error))
            else:
                ended.append(Finished(rid, Outcome(outcome), attempt, failures, error,
                                      (prompt, hit, max_new, crc), 0.0, finish_seq,
                                      bool(reported)))
        ended.sort(key=lambda f: f.finish_seq)
        meta = dict(db.execute("SELECT key, value FROM meta"))
        return live, ended, max(top_seq, meta.get("next_seq", 0)), meta.get("next_lease", 0)


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
