"""A synthetic cluster of engine groups that behaves like the PE/DE leaders toward the
scheduler: reports seq_e / tok_e / read_q / free HBM, absorbs assignments, makes progress
in simulated time and reports completions. Used by bench/scheduler.py (core alone and
through gRPC) and by tests.

Engines are fluid models, not the daemons: a PE drains prompt tokens at the profile's
rate for a typical agentic turn (the rate behind β), a node drains its read queue at the
storage rate, a DE finishes a request ``max_new_tokens × decode_s_per_token`` after it was
placed there. ``speedup`` multiplies every rate, so that a fetch carries more work and the
scheduler, not the simulated cluster, is what a benchmark measures.

Pure and single-threaded; the caller owns the clock (``step(dt)``). A load generator
split over processes gives each process a full replica and marks the engines it does not
run ``local = False``: a PE's PREFILL_DONE for such a DE goes to :attr:`SimCluster.outbox`
as ``(request_id, de_engine_id)``, and the owner applies it with :meth:`prefill_done` (as
a real PE tells its DE through the Engine service).
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field
from heapq import heapify, heappop, heappush

from dualpath.kv import cost
from dualpath.kv.profiles import ModelProfile
from dualpath.scheduler.core.model import (
    Completion,
    CompletionStage,
    EngineReport,
    EngineSpec,
    RequestSpec,
    Role,
)


@dataclass(slots=True)
class SimAssignment:
    """The part of an assignment a simulated engine needs (from the core or protobuf)."""

    request_id: str
    engine_id: str
    prompt_tokens: int
    hbm_tokens: int
    prefill_read_tokens: int = 0
    decode_read_tokens: int = 0
    decode_engine_id: str = ""


@dataclass(slots=True)
class SimEngine:
    engine_id: str
    role: Role
    node: SimNode
    hbm_tokens: int = 0
    # PE: FIFO of [request_id, remaining prompt tokens, prompt tokens].
    # DE: request_id -> (hbm tokens, prompt tokens); decoding ones also in ``timers``.
    held: deque = field(default_factory=deque)
    placed: dict = field(default_factory=dict)
    timers: list = field(default_factory=list)  # heap of (finish time, request_id)
    tok: float = 0
    free_hbm_tokens: int = 0
    local: bool = True  # False: another process runs it (see the module docstring)

    @property
    def seq(self) -> int:
        return len(self.held) if self.role is Role.PREFILL else len(self.placed)


@dataclass(slots=True)
class SimNode:
    node_id: str
    read_tokens_per_s: float
    read_q: float = 0.0


@dataclass
class SimGroup:
    group_id: str
    role: Role
    engines: list[SimEngine]
    lease_id: int = 0

    def specs(self) -> list[EngineSpec]:
        return [EngineSpec(e.engine_id, i, e.node.node_id, f"sim:{e.engine_id}", e.hbm_tokens)
                for i, e in enumerate(self.engines)]

    def reports(self) -> list[EngineReport]:
        return [EngineReport(e.engine_id, e.seq, int(e.tok), int(e.node.read_q),
                             e.free_hbm_tokens) for e in self.engines]


class SimCluster:
    """``pe_nodes`` PE groups and ``de_nodes`` DE groups of ``engines_per_node`` engines
    (one group per node, as in the paper's deployment)."""

    def __init__(self, profile: ModelProfile, pe_nodes: int, de_nodes: int,
                 engines_per_node: int = 8, read_bytes_per_s: float = 50e9,
                 speedup: float = 1.0, seed: int = 1):
        self.profile = profile
        self.now = 0.0
        self.rng = random.Random(seed)
        self.pe_tokens_per_s = speedup * cost.prompt_tokens_per_s(profile, 32721, 429)
        self.decode_s_per_token = profile.decode_s_per_token / speedup
        self.read_tokens_per_s = speedup * read_bytes_per_s / profile.kv_bytes_per_token
        hbm_tokens = profile.hbm_bytes // profile.kv_bytes_per_token
        self.groups: list[SimGroup] = []
        self.engines: dict[str, SimEngine] = {}
        # Named as node daemons name themselves (a node identity registers group
        # <node>, engines <node>/e<k> on node <node>: scheduler/core/scheduler.py).
        for role, count, tag in ((Role.PREFILL, pe_nodes, "pe"), (Role.DECODE, de_nodes, "de")):
            for n in range(count):
                node = SimNode(f"{tag}{n}", self.read_tokens_per_s)
                engines = []
                for k in range(engines_per_node):
                    e = SimEngine(f"{tag}{n}/e{k}", role, node,
                                  hbm_tokens if role is Role.DECODE else 0)
                    e.free_hbm_tokens = e.hbm_tokens
                    engines.append(e)
                    self.engines[e.engine_id] = e
                self.groups.append(SimGroup(f"{tag}{n}", role, engines))
        self._next = 0
        self._decoder: dict[str, SimEngine] = {}  # request -> its DE, while prefilling
        self._early: dict[str, float] = {}  # prefill done before its DE saw the placement
        self.outbox: list[tuple[str, str]] = []  # PREFILL_DONE for DEs run elsewhere

    def new_requests(self, n: int) -> list[RequestSpec]:
        """Agentic turns shaped like the paper's 64K trace (Table 2: context ~32.7K, append
        ~429, generation ~176 tokens per turn), with spread."""
        out = []
        rng = self.rng
        for _ in range(n):
            self._next += 1
            prompt = rng.randint(1024, 64 * 1024)
            append = min(prompt, rng.randint(100, 800))
            out.append(RequestSpec(prompt, prompt - append, rng.randint(64, 288),
                                   f"q{self._next}"))
        return out

    def absorb(self, group: SimGroup, assignments: list[SimAssignment]) -> None:
        """A leader received these assignments: its engines take them on."""
        for a in assignments:
            e = self.engines[a.engine_id]
            e.tok += a.prompt_tokens
            if group.role is Role.PREFILL:
                e.held.append([a.request_id, a.prompt_tokens, a.prompt_tokens])
                e.node.read_q += a.prefill_read_tokens
                de = self.engines[a.decode_engine_id]
                de.node.read_q += a.decode_read_tokens
                self._decoder[a.request_id] = de
            else:
                e.placed[a.request_id] = (a.hbm_tokens, a.prompt_tokens)
                e.free_hbm_tokens -= a.hbm_tokens
                done_at = self._early.pop(a.request_id, None)
                if done_at is not None:
                    self._start_decode(e, a.request_id, done_at)

    def prefill_done(self, request_id: str, engine_id: str) -> None:
        """The PE of ``request_id`` (run elsewhere) finished it at ``self.now``: its DE
        ``engine_id`` starts decoding."""
        self._start_decode(self.engines[engine_id], request_id, self.now)

    def _start_decode(self, de: SimEngine, rid: str, at: float) -> None:
        if rid in de.placed:
            hbm, prompt = de.placed[rid]
            heappush(de.timers, (at + (hbm - prompt) * self.decode_s_per_token, rid))
        else:
            self._early[rid] = at

    def absorb_requests(self, group: SimGroup, requests: list) -> None:
        """Like :meth:`absorb`, from the core's Request records (the fetch's result)."""
        if group.role is Role.PREFILL:
            self.absorb(group, [SimAssignment(r.request_id, r.pe.engine_id, r.prompt_tokens,
                                              r.hbm_tokens, r.prefill_read_tokens,
                                              r.decode_read_tokens, r.de.engine_id)
                                for r in requests])
        else:
            self.absorb(group, [SimAssignment(r.request_id, r.de.engine_id, r.prompt_tokens,
                                              r.hbm_tokens) for r in requests])

    def drop(self, request_ids: list[str]) -> None:
        """Cancelled by the scheduler: forget them wherever they are."""
        gone = set(request_ids)
        for rid in gone & self._early.keys():
            del self._early[rid]
        for e in self.engines.values():
            if e.role is Role.PREFILL:
                keep = deque(h for h in e.held if h[0] not in gone)
                for h in e.held:
                    if h[0] in gone:
                        e.tok -= h[1]
                        self._decoder.pop(h[0], None)
                e.held = keep
            else:
                for rid in gone & e.placed.keys():
                    self._release(e, rid)
                e.timers = [t for t in e.timers if t[1] not in gone]
                heapify(e.timers)

    def _release(self, e: SimEngine, rid: str) -> None:
        hbm, prompt = e.placed.pop(rid)
        e.tok -= prompt
        e.free_hbm_tokens += hbm

    def step(self, group: SimGroup, dt: float) -> list[Completion]:
        """Advance one group's engines to ``self.now`` (``dt`` since its last step);
        returns their completions."""
        done: list[Completion] = []
        node = group.engines[0].node
        node.read_q = max(0.0, node.read_q - node.read_tokens_per_s * dt)
        now = self.now
        for e in group.engines:
            if group.role is Role.PREFILL:
                held = e.held
                budget = self.pe_tokens_per_s * dt
                while held and budget > 0:
                    h = held[0]
                    take = min(budget, h[1])
                    h[1] -= take
                    e.tok -= take
                    budget -= take
                    if h[1] <= 0:
                        held.popleft()
                        done.append(Completion(h[0], e.engine_id,
                                               CompletionStage.PREFILL_DONE))
                        de = self._decoder.pop(h[0])
                        if de.local:
                            self._start_decode(de, h[0], now)
                        else:
                            self.outbox.append((h[0], de.engine_id))
            else:
                timers = e.timers
                while timers and timers[0][0] <= now:
                    _, rid = heappop(timers)
                    if rid in e.placed:
                        self._release(e, rid)
                        done.append(Completion(rid, e.engine_id, CompletionStage.DECODE_DONE))
        return done
