"""The scheduler's journal (SQLite, WAL): what a scheduler recorded is what a restarted one
recovers. The property test drives a journaled scheduler through random calls, writing
the journal after each call as the service does, then "crashes" (drops the scheduler
without closing anything) and checks that a scheduler opened on the same file holds
exactly the live requests (with their attempt numbers and failure counts) and the ended
ones (with their outcomes) that the first one had after its last write."""

import contextlib
import dataclasses
import os
import random
import shutil
import sqlite3
import stat

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from dualpath.scheduler.core import (
    Completion,
    CompletionStage,
    EngineReport,
    EngineSpec,
    Outcome,
    Params,
    RequestSpec,
    Role,
    Stage,
)
from dualpath.scheduler.core.model import REQUEST_FIXED_BYTES
from dualpath.scheduler.journal import Batch, Journal, JournalError, open_scheduler
from tests.unit.test_sched_properties import audit

P = Params(alpha_tokens=10**9, beta_tokens=10**9, lease_s=5.0, max_failed_attempts=3,
           max_lost_attempts=2,
           retry_backoff_s=0.2, retry_backoff_max_s=1.0, peer_avoid_s=1.0,
           finished_requests_kept=6)


def snapshot(s):
    live = {rid: (r.attempt, r.failures, r.lost, r.error, r.prompt_tokens, r.hit_tokens,
                  r.max_new_tokens, r.payload) for rid, r in s.requests.items()}
    ended = {rid: (f.outcome, f.attempt, f.failures, f.lost, f.error, f.reported, f.spec_key)
             for rid, f in s.finished.items()}
    return live, ended


class JournalMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        import tempfile

        self.dir = tempfile.mkdtemp(prefix="dp-journal-")
        self.path = f"{self.dir}/sched.sqlite"
        # Trimming is lazy (TRIM_CHUNK ended rows at a time): run both ways.
        self.trim_chunk = random.choice((1, 3, 1024))
        self.journal = self._open(self.path)
        self.now = 0.0
        self.s = open_scheduler(P, self.journal, self.now, rng=random.Random(1))
        self._register()
        self.n = 0
        self.restarts = 0

    def _open(self, path):
        j = Journal(path)
        j.trim_chunk = self.trim_chunk
        return j

    def _register(self):
        for gid, role in (("p0", Role.PREFILL), ("d0", Role.DECODE)):
            self.s.register_group(gid, role, [EngineSpec(f"{gid}.0", 0, f"n-{gid}", "",
                                                         10**6 if role is Role.DECODE
                                                         else 0)], self.now)
        self.commit()

    def commit(self):
        self.journal.write(self.s.journal)
        self.s.journal.clear()
        self.durable = snapshot(self.s)

    def teardown(self):
        self.journal.close()

    @rule(k=st.integers(1, 4), payload=st.binary(max_size=8), again=st.booleans())
    def submit(self, k, payload, again):
        specs = [RequestSpec(10 + i, 3, 2, f"q{self.n + i}", payload) for i in range(k)]
        self.s.submit(specs, self.now)
        if again:   # a client retrying: nothing new, nothing rejected
            res = self.s.submit(specs, self.now)
            assert res.accepted == [] and res.rejected == []
            assert res.ids == [sp.request_id for sp in specs]
        self.n += k
        self.commit()

    @rule(dt=st.floats(0.0, 1.5))
    def fetch(self, dt):
        self.now += dt
        for gid in ("d0", "p0"):
            g = self.s.groups[gid]
            if g.up:
                self.s.fetch(gid, g.lease_id, [EngineReport(e.engine_id, 0, 0, 0, 10**6)
                                               for e in g.engines], self.now)
        self.commit()

    def _running(self):
        return sorted(rid for rid, r in self.s.requests.items()
                      if r.stage in (Stage.PREFILLING, Stage.DECODING))

    @precondition(lambda self: self._running())
    @rule(data=st.data(), stage=st.sampled_from([CompletionStage.PREFILL_DONE,
                                                 CompletionStage.DECODE_DONE,
                                                 CompletionStage.FAILED]),
          pe=st.booleans())
    def complete(self, data, stage, pe):
        r = self.s.requests[data.draw(st.sampled_from(self._running()))]
        e = r.pe if pe and r.stage is Stage.PREFILLING else r.de
        self.s.report(e.group.group_id, e.group.lease_id,
                      [Completion(r.request_id, e.engine_id, stage, r.attempt,
                                  f"err {self.now:.2f}")], self.now)
        self.commit()

    @precondition(lambda self: self.s.requests)
    @rule(data=st.data())
    def cancel(self, data):
        self.s.cancel([data.draw(st.sampled_from(sorted(self.s.requests)))], self.now)
        self.commit()

    @precondition(lambda self: self.s.finished)
    @rule(data=st.data())
    def acknowledge(self, data):
        self.s.acknowledge([data.draw(st.sampled_from(sorted(self.s.finished)))])
        self.commit()

    @rule(dt=st.floats(5.1, 6.0))
    def leases_lapse(self, dt):
        self.now += dt
        self.s.expire(self.now)
        self.commit()
        self._register()

    @rule(uncommitted=st.booleans())
    def crash_and_restart(self, uncommitted):
        """SIGKILL: nothing is closed, calls after the last write are lost. The new
        scheduler holds exactly what was written, and new ids and leases go on."""
        if uncommitted:
            self.s.submit([RequestSpec(5, 0, 1, f"lost{self.n}")], self.now)
        top_seq, top_lease = self.s._next_seq, self.s._next_lease
        # What is on disk at the instant of the kill: the files as they are, copied
        # before the old connection is closed (closing would checkpoint them).
        self.restarts += 1
        path = f"{self.dir}/sched-{self.restarts}.sqlite"
        for suffix in ("", "-wal"):
            with contextlib.suppress(FileNotFoundError):
                shutil.copyfile(self.path + suffix, path + suffix)
        self.journal.close()
        self.path = path
        self.journal = self._open(self.path)
        self.now += 100.0
        self.s = open_scheduler(P, self.journal, self.now, rng=random.Random(2))
        assert snapshot(self.s) == self.durable
        assert all(r.stage is Stage.RECOVERING for r in self.s.requests.values())
        assert self.s._next_seq >= top_seq - uncommitted
        self._register()
        assert min(g.lease_id for g in self.s.groups.values()) > top_lease - 1
        self.s.expire(self.now + P.lease_s)   # nothing claimed: all requeued
        self.commit()

    @invariant()
    def consistent(self):
        audit(self.s)


