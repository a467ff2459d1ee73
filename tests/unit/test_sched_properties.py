"""Property tests (hypothesis, stateful) of the scheduler core's invariants:

* nothing is assigned to an overloaded (tok_e > β) or drained engine;
* the PE order is FIFO (a PE fetch hands out a prefix of the prefill queue), and the PE
  picked is the one §6.1 names given the loads at that moment;
* HBM is never over-committed (a DE receives at most its reported free HBM);
* every request is in exactly one place (a queue, an engine, the backoff area or the
  recovery hold) until it ends (DECODE_DONE, FAILED, CANCELLED), and then in the finished
  records only — none lost, none duplicated — across fetches, completions, failures,
  drains, cancels, lease expiry, release and re-registration with claims;
* a given-up attempt is announced to the engines that hold it and never finishes the
  request; failed attempts stay within the budget; resubmitting a known id adds nothing.
The quota invariant of intra-engine batching is in test_sched_batching.py.
"""

from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from dualpath.scheduler.core import (
    Claim,
    Completion,
    CompletionStage,
    EngineReport,
    EngineSpec,
    LeaseError,
    Outcome,
    Params,
    RequestSpec,
    Role,
    Scheduler,
    Stage,
)
from dualpath.scheduler.core.model import REQUEST_FIXED_BYTES, wire_bytes

ALPHA, BETA, HBM = 500, 1000, 2000
LEASE_S = 10.0
BUDGET = 3
# Loads drawn often right at the thresholds, where an off-by-one would show.
TOKENS = st.one_of(st.integers(0, 2 * BETA), st.sampled_from([BETA - 1, BETA, BETA + 1]))
READ_Q = st.one_of(st.integers(0, 2 * ALPHA), st.sampled_from([0, ALPHA - 150, ALPHA, ALPHA + 1]))


