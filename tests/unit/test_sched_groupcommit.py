"""Group commit (dualpath.scheduler.groupcommit): the calls of one loop turn share one
transaction, written at the start of the next turn, and their answers wait for it; a
failed write fails its callers and every later one and reports once; close() writes what
was handed over; a copy of the files taken when a caller was answered (a SIGKILL) holds
everything acknowledged."""

import asyncio
import shutil

import pytest

from dualpath.scheduler.core import Params, RequestSpec
from dualpath.scheduler.groupcommit import GroupCommit
from dualpath.scheduler.journal import Batch, Journal, JournalError, open_scheduler

P = Params(alpha_tokens=10**9, beta_tokens=10**9)


class CountingJournal(Journal):
    def __init__(self, path):
        super().__init__(path)
        self.written: list[int] = []       # calls per transaction
        self.fail: Exception | None = None

    def write_batches(self, batches):
        if self.fail is not None:
            raise self.fail
        super().write_batches(batches)
        self.written.append(sum(b.calls for b in batches))


def submitted(s, *ids):
    s.submit([RequestSpec(10, 0, 1, rid) for rid in ids])
    batch = Batch(s.journal)
    s.journal.clear()
    return batch


def test_the_calls_of_one_turn_share_a_commit_and_wait_for_it(tmp_path):
    async def body():
        j = CountingJournal(tmp_path / "j.sqlite")
        s = open_scheduler(P, j, 0.0)
        commits = []
        w = GroupCommit(j, asyncio.get_running_loop(),
                        on_commit=lambda sec, calls: commits.append(calls))

        async def call(rid):
            w.submit(submitted(s, rid))
            assert j.written == [] or rid == "d"   # not on disk when handed over
            await w.durable()
            return rid in {r.request_id for r in j.load()[0]}

        first = [asyncio.create_task(call(rid)) for rid in ("a", "b", "c")]
        assert await asyncio.gather(*first) == [True, True, True]
        assert j.written == [3] and commits == [3]
        assert await call("d")                        # a later turn: its own commit
        assert j.written == [3, 1]
        await w.durable()                             # nothing pending: at once
        w.close()
        w.close()                                     # idempotent
        j.close()

    asyncio.run(body())


def test_a_failed_write_fails_its_callers_and_every_later_one(tmp_path):
    async def body():
        j = CountingJournal(tmp_path / "j.sqlite")
        s = open_scheduler(P, j, 0.0)
        errors = []
        w = GroupCommit(j, asyncio.get_running_loop(), on_error=errors.append)
        j.fail = JournalError("journal x: write failed: disk full")
        w.submit(submitted(s, "a"))
        w.submit(submitted(s, "b"))
        for _ in range(2):
            with pytest.raises(JournalError, match="disk full"):
                await w.durable()
        assert len(errors) == 1
        with pytest.raises(JournalError, match="disk full"):
            w.submit(submitted(s, "c"))
        w.close()
        assert j.written == []
        j.fail = None
        assert j.load()[0] == []
        j.close()

    asyncio.run(body())


class LateLoop:
    """The loop, its call_soon 50 ms late (callers are waiting when the flush runs)."""

    def __init__(self, loop):
        self.loop = loop

    def create_future(self):
        return self.loop.create_future()

    def call_soon(self, callback):
        self.loop.call_later(0.05, callback)


def test_a_cancelled_caller_does_not_cancel_the_others(tmp_path):
    async def body():
        j = CountingJournal(tmp_path / "j.sqlite")
        s = open_scheduler(P, j, 0.0)
        w = GroupCommit(j, LateLoop(asyncio.get_running_loop()))
        w.submit(submitted(s, "a"))
        gone = asyncio.create_task(w.durable())
        kept = asyncio.create_task(w.durable())
        await asyncio.sleep(0.01)
        assert not kept.done()
        gone.cancel()
        await asyncio.wait_for(kept, 10)
        assert gone.cancelled() and j.written == [1]
        w.close()
        j.close()

    asyncio.run(body())


def test_close_writes_what_was_handed_over(tmp_path):
    async def body():
        j = Journal(tmp_path / "j.sqlite")
        s = open_scheduler(P, j, 0.0)
        w = GroupCommit(j, asyncio.get_running_loop())
        for i in range(20):
            w.submit(submitted(s, f"r{i}"))
        w.close()
        with pytest.raises(JournalError, match="after close"):
            w.submit(submitted(s, "late"))
        assert len(j.load()[0]) == 20
        await asyncio.sleep(0)                        # the scheduled flush: nothing left
        j.close()

    asyncio.run(body())


def test_what_was_acknowledged_survives_a_kill(tmp_path):
    # The files as they are the instant a caller is answered (copied before anything is
    # closed: closing would checkpoint) hold its request and every earlier one.
    async def body():
        path = tmp_path / "j.sqlite"
        j = Journal(path)
        s = open_scheduler(P, j, 0.0)
        w = GroupCommit(j, asyncio.get_running_loop())
        for i in range(50):
            w.submit(submitted(s, f"r{i}"))
            if i % 7 == 0:
                await w.durable()
        await w.durable()
        for suffix in ("", "-wal"):
            shutil.copyfile(f"{path}{suffix}", f"{tmp_path}/copy.sqlite{suffix}")
        w.close()
        j.close()
        k = Journal(tmp_path / "copy.sqlite")
        assert len(k.load()[0]) == 50
        k.close()

    asyncio.run(body())
