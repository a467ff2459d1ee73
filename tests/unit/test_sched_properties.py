"""Property tests (hypothesis, stateful) of the scheduler core's invariants:

* nothing is assigned to an overloaded (tok_e > β) or drained engine;
* the PE order is FIFO (a PE fetch hands out a prefix of the prefill queue), and the PE
  picked is the one §6.1 names given the loads at that moment;
* HBM is never over-committed (a DE receives at most its reported free HBM);
* every request is in exactly one place (a queue or an engine) until DECODE_DONE — none
  lost, none duplicated — across fetches, completions, failures, drains, lease expiry and
  re-registration.
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
    Completion,
    CompletionStage,
    EngineReport,
    EngineSpec,
    LeaseError,
    Params,
    RequestSpec,
    Role,
    Scheduler,
    Stage,
)

ALPHA, BETA, HBM = 500, 1000, 2000
LEASE_S = 10.0
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
    stages = Counter(r.stage for r in s.requests.values())
    counts = s.stage_counts()
    assert all(counts[st] == stages[st] for st in counts), (counts, stages)
    assert set(where) == set(s.requests), "a request is lost or unknown"
    assert all(n == 1 for n in where.values()), f"duplicated: {where.most_common(3)}"
    assert s.counters.submitted == s.counters.completed + len(s.requests)


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.s = Scheduler(Params(alpha_tokens=ALPHA, beta_tokens=BETA, lease_s=LEASE_S,
                                  max_assignments_per_fetch=7, split_align_tokens=8,
                                  default_read_tokens_per_s=100.0))
        self.now = 0.0
        self.leases: dict[str, int] = {}
        self.roles: dict[str, Role] = {}
        # What each leader believes its engines hold: assigned, minus completed, failed
        # and cancelled. The scheduler must agree (see the invariant below).
        self.held: dict[str, set[str]] = {}

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
        self.held[gid] = set()

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
        assert set(res.cancelled) <= self.held[gid], "cancelled what the group never had"
        self.held[gid] -= set(res.cancelled)
        self.held[gid] |= {r.request_id for r in res.assignments}

    # ---------------------------------------------------------------- completions

    def _held(self, stage):
        return sorted((r for r in self.s.requests.values() if r.stage is stage),
                      key=lambda r: r.seq)

    @precondition(lambda self: self._held(Stage.PREFILLING))
    @rule(data=st.data(), fail=st.booleans())
    def prefill_done(self, data, fail):
        r = data.draw(st.sampled_from(self._held(Stage.PREFILLING)))
        gid = r.pe.group.group_id
        stage = CompletionStage.FAILED if fail else CompletionStage.PREFILL_DONE
        acc, ign = self.s.report(gid, self.leases[gid], [Completion(r.request_id,
                                                                    r.pe.engine_id, stage)],
                                 self.now)
        assert (acc, ign) == (1, [])
        self.held[gid].discard(r.request_id)
        assert r.stage is (Stage.PREFILL_QUEUE if fail else Stage.DECODING)
        if fail:
            assert self.s.prefill_queue[0] is r, "a failed prefill is requeued at the head"

    @precondition(lambda self: self._held(Stage.DECODING))
    @rule(data=st.data(), fail=st.booleans())
    def decode_done(self, data, fail):
        r = data.draw(st.sampled_from(self._held(Stage.DECODING)))
        gid = r.de.group.group_id
        stage = CompletionStage.FAILED if fail else CompletionStage.DECODE_DONE
        comp = Completion(r.request_id, r.de.engine_id, stage)
        assert self.s.report(gid, self.leases[gid], [comp], self.now)[0] == 1
        self.held[gid].discard(r.request_id)
        if fail:
            assert self.s.global_queue[0] is r
        else:
            assert r.request_id not in self.s.requests
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
        held_de = sorted((r for r in self.s.requests.values() if r.de_group in late),
                         key=lambda r: r.seq)
        held_pe = sorted((r for r in self.s.requests.values() if r.stage is Stage.PREFILLING
                          and r.pe.group in late and r not in held_de), key=lambda r: r.seq)
        waiting_global = list(self.s.global_queue)
        waiting_prefill = [r for r in self.s.prefill_queue if r not in held_de]
        down = self.s.expire(self.now)
        assert set(down) == late
        assert list(self.s.global_queue) == held_de + waiting_global
        assert list(self.s.prefill_queue) == held_pe + waiting_prefill
        for g in down:
            self.held[g.group_id] = set()  # a leader without a lease drops everything
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
        pe_group = r.pe.group
        assert self.s.report(gid, self.leases[gid], [comp], self.now) == (1, [])
        self.held[gid].discard(r.request_id)
        assert self.s.global_queue[0] is r
        assert pe_group.pending_cancel[-1] == r.request_id

    @invariant()
    def nothing_lost_nothing_duplicated(self):
        audit(self.s)

    @invariant()
    def leaders_and_scheduler_agree(self):
        """What a leader holds is what the scheduler has placed on its engines, plus (PE)
        what it will be told to drop on its next fetch: nothing is taken away silently."""
        for gid, g in self.s.groups.items():
            if not g.up:
                continue
            if g.role is Role.PREFILL:
                placed = {r.request_id for r in self.s.requests.values()
                          if r.stage is Stage.PREFILLING and r.pe.group is g}
                assert not placed & set(g.pending_cancel)
                assert self.held[gid] == placed | set(g.pending_cancel)
            else:
                placed = {r.request_id for r in self.s.requests.values()
                          if r.de is not None and r.de.group is g}
                assert self.held[gid] == placed


SchedulerMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40,
                                              deadline=None)
TestSchedulerInvariants = SchedulerMachine.TestCase