JournalMachine.TestCase.settings = settings(
    max_examples=40, stateful_step_count=25, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestJournalRecovers = JournalMachine.TestCase


def test_recovered_requests_resume_with_their_attempts_and_outcomes(tmp_path):
    j = Journal(tmp_path / "j.sqlite")
    s = open_scheduler(P, j, 0.0)
    s.submit([RequestSpec(100, 50, 10, "a", b"pa"), RequestSpec(100, 0, 10, "b")])
    s.cancel(["b"], 1.0)
    s.acknowledge(["b"])
    j.write(s.journal)
    j.close()
    j = Journal(tmp_path / "j.sqlite")
    s = open_scheduler(P, j, 10.0)
    a = s.requests["a"]
    assert (a.payload, a.hit_tokens, a.stage) == (b"pa", 50, Stage.RECOVERING)
    f = s.finished["b"]
    assert f.outcome is Outcome.CANCELLED and f.reported
    # Resubmitting an ended id with the same content is a retry, not a new request.
    assert s.submit([RequestSpec(100, 0, 10, "b")]).resubmitted == ["b"]
    # The live ones count against the byte bound again, the ended one no more.
    assert s.held_bytes == a.wire_bytes + REQUEST_FIXED_BYTES > 0
    j.close()


def test_a_second_scheduler_on_the_same_journal_is_refused(tmp_path):
    j = Journal(tmp_path / "j.sqlite")
    with pytest.raises(JournalError, match="another scheduler"):
        Journal(tmp_path / "j.sqlite")
    j.close()
    Journal(tmp_path / "j.sqlite").close()      # free again once closed


def test_a_full_disk_is_a_journal_error_and_nothing_half_written(tmp_path):
    j = Journal(tmp_path / "j.sqlite")
    s = open_scheduler(P, j, 0.0)
    s.submit([RequestSpec(10, 0, 1, "small")])
    j.write(s.journal)
    s.journal.clear()
    pages = j._db.execute("PRAGMA page_count").fetchone()[0]
    j._db.execute(f"PRAGMA max_page_count = {pages + 1}")   # the disk is full
    s.submit([RequestSpec(10, 0, 1, f"big{i}", b"x" * 4000) for i in range(20)])
    with pytest.raises(JournalError, match="full"):
        j.write(s.journal)
    j.close()
    j = Journal(tmp_path / "j.sqlite")
    assert sorted(open_scheduler(P, j, 0.0).requests) == ["small"]
    j.close()


def test_the_file_is_private_from_the_start(tmp_path):
    # It holds payloads (prompts): mode 0600 however permissive the umask.
    old = os.umask(0)
    try:
        Journal(tmp_path / "j.sqlite").close()
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "j.sqlite").st_mode) == 0o600


