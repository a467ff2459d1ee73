"""The simulated cluster: leaders fetching from the real scheduler core on the simulated
clock, agents submitting their rounds, and each request's way through the PE and DE
models of :mod:`dualpath.sim.nodes` (pure; one thread).

Leaders fetch on a timer, as the daemons' do (node/leader.py sleeps
``fetch_interval`` after each fetch; completions ride on the fetch). One exception,
for speed, that changes no decision: a leader whose fetch would change nothing that any
decision reads (no completion to report, no work its role's policy could place, and a
load the other groups' decisions see already; ``SimCluster._noop``) sleeps: its ticks
are skipped until something it depends on changes, and it then ticks where it would
have ticked had it never slept (``SimCluster._wake``).

The core's CPU time is measured where the daemon spends it: ``time.process_time``
around a leader call (``report`` with the completions, then ``fetch``) and around a
submit, so ``scheduler_cpu`` is the real core's cost per decision at this scale. One
leader call and one single-request submit in :data:`CPU_STRIDE` are timed, and every
larger submit (reading the process's CPU clock is a system call: 2-20 us on this host,
as much as a fetch); totals are the sampled mean times the calls made. The fetches a
daemon's leader makes while the simulator skips its ticks are counted (one a tick
interval) and costed at the mean of the timed fetches that got and reported nothing
(``skipped_fetches``, ``cpu_s_skipped``, both in ``cores``).
"""

from __future__ import annotations

import heapq
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from dualpath.engines.emulated.batching import PrefillWork, fit_attention
from dualpath.errors import UsageError
from dualpath.kv import cost
from dualpath.kv.profiles import get_profile
from dualpath.paths.assignment import split_blocks
from dualpath.paths.payload import MODE_READ_POLICY, MODES
from dualpath.roles import ReadSide
from dualpath.scheduler.config import SchedulerConfig
from dualpath.scheduler.core import (
    Completion,
    CompletionStage,
    EngineSpec,
    RequestSpec,
    Role,
    Scheduler,
)
from dualpath.scheduler.service import params_from_config
from dualpath.sim.events import EventLoop
from dualpath.sim.hardware import Shape, SimHardware
from dualpath.sim.nodes import DecodeNode, PrefillNode, SimRequest, finish_step, plan_step
from dualpath.sim.resources import Link
from dualpath.trace.arrivals import arrival_times
from dualpath.trace.model import Trace
from dualpath.trace.report import RequestRecord

_FIT_CACHE: dict = {}
_SAMPLE = 100_000          # fetch CPU times and latencies kept for percentiles
_WAKE_STEPS = 4             # a woken leader's skipped ticks drawn one by one, at most
CPU_STRIDE = 8             # one leader call (and one submit) in this many is timed


