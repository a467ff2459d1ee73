"""Group commit: the journal rows of all the calls served in one event-loop turn, written
in ONE transaction at the start of the next turn, and those calls answered together.

Each handler hands its call's rows over (:meth:`GroupCommit.submit`: no I/O) and its
answer awaits :meth:`GroupCommit.durable`. The first hand-over of a turn schedules the
flush (``loop.call_soon``): it runs after every handler that was ready in this turn,
writes what they all handed over (:meth:`Journal.write_batches`) and wakes them. A busy
scheduler thus pays one commit (with ``sync = "full"`` one fsync) for the calls that
arrived together, an idle one the same as a commit per call.

Why not a writer thread (tried first): Python's sqlite3 releases the GIL around each
row's step and takes it back after, so a writer thread and a busy event loop hand the
GIL to each other per row instead of overlapping. Measured (bench/scheduler.py,
saturated, one pair on a moment when the host's second core was free): the daemon
still used 0.97 cores, at +34 us of CPU per request over plain (4 calls per commit);
with the writes on the loop, +14 to +24 us (contended host, ~1 call per commit).

Why it keeps the journal's contract (docs/reliability.md): commits happen in the order
of hand-over, and an answer waits for the newest batch handed over when it was built, so
it never shows a state (an accepted request, an ended one, an attempt number, a lease
id) that is not on disk, whoever changed it. A SIGKILL loses only batches whose calls
have not been answered.

Failure: a write that fails (disk full, I/O error) fails its callers and every later one
with the same :class:`JournalError`; nothing more is written, and ``on_error`` runs once
(the service stops: fail-stop).

Threads: the event loop's only (the journal too).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from dualpath.scheduler.journal import Batch, Journal, JournalError


class GroupCommit:
    """Group commit into ``journal`` on ``loop``. ``on_commit(seconds, calls)`` after each
    commit (metrics); ``on_error(e)`` once, when a write failed."""

    def __init__(self, journal: Journal, loop: asyncio.AbstractEventLoop, *,
                 on_error: Callable[[JournalError], None] | None = None,
                 on_commit: Callable[[float, int], None] | None = None):
        self.journal = journal
        self._loop = loop
        self._on_error = on_error
        self._on_commit = on_commit
        self._pending: list[Batch] = []
        # Resolves (to None, or the JournalError) once the pending batches are written.
        self._pending_done: asyncio.Future | None = None
        self._last: asyncio.Future | None = None      # the newest batch's
        self._closed = False
        self.error: JournalError | None = None
        self.commits = 0

    def submit(self, batch: Batch) -> None:
        """Hand ``batch`` (built from the core's events just now) over; it is written at
        the start of the next loop turn. Raises the JournalError of an earlier failed
        write, or if closed."""
        if self.error is not None:
            raise self.error
        if self._closed:
            raise JournalError(f"journal {self.journal.path}: write after close")
        if self._pending_done is None:
            self._pending_done = self._loop.create_future()
            self._loop.call_soon(self.flush)
        self._pending.append(batch)
        self._last = self._pending_done

    async def durable(self) -> None:
        """Until everything handed over so far is committed; raises its JournalError."""
        fut = self._last
        if fut is None:
            return
        if not fut.done():
            # Shielded: a caller that is cancelled must not cancel the future the other
            # callers of its batch wait on.
            await asyncio.shield(fut)
        err = fut.result()
        if err is not None:
            raise err

    def flush(self) -> None:
        """Write what was handed over, in one transaction, and wake its callers."""
        batches, done = self._pending, self._pending_done
        self._pending, self._pending_done = [], None
        if done is None:
            return
        err = self.error
        if err is None:
            t0 = time.perf_counter()
            try:
                self.journal.write_batches(batches)
            except JournalError as e:
                err = self.error = e
            except Exception as e:     # noqa: BLE001 - anything else is a failed write too
                err = self.error = JournalError(
                    f"journal {self.journal.path}: write failed: {e!r}")
            else:
                self.commits += 1
                if self._on_commit is not None:
                    self._on_commit(time.perf_counter() - t0, sum(b.calls for b in batches))
        if not done.done():
            done.set_result(err)
        if err is not None and self._on_error is not None:
            on_error, self._on_error = self._on_error, None
            on_error(err)

    def close(self) -> None:
        """Write what was handed over; later hand-overs are refused (idempotent). The
        journal itself is its opener's to close."""
        if not self._closed:
            self.flush()
            self._closed = True