def test_the_file_is_sqlite_in_wal_mode(tmp_path):
    Journal(tmp_path / "j.sqlite").close()
    with sqlite3.connect(tmp_path / "j.sqlite") as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_an_id_submitted_again_after_it_was_forgotten_is_the_new_request(tmp_path):
    # The core forgets ended requests beyond finished_requests_kept; the journal trims
    # lazily, so the old row of the id may still be there beside the new one.
    p = dataclasses.replace(P, finished_requests_kept=1)
    for chunk in (1, 1024):
        path = tmp_path / f"j{chunk}.sqlite"
        j = Journal(path)
        j.trim_chunk = chunk
        s = open_scheduler(p, j, 0.0)
        s.submit([RequestSpec(10, 0, 1, "a", b"one")])
        s.cancel(["a"], 1.0)
        s.submit([RequestSpec(10, 0, 1, "b")])
        s.cancel(["b"], 2.0)                         # "a" is forgotten
        s.submit([RequestSpec(20, 0, 1, "a", b"two")])
        j.write(s.journal)
        j.close()
        j = Journal(path)
        s = open_scheduler(p, j, 10.0)
        assert sorted(s.requests) == ["a"] and s.requests["a"].payload == b"two"
        assert sorted(s.finished) == ["b"]
        j.close()


SCHEMA_1 = """
CREATE TABLE requests (id TEXT PRIMARY KEY, seq INTEGER NOT NULL,
    prompt_tokens INTEGER NOT NULL, hit_tokens INTEGER NOT NULL,
    max_new_tokens INTEGER NOT NULL, payload BLOB, payload_crc INTEGER NOT NULL,
    attempt INTEGER NOT NULL, failures INTEGER NOT NULL, error TEXT NOT NULL,
    outcome INTEGER NOT NULL, finish_seq INTEGER NOT NULL, reported INTEGER NOT NULL);
CREATE INDEX requests_finish ON requests (finish_seq) WHERE outcome != 0;
CREATE TABLE meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
INSERT INTO requests VALUES ('live', 7, 100, 50, 10, x'7061', 0, 2, 1, 'lost', 0, 0, 0);
INSERT INTO requests VALUES ('done', 3, 100, 0, 10, NULL, 42, 1, 0, '', 5, 9, 1);
INSERT INTO meta VALUES ('next_seq', 8);
INSERT INTO meta VALUES ('next_lease', 4);
PRAGMA user_version = 1;
"""


def test_a_schema_1_journal_is_converted_on_open(tmp_path):
    with contextlib.closing(sqlite3.connect(tmp_path / "j.sqlite")) as db:
        db.executescript(SCHEMA_1)
    j = Journal(tmp_path / "j.sqlite")
    live, ended, seq, lease = j.load()
    assert [(r.request_id, r.seq, r.payload, r.attempt, r.failures, r.error)
            for r in live] == [("live", 7, b"pa", 2, 1, "lost")]
    assert [(f.request_id, f.outcome, f.finish_seq, f.reported, f.spec_key, f.seq)
            for f in ended] == [("done", Outcome.DECODE_DONE, 9, True, (100, 0, 10, 42), 3)]
    assert (seq, lease) == (8, 4)
    j.close()
    with contextlib.closing(sqlite3.connect(tmp_path / "j.sqlite")) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == 3