class _Stats:
    """What a run without its records keeps: sums, and uniform samples (reservoirs) of
    TTFT and TPOT for percentiles."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.n = 0
        self.prompt = self.gen = self.hit = 0
        self.first_submit = math.inf
        self.last_finish = 0.0
        self.ttft: list[float] = []
        self.tpot: list[float] = []

    def add(self, r: RequestRecord) -> None:
        self.n += 1
        self.prompt += r.prompt_tokens
        self.gen += r.gen_tokens
        self.hit += r.hit_tokens
        self.first_submit = min(self.first_submit, r.submit_s)
        self.last_finish = max(self.last_finish, r.finish_s)
        self._keep(self.ttft, r.ttft_s)
        if r.tpot_s is not None:
            self._keep(self.tpot, r.tpot_s)

    def _keep(self, xs: list[float], v: float) -> None:
        if len(xs) < _SAMPLE:
            xs.append(v)
        else:
            j = self.rng.randrange(self.n)
            if j < _SAMPLE:
                xs[j] = v

    def summary(self) -> dict:
        def q(xs, p):
            return sorted(xs)[int(p * (len(xs) - 1))] if xs else None
        return {"requests": self.n, "prompt_tokens": self.prompt, "gen_tokens": self.gen,
                "hit_tokens": self.hit, "ttft_p50_s": q(self.ttft, 0.5),
                "ttft_p99_s": q(self.ttft, 0.99), "tpot_p50_s": q(self.tpot, 0.5),
                "ttft_mean_s": sum(self.ttft) / len(self.ttft) if self.ttft else None}


def profiled_fit(profile):
    """The PE's estimator, fitted by profiling the emulated engine's attention time, as
    node/daemon.py does at start-up (cached per profile)."""
    fit = _FIT_CACHE.get(profile)
    if fit is None:
        fit = _FIT_CACHE[profile] = fit_attention(
            profile, lambda b: cost.forward_time(profile, b).attention_s)
    return fit


@dataclass
class _Leader:
    group_id: str
    role: Role
    engines: list
    node: object
    lease_id: int = 0
    pending: list = field(default_factory=list)     # completions for the next fetch
    last_tick: float = 0.0
    dormant: bool = False
    slept_at: float = 0.0                           # when its ticks began to be skipped
    full: bool = False                              # PE: every engine past beta (_noop)
    reports: list = field(default_factory=list)
    core_group: object = None


class _Status:
    """One engine's status in a fetch: EngineReport's fields, reused tick after tick."""

    __slots__ = ("engine_id", "free_hbm_tokens", "read_q", "seq", "tok")

    def __init__(self, engine_id: str):
        self.engine_id = engine_id
        self.seq = self.tok = self.read_q = self.free_hbm_tokens = 0


@dataclass
class SimResult:
    """One mode's simulated run."""

    mode: str
    records: list[RequestRecord]
    snic_read_bytes: dict[str, float]
    snic_windows: list[dict[str, int]]
    window_s: float
    sim_s: float
    wall_s: float
    events: int
    scheduler_cpu: dict
    attention_steps: list
    extra: dict