def audit(s: Scheduler) -> None:
    """Every live request is in exactly one place, consistent with its stage."""
    where = Counter()
    for r in s.global_queue:
        assert r.stage is Stage.GLOBAL_QUEUE and r.de is None and r.pe is None
        where[r.request_id] += 1
    for g in s.groups.values():
        for r in g.private_queue:
            assert g.up and r.stage is Stage.GROUP_QUEUE and r.de_group is g
            where[r.request_id] += 1
        if g.role is Role.DECODE:
            assert g.private_tokens == sum(r.prompt_tokens for r in g.private_queue)
    for r in s.prefill_queue:
        assert r.stage is Stage.PREFILL_QUEUE and r.de is not None and r.de.group.up
        assert r.pe is None
        where[r.request_id] += 1
    for r in s.requests.values():
        if r.stage in (Stage.PREFILLING, Stage.DECODING):
            assert r.de is not None and r.de.group.up
            if r.stage is Stage.PREFILLING:
                assert r.pe is not None and r.pe.group.up
            where[r.request_id] += 1
        assert r.failures < s.params.max_failed_attempts
        assert r.lost < s.params.max_lost_attempts
        assert r.attempt >= r.failures + r.lost + 1
    for rid, r in s.backoff.items():
        assert r.stage is Stage.BACKOFF and r.de is None and s.requests[rid] is r
        where[rid] += 1
    for rid, r in s.recovering.items():
        assert r.stage is Stage.RECOVERING and r.de is None and s.requests[rid] is r
        where[rid] += 1
    stages = Counter(r.stage for r in s.requests.values())
    counts = s.stage_counts()
    assert all(counts[st] == stages[st] for st in counts), (counts, stages)
    assert set(where) == set(s.requests), "a request is lost or unknown"
    assert all(n == 1 for n in where.values()), f"duplicated: {where.most_common(3)}"
    assert not set(s.finished) & set(s.requests), "a request is both live and ended"
    c = s.counters
    assert c.submitted == c.completed + c.failed + c.cancelled + len(s.requests)
    for r in s.requests.values():   # the byte bound's books: live requests only
        assert r.wire_bytes == wire_bytes(r.request_id, r.payload)
    assert s.held_bytes == sum(r.wire_bytes + REQUEST_FIXED_BYTES for r in s.requests.values())
    for f in s.finished.values():
        assert f.failures <= s.params.max_failed_attempts
        assert f.lost <= s.params.max_lost_attempts
        # FAILED once a budget is spent, or at once by a final failure (no retry).
        assert (f.outcome is Outcome.FAILED) == (
            f.failures == s.params.max_failed_attempts or f.final
            or f.lost == s.params.max_lost_attempts)
        assert not f.final or f.outcome is Outcome.FAILED


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.s = Scheduler(Params(alpha_tokens=ALPHA, beta_tokens=BETA, lease_s=LEASE_S,
                                  max_assignments_per_fetch=7, split_align_tokens=8,
                                  default_read_tokens_per_s=100.0,
                                  max_failed_attempts=BUDGET, max_lost_attempts=BUDGET + 1))
        self.now = 0.0
        self.leases: dict[str, int] = {}
        self.roles: dict[str, Role] = {}
        # What each leader believes its engines hold: request id -> (engine id, attempt)
        # as assigned, minus completed, failed and cancelled. The scheduler must agree
        # (see the invariant below).
        self.held: dict[str, dict[str, tuple[str, int]]] = {}

    # ---------------------------------------------------------------- set-up

    @initialize(pe=st.integers(1, 4), de=st.integers(1, 4))
    def two_groups(self, pe, de):
        self.register(Role.PREFILL, pe, 0)
        self.register(Role.DECODE, de, 0)

    @rule(role=st.sampled_from([Role.PREFILL, Role.DECODE]), n=st.integers(1, 4),
          slot=st.integers(0, 2))
    def register(self, role, n, slot):
        gid = f"{role.name[0].lower()}{slot}"
        if gid in self.roles and self.roles[gid] is not role:
            return
        # Engines alternate between two nodes, so categories differ inside a group.
        specs = [EngineSpec(f"{gid}.{k}", k, f"node-{gid}-{k % 2}", "", HBM)
                 for k in range(n)]
        g = self.s.register_group(gid, role, specs, self.now)
        self.leases[gid] = g.lease_id
        self.roles[gid] = role
        self.held[gid] = {}
        self.s.take_cancelled(g)   # the registration answer (claimed nothing)

    @rule(sizes=st.lists(st.tuples(st.integers(1, 400), st.integers(0, 400),
                                   st.integers(0, 200)), min_size=1, max_size=8))
    def submit(self, sizes):
        self.s.submit([RequestSpec(p, h, g) for p, h, g in sizes])

    # ---------------------------------------------------------------- fetches

    def _up(self, role):
        return sorted(g for g, r in self.roles.items()
                      if r is role and self.s.groups[g].up)

    @precondition(lambda self: self._up(Role.PREFILL))
    @rule(data=st.data())
    def fetch_prefill(self, data):
        gid = data.draw(st.sampled_from(self._up(Role.PREFILL)))
        g = self.s.groups[gid]
        read_q = {e.node.node_id: data.draw(READ_Q) for e in g.engines}
        reports = [EngineReport(e.engine_id, data.draw(st.integers(0, 5)), data.draw(TOKENS),
                                read_q[e.node.node_id]) for e in g.engines]
        limit = data.draw(st.integers(0, 9))
        before = list(self.s.prefill_queue)
        # The oracle state: loads as reported, then updated after each assignment.
        tok = {r.engine_id: r.tok for r in reports}
        node_q = {e.node.node_id: e.node.read_q for e in self.s.engines.values()}
        node_q.update(read_q)
        res = self.s.fetch(gid, self.leases[gid], reports, self.now, limit)
        out = res.assignments
        self._received(gid, res)
        assert out == before[:len(out)], "PE order is not FIFO"
        for r in out:
            e = r.pe
            assert e.group is g and not e.drained
            assert tok[e.engine_id] <= BETA, "assigned to an overloaded PE"
            eligible = [x for x in g.engines if not x.drained and tok[x.engine_id] <= BETA]
            short = [x for x in eligible if node_q[x.node.node_id] <= ALPHA]
            category = short if short else eligible
            assert e in category, "a short-read-queue PE was available"
            assert tok[e.engine_id] == min(tok[x.engine_id] for x in category)
            assert r.prefill_read_tokens + r.decode_read_tokens == r.hit_tokens
            tok[e.engine_id] += r.prompt_tokens
            node_q[e.node.node_id] += r.prefill_read_tokens
            node_q[r.de.node.node_id] += r.decode_read_tokens
        cap = min(limit, 7) if limit else 7
        if len(out) < cap and self.s.prefill_queue:
            assert all(x.drained or tok[x.engine_id] > BETA for x in g.engines), \
                "the fetch ended while an eligible PE remained"

    @precondition(lambda self: self._up(Role.DECODE))
    @rule(data=st.data())
    def fetch_decode(self, data):
        gid = data.draw(st.sampled_from(self._up(Role.DECODE)))
        g = self.s.groups[gid]
        reports = [EngineReport(e.engine_id, data.draw(st.integers(0, 5)),
                                data.draw(TOKENS), data.draw(READ_Q),
                                data.draw(st.integers(0, HBM)))
                   for e in g.engines]
        free = {r.engine_id: r.free_hbm_tokens for r in reports}
        res = self.s.fetch(gid, self.leases[gid], reports, self.now)
        self._received(gid, res)
        used = Counter()
        for r in res.assignments:
            assert r.de.group is g and not r.de.drained
            used[r.de.engine_id] += r.hbm_tokens
        for eid, n in used.items():
            assert n <= free[eid], "HBM over-committed"
        if any(not e.drained for e in g.engines):
            assert not self.s.global_queue, "the group phase must drain the global queue"

    def _received(self, gid, res):
        held = self.held[gid]
        for rid in res.cancelled:
            held.pop(rid, None)
        for r in res.assignments:
            e = r.pe if res.role is Role.PREFILL else r.de
            held[r.request_id] = (e.engine_id, r.attempt)

    # ---------------------------------------------------------------- completions

    def _held(self, stage):
        return sorted((r for r in self.s.requests.values() if r.stage is stage),
                      key=lambda r: r.seq)

    def _given_up(self, r, before_failures):
        """After a FAILED report: back at the global queue's head with the next attempt,
        or ended FAILED when that was the last of its budget."""
        if before_failures + 1 >= BUDGET:
            assert r.request_id not in self.s.requests
            assert self.s.finished[r.request_id].outcome is Outcome.FAILED
        else:
            assert self.s.global_queue[0] is r and r.failures == before_failures + 1

    @precondition(lambda self: self._held(Stage.PREFILLING))
    @rule(data=st.data(), fail=st.booleans())
    def prefill_done(self, data, fail):
        r = data.draw(st.sampled_from(self._held(Stage.PREFILLING)))
        gid = r.pe.group.group_id
        de_group, attempt, failures = r.de.group, r.attempt, r.failures
        stage = CompletionStage.FAILED if fail else CompletionStage.PREFILL_DONE
        acc, ign = self.s.report(gid, self.leases[gid], [Completion(
            r.request_id, r.pe.engine_id, stage, attempt)], self.now)
        assert (acc, ign) == (1, [])
        self.held[gid].pop(r.request_id)
        if fail:
            self._given_up(r, failures)
            assert r.request_id in de_group.pending_cancel, "the DE must drop it too"
        else:
            assert r.stage is Stage.DECODING

    @precondition(lambda self: self._held(Stage.DECODING))
    @rule(data=st.data(), fail=st.booleans(), stale=st.booleans())
    def decode_done(self, data, fail, stale):
        r = data.draw(st.sampled_from(self._held(Stage.DECODING)))
        gid = r.de.group.group_id
        stage = CompletionStage.FAILED if fail else CompletionStage.DECODE_DONE
        if stale:   # an old attempt's report: ignored, whatever it says
            comp = Completion(r.request_id, r.de.engine_id, stage, r.attempt + 1)
            assert self.s.report(gid, self.leases[gid], [comp], self.now) == \
                (0, [r.request_id])
            return
        failures = r.failures
        comp = Completion(r.request_id, r.de.engine_id, stage, r.attempt)
        assert self.s.report(gid, self.leases[gid], [comp], self.now)[0] == 1
        self.held[gid].pop(r.request_id)
        if fail:
            self._given_up(r, failures)
        else:
            assert r.request_id not in self.s.requests
            assert self.s.finished[r.request_id].outcome is Outcome.DECODE_DONE
            # A retried report is ignored, not an error.
            assert self.s.report(gid, self.leases[gid], [comp], self.now) == \
                (0, [r.request_id])

    # ---------------------------------------------------------------- failures

    @rule(dt=st.floats(0.0, 2 * LEASE_S), keep=st.sets(st.integers(0, 2)))
    def time_passes(self, dt, keep):
        """Some groups keep their lease alive (an empty report renews it); the rest may
        miss the deadline: marked down, their unfinished requests back at the head of the
        queue, in arrival order, ahead of what was waiting."""
        self.now += dt
        for gid, g in list(self.s.groups.items()):
            if g.up and int(gid[1:]) in keep and self.now <= g.deadline:
                self.s.report(gid, self.leases[gid], [], self.now)
        late = {g for g in self.s.groups.values() if g.up and self.now > g.deadline}
        held = sorted((r for r in self.s.requests.values() if r.de_group in late or (
            r.stage is Stage.PREFILLING and r.pe.group in late)), key=lambda r: r.seq)
        waiting_global = list(self.s.global_queue)
        down = self.s.expire(self.now)
        assert set(down) == late
        back = [r for r in held if r.request_id in self.s.requests]
        assert list(self.s.global_queue) == back + waiting_global
        assert all(r not in self.s.prefill_queue for r in held)
        for g in down:
            self.held[g.group_id] = {}  # a leader without a lease drops everything
            assert not g.up and not g.private_queue
            try:
                self.s.fetch(g.group_id, self.leases[g.group_id], [], self.now)
                raise AssertionError("a down group must not fetch")
            except LeaseError:
                pass

    @precondition(lambda self: self.s.engines)
    @rule(data=st.data(), undo=st.booleans())
    def drain(self, data, undo):
        eid = data.draw(st.sampled_from(sorted(self.s.engines)))
        assert self.s.drain(eid, undo).drained is (not undo)

    @precondition(lambda self: self._held(Stage.PREFILLING))
    @rule(data=st.data())
    def decode_side_fails_during_prefill(self, data):
        """The DE gives up while the PE is still prefilling: the request goes back to the
        global queue and the PE is told to drop it on its next fetch."""
        r = data.draw(st.sampled_from(self._held(Stage.PREFILLING)))
        gid = r.de.group.group_id
        comp = Completion(r.request_id, r.de.engine_id, CompletionStage.FAILED)
        pe_group, failures = r.pe.group, r.failures
        assert self.s.report(gid, self.leases[gid], [comp], self.now) == (1, [])
        self.held[gid].pop(r.request_id)
        self._given_up(r, failures)
        assert pe_group.pending_cancel[-1] == r.request_id

    @precondition(lambda self: self.s.requests or self.s.finished)
    @rule(data=st.data())
    def cancel(self, data):
        rid = data.draw(st.sampled_from(sorted(set(self.s.requests) | set(self.s.finished))))
        live = rid in self.s.requests
        before = self.s.finished.get(rid)
        (got,) = self.s.cancel([rid], self.now)
        assert rid not in self.s.requests
        if live:
            assert got.outcome is Outcome.CANCELLED
        else:
            assert got is before, "an ended request is left as it ended"

    @precondition(lambda self: self.s.requests or self.s.finished)
    @rule(data=st.data())
    def resubmit(self, data):
        """A client retrying a submission it already made adds nothing."""
        rid = data.draw(st.sampled_from(sorted(set(self.s.requests) | set(self.s.finished))))
        r = self.s.requests.get(rid)
        if r is None:
            return   # the finished record keeps only a digest: covered in the unit tests
        n = len(self.s.requests)
        res = self.s.submit([RequestSpec(r.prompt_tokens, r.hit_tokens,
                                               r.max_new_tokens, rid, r.payload)])
        assert res.accepted == [] and res.rejected == [] and res.resubmitted == [rid]
        assert res.ids == [rid]
        assert len(self.s.requests) == n

    @precondition(lambda self: self._up(Role.PREFILL) + self._up(Role.DECODE))
    @rule(data=st.data(), release=st.booleans(), forget=st.sets(st.integers(0, 9)))
    def leader_restarts(self, data, release, forget):
        """A leader releases its lease (graceful shutdown) or registers again while up,
        claiming what its engines still run (some claims forgotten): the claimed stay,
        the rest are given back without counting as failures."""
        gid = data.draw(st.sampled_from(self._up(Role.PREFILL) + self._up(Role.DECODE)))
        g = self.s.groups[gid]
        failures = {rid: r.failures for rid, r in self.s.requests.items()}
        if release:
            self.s.release_group(gid, self.leases[gid], self.now)
            assert not g.up
            self.held[gid] = {}
            assert self.s.release_group(gid, self.leases[gid], self.now) == 0  # idempotent
        else:
            held = sorted(self.held[gid].items())
            claims = [Claim(rid, eid, att, self.s.requests[rid].stage is Stage.DECODING
                            if rid in self.s.requests else False)
                      for i, (rid, (eid, att)) in enumerate(held) if i not in forget]
            specs = [EngineSpec(e.engine_id, e.rank, e.node.node_id, "", e.hbm_tokens)
                     for e in g.engines]
            g2 = self.s.register_group(gid, g.role, specs, self.now, claims=claims)
            self.leases[gid] = g2.lease_id
            refused = set(self.s.take_cancelled(g2))
            self.held[gid] = {c.request_id: (c.engine_id, c.attempt) for c in claims
                              if c.request_id not in refused}
            for c in claims:
                if c.request_id not in refused:
                    r = self.s.requests[c.request_id]
                    assert g2 in (r.de_group, r.pe.group if r.pe else None), "claim not kept"
        for rid, r in self.s.requests.items():
            assert r.failures == failures[rid], "a graceful hand-back counted as a failure"

    @invariant()
    def nothing_lost_nothing_duplicated(self):
        audit(self.s)

    @invariant()
    def kept_sums_and_bounds_are_exact(self):
        """What the core keeps so as not to walk every engine (a group's Σ tok_e, the
        largest up DE's HBM, the held-requests bound on the queue) equals the walk."""
        for g in self.s.groups.values():
            assert g.tok_sum == sum(e.tok for e in g.engines), g.group_id
        assert self.s._largest_hbm() == max(
            (e.hbm_tokens for e in self.s.engines.values()
             if e.role is Role.DECODE and e.group.up), default=0)
        assert self.s.queued_requests() <= len(self.s.requests)

    @invariant()
    def leaders_and_scheduler_agree(self):
        """What the scheduler has placed on a group's engines its leader holds, with the
        same attempt; what the leader holds beyond that it will be told to drop on its
        next fetch: nothing is given or taken away silently."""
        for gid, g in self.s.groups.items():
            if not g.up:
                continue
            if g.role is Role.PREFILL:
                placed = {r.request_id: (r.pe.engine_id, r.attempt)
                          for r in self.s.requests.values()
                          if r.stage is Stage.PREFILLING and r.pe.group is g}
            else:
                placed = {r.request_id: (r.de.engine_id, r.attempt)
                          for r in self.s.requests.values()
                          if r.de is not None and r.de.group is g}
            held = self.held[gid]
            assert not set(placed) & set(g.pending_cancel)
            assert all(held.get(rid) == v for rid, v in placed.items()), "placed unknown"
            assert set(held) - set(placed) <= set(g.pending_cancel), "taken silently"


SchedulerMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40,
                                              deadline=None)
TestSchedulerInvariants = SchedulerMachine.TestCase