SCHEMA_2 = """
CREATE TABLE requests (seq INTEGER PRIMARY KEY, id TEXT NOT NULL,
    prompt_tokens INTEGER NOT NULL, hit_tokens INTEGER NOT NULL,
    max_new_tokens INTEGER NOT NULL, payload BLOB NOT NULL, attempt INTEGER NOT NULL,
    failures INTEGER NOT NULL, error TEXT NOT NULL);
CREATE TABLE ended (finish_seq INTEGER PRIMARY KEY, seq INTEGER NOT NULL, id TEXT NOT NULL,
    outcome INTEGER NOT NULL, attempt INTEGER NOT NULL, failures INTEGER NOT NULL,
    error TEXT NOT NULL, prompt_tokens INTEGER NOT NULL, hit_tokens INTEGER NOT NULL,
    max_new_tokens INTEGER NOT NULL, payload_crc INTEGER NOT NULL, reported INTEGER NOT NULL);
CREATE TABLE meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
INSERT INTO requests VALUES (7, 'live', 100, 50, 10, x'7061', 2, 1, 'boom');
INSERT INTO meta VALUES ('next_seq', 8);
PRAGMA user_version = 2;
"""


def test_a_schema_2_journal_gains_the_lost_count_on_open_and_keeps_it(tmp_path):
    path = tmp_path / "j.sqlite"
    with contextlib.closing(sqlite3.connect(path)) as db:
        db.executescript(SCHEMA_2)
    j = Journal(path)
    live, _, seq, _ = j.load()
    assert seq == 8
    assert [(r.request_id, r.attempt, r.failures, r.lost, r.error) for r in live] == [
        ("live", 2, 1, 0, "boom")]
    s = open_scheduler(P, j, 0.0)
    for gid, role in (("p0", Role.PREFILL), ("d0", Role.DECODE)):
        s.register_group(gid, role, [EngineSpec(f"{gid}.0", 0, f"n-{gid}", "",
                                                10**6 if role is Role.DECODE else 0)], 0.0)
    now, r = 0.0, s.requests["live"]
    while r.stage is not Stage.PREFILLING:      # the recovery hold ends; it is placed
        now += 0.5
        assert now < 60
        for gid in ("d0", "p0"):
            g = s.groups[gid]
            s.fetch(gid, g.lease_id, [EngineReport(e.engine_id, 0, 0, 0, 10**6)
                                      for e in g.engines], now)
    placed = r.attempt
    s.expire(now + 100.0)                  # both leases lapse: the attempt is lost
    assert (r.attempt, r.failures, r.lost, r.stage) == (placed + 1, 1, 1, Stage.GLOBAL_QUEUE)
    j.write(s.journal)
    j.close()
    j = Journal(path)
    (r,), _, _, _ = j.load()
    assert (r.attempt, r.failures, r.lost) == (placed + 1, 1, 1)
    j.close()
    with contextlib.closing(sqlite3.connect(path)) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == 3


def test_a_newer_schema_is_refused(tmp_path):
    with contextlib.closing(sqlite3.connect(tmp_path / "j.sqlite")) as db:
        db.execute("PRAGMA user_version = 9")
    with pytest.raises(JournalError, match="schema version 9"):
        Journal(tmp_path / "j.sqlite")
    with contextlib.closing(sqlite3.connect(tmp_path / "j.sqlite")) as db:   # not locked
        db.execute("PRAGMA user_version = 0")
    Journal(tmp_path / "j.sqlite").close()


def test_a_batch_keeps_the_values_it_was_made_with(tmp_path):
    # Rows are copied when the batch is made (the writer thread writes it later while
    # the core goes on changing the same objects).
    j = Journal(tmp_path / "j.sqlite")
    s = open_scheduler(P, j, 0.0)
    s.submit([RequestSpec(10, 0, 1, "a")])
    batch = Batch(s.journal)
    s.journal.clear()
    s.requests["a"].attempt = 99
    j.write_batches([batch])
    j.close()
    j = Journal(tmp_path / "j.sqlite")
    assert [r.attempt for r in j.load()[0]] == [1]
    j.close()