class SimCluster:
    """A P x D cluster of ``hw`` replaying ``trace`` in ``mode`` (basic, dualpath,
    oracle); :meth:`run` returns a :class:`SimResult`."""

    def __init__(self, shape: Shape, hw: SimHardware, trace: Trace, mode: str, *,
                 online_aps: float | None = None, seed: int = 0, window_s: float = 1.0,
                 split_read: bool = False, alpha_tokens: int = 0, beta_tokens: int = 0,
                 keep_records: bool = True):
        if mode not in MODES:
            raise UsageError(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
        if not window_s > 0:
            raise UsageError(f"window_s must be > 0, got {window_s}")
        self.shape, self.hw, self.trace, self.mode = shape, hw, trace, mode
        self.profile = p = hw.profile
        self.kvt = p.kv_bytes_per_token
        self.T, self.L = p.block_tokens, p.layers
        self.loop = EventLoop()
        self.rng = random.Random(seed)
        self.client_s = hw.client_s
        self.window_s = window_s
        self.estimate = profiled_fit(p)
        self.quota_s = hw.compute_quota_ms / 1000.0
        # The scheduler's constants from the daemon's config (params_from_config: its
        # defaults, the unscaled profile, the node's storage rate), less what a
        # simulated run has no use for: leases (nothing fails) and bounds on what
        # waits (a trace submits every first round at t = 0).
        base = get_profile(hw.model)
        rate = hw.snic_rate
        cfg = SchedulerConfig(model_profile=hw.model, storage_read_bytes_per_s=rate,
                              alpha_window_s=hw.alpha_window_s,
                              beta_window_s=hw.beta_window_s, alpha_tokens=alpha_tokens,
                              beta_tokens=beta_tokens, compute_quota_ms=hw.compute_quota_ms,
                              split_read=split_read)
        self.params = replace(params_from_config(cfg, base), lease_s=1e12,
                              context_tokens=p.context_tokens, max_held_bytes=1 << 62,
                              max_queued_requests=1 << 40, max_submit_requests=1 << 30)
        self.core = Scheduler(self.params, rng=random.Random(seed))
        # Per-fetch CPU: sum and count, and a uniform sample for percentiles (a run at
        # scale makes tens of millions of fetches).
        self.cpu_fetch_s = 0.0
        self.cpu_fetches = 0
        self.cpu_sample: list[float] = []
        self.cpu_fetch_assigned = 0
        self.cpu_submit = 0.0
        self.submit_calls = 0
        self.cpu_empty_s = 0.0          # timed fetches that got and reported nothing
        self.cpu_empties = 0
        self.skipped_fetches = 0        # fetches a daemon's leader makes while ticks skip
        self.host_cpu = Link("host-cpu", hw.host_cores) if hw.host_cores > 0 else None
        g = hw.engines_per_node
        node_cnic = hw.cnic_bytes_per_s * g
        full_block = p.full_block_bytes
        self.pe_nodes = [PrefillNode(
            f"p{i}", g, hw.max_prefills_per_engine, snic=hw.snic_bytes_per_s,
            cnic_node=node_cnic, cnic_gpu=hw.cnic_bytes_per_s,
            buffer_blocks=max(1, hw.pe_buffer_bytes // full_block),
            hbm_units=max(1, hw.prefill_hbm_bytes // p.layer_block_bytes), window_s=window_s)
            for i in range(shape.prefill_nodes)]
        self.de_nodes = [DecodeNode(
            f"d{i}", g, p, snic=hw.snic_bytes_per_s, cnic_node=node_cnic,
            buffer_blocks=max(1, hw.de_buffer_bytes // full_block),
            hbm_blocks=max(1, hw.decode_hbm_bytes // full_block), window_s=window_s)
            for i in range(shape.decode_nodes)]
        self.engines: dict[str, object] = {}
        self.leaders: list[_Leader] = []
        self.dormant: dict[Role, list[_Leader]] = {Role.PREFILL: [], Role.DECODE: []}
        read_rate = rate / base.kv_bytes_per_token
        for role, nodes in ((Role.PREFILL, self.pe_nodes), (Role.DECODE, self.de_nodes)):
            for n in nodes:
                ld = _Leader(f"{n.node_id}-group", role, n.engines, n,
                             reports=[_Status(e.engine_id) for e in n.engines])
                n.leader = ld
                specs = []
                for k, e in enumerate(n.engines):
                    self.engines[e.engine_id] = e
                    specs.append(EngineSpec(e.engine_id, k, n.node_id, f"sim:{e.engine_id}",
                                            e.free_hbm_tokens if role is Role.DECODE else 0))
                grp = self.core.register_group(ld.group_id, role, specs, 0.0,
                                               read_tokens_per_s=read_rate)
                ld.lease_id = grp.lease_id
                ld.core_group = grp
                self.leaders.append(ld)
        # Agents: their rounds in order, each submitted when the one before ended.
        # Each agent's rounds, planned as they come (plan_rounds' rule: the hit is the
        # context so far in whole blocks) so that 48K trajectories hold no plan lists.
        self.trajs = trace.trajectories
        self.context = [0] * len(self.trajs)
        n = len(self.trajs)
        if not n:
            raise UsageError("the trace has no trajectories")
        self.starts = (arrival_times(n, "online", aps=online_aps, seed=seed)
                       if online_aps else [0.0] * n)
        self.keep_records = keep_records
        self.records: list[RequestRecord] = []
        self.stats = _Stats(seed)
        self.requests: dict[str, SimRequest] = {}
        self.left = sum(len(t.rounds) for t in self.trajs)
        self.duplicates = 0
        self._write_seq = 0            # the write-back's order among equal ranks

    # ------------------------------------------------------------ agents

    def _submit(self, rounds: list[tuple[int, int]]) -> None:
        """Submit these (agent, round)s in one call, as the replay driver submits every
        round that is due at once."""
        now = self.loop.now
        specs = []
        T = self.T
        for agent, k in rounds:
            rd = self.trajs[agent].rounds[k]
            ctx = self.context[agent]
            prompt, hit = ctx + rd.append_tokens, ctx // T * T
            rid = f"a{agent}-r{k}"
            self.requests[rid] = SimRequest(rid, agent, k, self.mode, prompt, hit,
                                            rd.gen_tokens, now)
            specs.append(RequestSpec(prompt, hit, rd.gen_tokens, rid))
        self.submit_calls += 1
        weight = CPU_STRIDE if len(specs) == 1 else 1
        if weight == 1 or self.submit_calls % CPU_STRIDE == 0:
            t0 = time.process_time()
            adm = self.core.submit(specs, now)
            self.cpu_submit += (time.process_time() - t0) * weight
        else:
            adm = self.core.submit(specs, now)
        if adm.rejected:
            raise UsageError(f"simulated request {adm.rejected[0].request_id} rejected by "
                             f"the scheduler: {adm.rejected[0].detail}")
        self._bump(Role.DECODE)

    def _ended(self, r: SimRequest, due: list[tuple[int, int]]) -> None:
        """The scheduler recorded ``r``'s DECODE_DONE: its agent's next round is due."""
        if r.ended:
            self.duplicates += 1
            return
        r.ended = True
        self.left -= 1
        second = r.second_token_s if r.gen >= 2 else None
        rec = RequestRecord(r.agent, r.round, r.submit_s, r.first_token_s, second,
                            r.finish_s, r.prompt, r.hit, r.gen)
        self.stats.add(rec)
        if self.keep_records:
            self.records.append(rec)
        del self.requests[r.request_id]
        self.context[r.agent] = r.prompt + r.gen
        if r.round + 1 < len(self.trajs[r.agent].rounds):
            due.append((r.agent, r.round + 1))

    # ------------------------------------------------------------ leaders

    def _bump(self, *roles: Role) -> None:
        """The scheduler's queues changed for these roles' leaders: wake the sleeping ones
        whose fetch would now do something (:meth:`_noop`). The others would tick only to
        sleep again; what else could change their answer (their engines, a completion)
        wakes them through :meth:`_touch`."""
        now = self.loop.now
        for role in roles:
            sleeping = self.dormant[role]
            if sleeping:
                keep = []
                for ld in sleeping:
                    if self._noop(ld, now, asleep=True):
                        keep.append(ld)
                    else:
                        self._wake(ld)
                self.dormant[role] = keep

    def _noop(self, ld: _Leader, now: float, asleep: bool = False) -> bool:
        """Whether a fetch of ``ld``'s now would change nothing any decision reads, so
        that skipping it (and sleeping until something changes) is the same run.

        - PE: no completion to report, and the prefill queue is empty or every engine is
          past β (``pick_prefill_engine`` finds none). A PE's reported load is read only
          by its own group's fetches, which report it again first.
        - DE: no completion, an empty global queue (a fetch would run the group phase),
          a private queue whose head fits no engine's free HBM (``assign_in_group``
          places nothing), the same Σ tok_e as the core holds (the group phase of
          *other* groups' fetches reads it), and a read queue the core already has, or
          that nothing reads: no request in the prefill queue has its DE on this node
          (a PE fetch's read side reads that node's read_q).

        ``asleep``: ``ld`` went to sleep on this test and its engines have not changed
        since (a change wakes it), so only the queues need looking at again."""
        if ld.pending:
            return False
        core = self.core
        if ld.role is Role.PREFILL:
            if not asleep:
                beta = core.params.beta_tokens
                ld.full = all(e.tok > beta for e in ld.engines)
            return ld.full or not core.prefill_queue
        if core.global_queue:
            return False
        g = ld.core_group
        q = g.private_queue
        if q:
            need = q[0].hbm_tokens
            for e in ld.engines:
                if e.free_hbm_tokens >= need:
                    return False
        if asleep:
            return True
        if sum(e.tok for e in ld.engines) != g.tok_sum:
            return False
        node = ld.node
        return not node.in_prefill_queue or (
            node.read.busy_until <= now
            and node.read_q(now, self.kvt) == g.engines[0].node.read_q)

    def _touch(self, ld: _Leader) -> None:
        """``ld``'s node changed (its engines, its read queue, a completion): a sleeping
        leader's fetch may now do something."""
        if ld.dormant:
            self.dormant[ld.role].remove(ld)
            self._wake(ld)

    def _wake(self, ld: _Leader) -> None:
        """A sleeping leader's next tick: where a leader that never slept would tick
        next. Its ticks are a period and a fetch's round trip apart (``_tick``), so the
        ones it skipped are drawn a few at a time; after more than a few its phase is
        random, and the next tick is the rest of a tick interval drawn, as an interval
        a random moment falls in is, in proportion to its length. (A uniform point of
        one period, without the round trips, woke sleepers sooner than fetching leaders
        and handed them more of each burst.)"""
        ld.dormant = False
        self.skipped_fetches += self._skipped(ld)
        iv, rtt = self.hw.fetch_interval_s, 2.0 * self.hw.rpc_s
        now, rng = self.loop.now, self.rng
        t = ld.last_tick
        for _ in range(_WAKE_STEPS):
            t += iv + (rng.uniform(0.0, rtt) if rtt else 0.0)
            if t > now:
                break
        else:
            x = math.sqrt(iv * iv + rng.random() * ((iv + rtt) ** 2 - iv * iv))
            t = now + rng.uniform(0.0, x)
        self.loop.at(t, self._tick, ld)

    def _skipped(self, ld: _Leader) -> int:
        """The fetches a daemon's leader would have made in ``ld``'s sleep: the tick it
        went to sleep on and one a tick interval (a period and a mean round trip) after
        it."""
        return 1 + int((self.loop.now - ld.slept_at)
                       / (self.hw.fetch_interval_s + self.hw.rpc_s))

    def _tick(self, ld: _Leader) -> None:
        now = self.loop.now
        ld.last_tick = now
        if self._noop(ld, now):
            ld.dormant, ld.slept_at = True, now
            self.dormant[ld.role].append(ld)
            return
        node = ld.node
        rq = node.read_q(now, self.kvt)
        # The engines' statuses, as the leader's EngineStatus carries them (updated in
        # place: the core reads the same five fields of an EngineReport).
        reports = ld.reports
        if ld.role is Role.PREFILL:
            for e, rep in zip(ld.engines, reports):
                rep.seq, rep.tok, rep.read_q = len(e.tokens), e.tok, rq
        else:
            for e, rep in zip(ld.engines, reports):
                rep.seq, rep.tok, rep.read_q = len(e.tokens), e.tok, rq
                rep.free_hbm_tokens = max(0, e.hbm_blocks - e.reserved) * e.T
        done, ld.pending = ld.pending, []
        self.cpu_fetches += 1
        timed = self.cpu_fetches % CPU_STRIDE == 0
        drains = ld.role is Role.DECODE and bool(self.core.global_queue)
        if timed:
            t0 = time.process_time()
        if done:
            self.core.report(ld.group_id, ld.lease_id, [c for c, _ in done], now)
        res = self.core.fetch(ld.group_id, ld.lease_id, reports, now)
        if timed:
            dt = time.process_time() - t0
            self.cpu_fetch_s += dt * CPU_STRIDE
            if not res.assignments and not done:
                self.cpu_empty_s += dt
                self.cpu_empties += 1
            k = self.cpu_fetches // CPU_STRIDE
            if len(self.cpu_sample) < _SAMPLE:
                self.cpu_sample.append(dt)
            else:
                j = self.rng.randrange(k)
                if j < _SAMPLE:
                    self.cpu_sample[j] = dt
        self.cpu_fetch_assigned += len(res.assignments)
        if res.cancelled:
            raise UsageError(f"the scheduler cancelled {res.cancelled[:3]} in a simulated "
                             "run without failures")
        due: list[tuple[int, int]] = []
        for c, r in done:
            if c.stage is CompletionStage.DECODE_DONE:
                self._ended(r, due)
        if due:
            self.loop.after(self.client_s, self._submit, due)
        if drains or (res.assignments and ld.role is Role.DECODE):
            # The group phase filled DE groups' private queues; the in-group phase the
            # prefill queue.
            self._bump(Role.PREFILL, Role.DECODE)
        # The fetch's round trip: assignments arrive, and the leader's sleep starts,
        # after it (uniform in [0, 2 rpc_s]: the call's time varies, which is what
        # keeps the groups' fetch order from being the same every period).
        rtt = self.rng.uniform(0.0, 2.0 * self.hw.rpc_s) if self.hw.rpc_s else 0.0
        at = now + rtt
        for a in res.assignments:
            r = self.requests[a.request_id]
            de = self.engines[a.de.engine_id]
            if ld.role is Role.DECODE:
                de.node.in_prefill_queue += 1
                self.loop.at(at, self._placed, r, de)
            else:
                de.node.in_prefill_queue -= 1
                self.loop.at(at, self._assigned, r, self.engines[a.pe.engine_id], de,
                             a.read_side,
                             a.prefill_read_tokens, a.decode_read_tokens)
        self.loop.at(at + self.hw.fetch_interval_s, self._tick, ld)

    # ------------------------------------------------------------ DE placement

    def _placed(self, r: SimRequest, de) -> None:
        de.reserved += de.blocks_of(r)
        de.tokens[r.request_id] = r.prompt
        de.tok += r.prompt
        r.de = de
        self._touch(de.node.leader)

    # ------------------------------------------------------------ PE path

    def _assigned(self, r: SimRequest, pe, de, read_side: ReadSide, prt: int,
                  drt: int) -> None:
        r.pe, r.de = pe, de           # (the DE leader's placement may arrive later)
        pe.tokens[r.request_id] = r.prompt
        pe.tok += r.prompt
        T = self.T
        hit_blocks = 0 if self.mode == "oracle" else min(r.hit // T, (r.prompt - 1) // T)
        local, remote = split_blocks(MODE_READ_POLICY[self.mode], read_side, hit_blocks,
                                     prt, drt, T)
        r.local_tokens, r.remote_tokens = local * T, remote * T
        r.computed_from = r.hit if self.mode == "oracle" else hit_blocks * T
        r.expected_pe = r.local_tokens
        pe.node.expected += r.local_tokens
        self._touch(pe.node.leader)
        if len(pe.tokens) - len(pe.waiting) <= pe.slots:
            self._slot(r)
        else:
            pe.waiting.append(r)

    def _slot(self, r: SimRequest) -> None:
        """A prefill slot: PrepareRequest to the DE (one node-to-node hop), then the
        DE's and the PE's buffers."""
        if self.hw.hop_s:
            self.loop.after(self.hw.hop_s, self._prepared, r)
        else:
            self._prepared(r)

    def _prepared(self, r: SimRequest) -> None:
        de_node = r.de.node
        r.expected_de = r.remote_tokens
        de_node.expected += r.remote_tokens
        self._touch(de_node.leader)
        if not r.moves_kv:
            r.staged_s = self.loop.now
            self._forward(r)
            return
        nb = -(-r.prompt // self.T)
        r.buffer_blocks = nb
        pe_node = r.pe.node
        # PrepareRequest: the DE's buffer slots for the prompt, then the PE's.
        de_node.buffer.acquire(nb, lambda: pe_node.buffer.acquire(nb, lambda: self._read(r)))

    def _read(self, r: SimRequest) -> None:
        now = self.loop.now
        pe_node, de_node = r.pe.node, r.de.node
        kvt = self.kvt
        end = now
        if r.local_tokens:
            pe_node.expected -= r.expected_pe
            r.expected_pe = 0
            end = max(end, pe_node.read.reserve(now, r.local_tokens * kvt))
        if r.remote_tokens:
            de_node.expected -= r.expected_de
            r.expected_de = 0
            # The PE's LoadOrder reaches the DE one hop later.
            got = de_node.read.reserve(now + self.hw.hop_s, r.remote_tokens * kvt)
        if self.host_cpu is not None:
            moved = (r.local_tokens + 2 * r.remote_tokens + r.prompt) * kvt
            end = max(end, self.host_cpu.reserve(
                now, self.hw.cpu_s_per_request + self.hw.cpu_s_per_byte * moved))
        if r.remote_tokens:
            # The DE node's read queue moved without its engines changing: its leader
            # reports it (see _noop).
            self._touch(de_node.leader)
            r.local_end_s = end
            self.loop.at(got, self._sent_over, r)
        else:
            self.loop.at(end, self._staged, r)

    def _sent_over(self, r: SimRequest) -> None:
        """The DE's part has been read: it crosses the compute network to the PE, booked
        on the links now, when it is ready (booked when the read was queued, a part
        from an idle DE would wait behind one still queued on a busy DE's storage NIC)."""
        now, xfer = self.loop.now, r.remote_tokens * self.kvt
        end = max(r.local_end_s, r.de.node.cnic_out.reserve(now, xfer),
                  r.pe.node.cnic_in.reserve(now, xfer))
        self.loop.at(end, self._staged, r)

    def _staged(self, r: SimRequest) -> None:
        r.staged_s = self.loop.now
        self._touch(r.pe.node.leader)
        self._touch(r.de.node.leader)
        self._forward(r)

    def _forward(self, r: SimRequest) -> None:
        e = r.pe
        e.queue.append(PrefillWork(r.request_id, r.computed_from, r.prompt - r.computed_from))
        e.work_of[r.request_id] = r
        if not e.node.stepping:
            self._step(e.node)

    def _step(self, node: PrefillNode) -> None:
        plan = plan_step(node, self.profile, self.estimate, self.quota_s)
        if plan is None:
            node.stepping = False
            return
        node.stepping = True
        now = self.loop.now
        end = now + plan.duration_s
        node.steps.append((plan.duration_s, plan.attention_s))
        sent: dict[str, float] = {}
        kvt = self.kvt
        for e, b in plan.batches.items():
            for s in b:
                r = e.work_of[s.request_id]
                if not r.moves_kv:
                    continue
                # This slice's KV (and, with the first chunk, the hit the DE lacks) to
                # the DE, layer by layer during the step.
                nbytes = s.tokens * kvt
                if s.cached_tokens == r.computed_from:
                    nbytes += max(0, r.computed_from - r.remote_tokens) * kvt
                sent[s.request_id] = max(node.cnic_out.reserve(now, nbytes),
                                         r.de.node.cnic_in.reserve(now, nbytes))
        self.loop.at(end, self._stepped, node, plan, sent)

    def _stepped(self, node: PrefillNode, plan, sent: dict[str, float]) -> None:
        now = self.loop.now
        for r in finish_step(plan):
            self.loop.at(max(now, sent.get(r.request_id, now)), self._prefilled, r)
        self._step(node)

    def _prefilled(self, r: SimRequest) -> None:
        """PREFILL_DONE: the PE frees its slot and buffer, the DE starts decoding."""
        now = self.loop.now
        e = r.pe
        del e.tokens[r.request_id]
        e.tok -= r.prompt
        if r.buffer_blocks:
            e.node.buffer.release(r.buffer_blocks)
            # The prompt's KV is in the DE's buffer and moves on into its HBM.
            r.de.node.buffer.release(r.buffer_blocks)
        if e.waiting:
            self._slot(e.waiting.popleft())
        r.prefill_done_s = r.first_token_s = now
        ld = e.node.leader
        ld.pending.append((Completion(r.request_id, e.engine_id,
                                      CompletionStage.PREFILL_DONE), r))
        self._touch(ld)
        if r.gen <= 1:
            r.second_token_s = None
            self._decoded(r)
            return
        if self.hw.hop_s:       # PrefillDone reaches the DE one hop later
            self.loop.after(self.hw.hop_s, self._join, r)
        else:
            self._join(r)

    def _join(self, r: SimRequest) -> None:
        de = r.de
        r.second_token_s = de.join(r, self.loop.now)
        self._schedule_decode(de)

    def _schedule_decode(self, de) -> None:
        de.gen += 1
        t = de.next_finish(self.loop.now)
        if t is not None:
            self.loop.at(t, self._decode_due, de, de.gen)

    def _decode_due(self, de, gen: int) -> None:
        if gen != de.gen:
            return
        for r in de.due(self.loop.now):
            self._decoded(r)
        self._schedule_decode(de)

    def _decoded(self, r: SimRequest) -> None:
        """The last token (timed now: the writes are outside the request's latency):
        the DE frees its HBM, and its new full blocks go to the node's write-back
        (paths/writeback.py: the storage NIC's write direction, never delaying a read,
        the request with the fewest blocks first). DECODE_DONE, on the leader's next
        fetch, waits for them, as the emulated DE's does: the agent's next round reads
        them from storage."""
        now = self.loop.now
        r.finish_s = max(now, r.second_token_s or now)
        de = r.de
        de.reserved -= de.blocks_of(r)
        del de.tokens[r.request_id]
        de.tok -= r.prompt
        self._touch(de.node.leader)          # its HBM and tok_e changed
        blocks = ((r.prompt + r.gen) // self.T - min(r.computed_from, r.hit) // self.T
                  if r.moves_kv else 0)
        if blocks <= 0:
            self._decode_done(r)
            return
        node = de.node
        heapq.heappush(node.writes, (blocks, self._write_seq, r))
        self._write_seq += 1
        if not node.writing:
            self._write_next(node)

    def _write_next(self, node: DecodeNode) -> None:
        if not node.writes:
            node.writing = False
            return
        node.writing = True
        blocks, _, r = heapq.heappop(node.writes)
        end = node.write.reserve(self.loop.now, blocks * self.profile.full_block_bytes)
        self.loop.at(end, self._written, node, r)

    def _written(self, node: DecodeNode, r: SimRequest) -> None:
        self._decode_done(r)
        self._write_next(node)

    def _decode_done(self, r: SimRequest) -> None:
        ld = r.de.node.leader
        ld.pending.append((Completion(r.request_id, r.de.engine_id,
                                      CompletionStage.DECODE_DONE), r))
        self._touch(ld)

    # ------------------------------------------------------------ the run

    def run(self, max_sim_s: float = float("inf"), partial: bool = False) -> SimResult:
        """Run to the last request's end; with ``partial``, stop at ``max_sim_s`` of
        simulated time whatever is left (``extra['complete']`` says which; ``sim_s`` is
        then the time simulated, not a JCT)."""
        for ld in self.leaders:
            ld.last_tick = self.rng.uniform(0, self.hw.fetch_interval_s)
            self.loop.at(ld.last_tick, self._tick, ld)
        at: dict[float, list[tuple[int, int]]] = {}
        for a, t in enumerate(self.starts):
            at.setdefault(t, []).append((a, 0))
        for t, rounds in at.items():
            self.loop.at(t, self._submit, rounds)
        w0, c0 = time.perf_counter(), time.process_time()
        self.loop.run(until=max_sim_s)
        wall = time.perf_counter() - w0
        self.run_cpu_s = time.process_time() - c0
        if self.left and not partial:
            raise UsageError(f"simulated run ({self.mode}, {self.shape}) stopped with "
                             f"{self.left} requests unfinished at t = {self.loop.now:.1f} s")
        return self._result(wall)

    def _result(self, wall: float) -> SimResult:
        if self.left:
            sim_s = self.loop.now
        else:
            sim_s = self.stats.last_finish - self.stats.first_submit
        nodes = [*self.pe_nodes, *self.de_nodes]
        read = {n.node_id: n.read.total for n in nodes}
        last = max((max(n.read.windows, default=0) for n in nodes), default=0)
        windows = [{n.node_id: int(n.read.windows.get(i, 0)) for n in nodes}
                   for i in range(last + 1)]
        cpu = sorted(self.cpu_sample)
        n = self.cpu_fetches
        skipped = self.skipped_fetches + sum(self._skipped(ld) for ld in self.leaders
                                             if ld.dormant)
        empty_s = self.cpu_empty_s / self.cpu_empties if self.cpu_empties else 0.0
        total = self.cpu_fetch_s + self.cpu_submit + skipped * empty_s
        steps = [s for n in self.pe_nodes for s in n.steps]
        return SimResult(
            self.mode, self.records, read, windows, self.window_s, sim_s, wall,
            self.loop.events,
            {"fetches": n, "assignments": self.cpu_fetch_assigned,
             "cpu_s_total": total, "cpu_s_submit": self.cpu_submit,
             "submit_calls": self.submit_calls, "skipped_fetches": skipped,
             "cpu_s_skipped": skipped * empty_s,
             "empty_fetch_us_mean": 1e6 * empty_s,
             "empty_fetches_timed": self.cpu_empties,     # 0: the skipped ones cost 0
             "fetch_us_mean": 1e6 * self.cpu_fetch_s / n if n else None,
             "timed_one_call_in": CPU_STRIDE,
             "fetch_us_p99": 1e6 * cpu[int(0.99 * (len(cpu) - 1))] if cpu else None,
             "us_per_request": 1e6 * total / max(1, self.stats.n),
             "cores": total / sim_s if sim_s > 0 else None},
            steps,
            {"decode_batch_largest": max(e.largest for n in self.de_nodes
                                         for e in n.engines),
             "pe_buffer_low_blocks": min(n.buffer.low for n in self.pe_nodes),
             "duplicate_completions": self.duplicates, "complete": not self.left,
             "requests_left": self.left, "stats": self.stats.summary(),
             # The simulator's own CPU time: on a shared host, wall time also counts
             # the time other processes held the cores.
             "run_cpu_s": self.run_cpu_s})


def run_modes(shape: Shape, hw: SimHardware, trace: Trace, modes: Sequence[str],
              **kw) -> list[SimResult]:
    return [SimCluster(shape, hw, trace, m, **kw).run() for m in modes]
