"""Simulated engines: a PE node's forward steps and a DE engine's batched decode (pure,
driven by :mod:`dualpath.sim.cluster` on the simulated clock).

PE node (paths/prefill.py + engines/emulated/forward.py): a request takes one of its engine's
``max_prefills_per_engine`` slots, reserves its prompt's blocks in the node's PE buffer,
has its hit read (its own part through this node's storage NIC; the DE's part through
the DE node's NIC, then over the compute network into this buffer; the split is the
daemon's own ``split_blocks``), then joins its engine's forward queue. The node's
engines step together: each engine's batch is the real ``pack_batch`` under the compute
quota with the engine's profiled ``AttentionFit`` and its HBM (Layer Block slots, a ring
of ``DEPTH`` layer windows per member with layerwise prefill, every layer without), and
a step lasts ``layers x group_layer_time`` (the slowest engine's attention plus the
group's FFN), or longer when loading the members' cached KV from the PE buffer into HBM
over the GPU's compute NIC is slower (a layer at a time with layerwise prefill, all
before layer 0 without). Each member's computed KV goes to its DE over the compute
network during its last chunk's step.

DE engine (engines/emulated/decode_batch.py): continuous batching, as a fluid: every member makes
one token per step and a step lasts ``decode_step_s`` of the members' contexts (each
counted at its mean over its own decode: prompt + gen/2), so an engine's step time
changes only when a member joins or leaves and a request's finish is computed, not
stepped — the same per-token time as the daemon's loop, without its per-step cost.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field, replace

from dualpath.engines.emulated.batching import (
    Estimator,
    HbmBudget,
    PrefillWork,
    advance,
    pack_batch,
)
from dualpath.engines.emulated.forward import layer_slots
from dualpath.kv import cost
from dualpath.kv.profiles import ModelProfile
from dualpath.sim.resources import Link, Pool


@dataclass(slots=True, eq=False)
class SimRequest:
    """One round of one agent through the simulated cluster (times in seconds)."""

    request_id: str
    agent: int
    round: int
    mode: str
    prompt: int
    hit: int
    gen: int
    submit_s: float
    pe: PrefillEngine | None = None
    de: DecodeEngine | None = None
    local_tokens: int = 0            # hit tokens the PE node reads
    remote_tokens: int = 0           # hit tokens the DE node reads (and sends over)
    computed_from: int = 0           # the forward's first computed token
    expected_pe: int = 0             # read_q tokens counted before the read is queued
    expected_de: int = 0
    buffer_blocks: int = 0
    local_end_s: float = 0.0         # the PE's own read and the host CPU's part end
    staged_s: float = 0.0
    prefill_done_s: float = 0.0
    first_token_s: float = 0.0
    second_token_s: float | None = None
    finish_s: float = 0.0
    ended: bool = False

    @property
    def layerwise(self) -> bool:
        return self.mode != "basic"

    @property
    def moves_kv(self) -> bool:
        return self.mode != "oracle"


@dataclass(slots=True, eq=False)
class PrefillEngine:
    engine_id: str
    node: PrefillNode
    slots: int
    tokens: dict = field(default_factory=dict)   # rid -> prompt tokens (tok_e, seq_e)
    tok: int = 0
    waiting: deque = field(default_factory=deque)    # requests waiting for a slot
    queue: deque = field(default_factory=deque)      # PrefillWork in the forward
    work_of: dict = field(default_factory=dict)      # rid -> SimRequest in the forward


class PrefillNode:
    """One PE node: engines, storage NIC (read, write), compute NIC (in, out), PE buffer."""

    def __init__(self, node_id: str, n_engines: int, slots: int, *, snic: float,
                 cnic_node: float, cnic_gpu: float, buffer_blocks: int, hbm_units: int,
                 window_s: float):
        self.node_id = node_id
        self.read = Link(f"{node_id}/snic-read", snic, window_s)
        self.write = Link(f"{node_id}/snic-write", snic)
        self.cnic_in = Link(f"{node_id}/cnic-in", cnic_node)
        self.cnic_out = Link(f"{node_id}/cnic-out", cnic_node)
        self.cnic_gpu = cnic_gpu
        self.buffer = Pool(f"{node_id}/pe-buffer", buffer_blocks)
        self.hbm_units = hbm_units               # Layer Block slots per engine
        self.expected = 0                        # read_q tokens not yet queued
        self.engines = [PrefillEngine(f"{node_id}/e{k}", self, slots)
                        for k in range(n_engines)]
        self.leader = None                       # its group's leader (sim.cluster)
        self.stepping = False
        self.steps: list[tuple[float, tuple[float, ...]]] = []   # (seconds, attention)

    def read_q(self, now: float, kv_bytes_per_token: int) -> int:
        return int(self.expected + self.read.backlog(now) / kv_bytes_per_token)


def hbm_need(req: SimRequest, tokens: int, block_tokens: int, layers: int) -> int:
    """Layer Block slots a member computing up to ``tokens`` of context holds, by the
    emulated PE's own rule (engines/emulated/forward.py: ``layer_slots``)."""
    return layer_slots(tokens, block_tokens, layers, req.layerwise, req.moves_kv)


@dataclass
class StepPlan:
    duration_s: float
    attention_s: tuple[float, ...]
    batches: dict          # engine -> list[BatchSlice]


def plan_step(node: PrefillNode, profile: ModelProfile, estimate: Estimator,
              quota_s: float) -> StepPlan | None:
    """The node's next forward step (None: no engine has a batch), by the daemons'
    ``pack_batch`` and ``group_layer_time``."""
    T, L = profile.block_tokens, profile.layers
    batches = {}
    for e in node.engines:
        if not e.queue:
            continue
        work_of = e.work_of

        def need(w: PrefillWork, tokens: int, work_of=work_of) -> int:
            return hbm_need(work_of[w.request_id], tokens, T, L)
        b = pack_batch(e.queue, estimate, quota_s, hbm=HbmBudget(node.hbm_units, need))
        if b:
            batches[e] = b
    if not batches:
        return None
    pairs = [[(s.cached_tokens, s.tokens) for s in b] for b in batches.values()]
    layer_s, attn = cost.group_layer_time(profile, pairs)
    # Loading each member's cached KV from the PE buffer into HBM (one GPU's CNIC).
    load_s = 0.0
    lw_s = 0.0
    kv = profile.kv_bytes_per_token
    for e, b in batches.items():
        per_engine = [0.0, 0.0]                # (layerwise, all layers first)
        for s in b:
            r = e.work_of[s.request_id]
            if r.moves_kv and s.cached_tokens:
                per_engine[0 if r.layerwise else 1] += s.cached_tokens * kv / node.cnic_gpu
        lw_s = max(lw_s, per_engine[0])
        load_s = max(load_s, per_engine[1])
    duration = load_s + L * max(layer_s, lw_s / L)
    return StepPlan(duration, tuple(a * L for a in attn), batches)


def finish_step(plan: StepPlan) -> list[SimRequest]:
    """Account a finished step (the daemons' ``advance``): the requests whose prefill
    ended."""
    done = []
    for e, b in plan.batches.items():
        for rid in advance(e.queue, b):
            done.append(e.work_of.pop(rid))
    return done


class DecodeEngine:
    """One DE engine's continuous decode batch, as a fluid (module docstring)."""

    def __init__(self, engine_id: str, node: DecodeNode, profile: ModelProfile,
                 hbm_blocks: int):
        self.engine_id = engine_id
        self.node = node
        self.T = profile.block_tokens
        self.cap = profile.attn_key_cap
        # decode_step_s is linear in the keys attended: one context of the sum of the
        # members' (capped) keys, uncapped, is the batch's step.
        self._flat = replace(profile, attn_key_cap=0)
        self.hbm_blocks = hbm_blocks
        self.reserved = 0                  # HBM blocks held by placed requests
        self.tokens: dict[str, int] = {}   # rid -> prompt tokens (tok_e, seq_e)
        self.tok = 0
        self.v = 0.0                       # tokens every member has made, as a fluid
        self.v_at = 0.0
        self.keys = 0.0
        self.members = 0
        self.heap: list = []               # (v at which it is done, seq, request)
        self.gen = 0                       # invalidates stale finish events
        self._seq = 0
        self.largest = 0
        self._step_keys, self._step = -1, 0.0

    @property
    def free_hbm_tokens(self) -> int:
        return max(0, self.hbm_blocks - self.reserved) * self.T

    def blocks_of(self, r: SimRequest) -> int:
        return -(-(r.prompt + r.gen) // self.T)

    def step_s(self) -> float:
        keys = int(self.keys)
        if keys != self._step_keys:         # the step changes only when the keys do
            self._step_keys, self._step = keys, cost.decode_step_s(self._flat, (keys,))
        return self._step

    def _keys_of(self, r: SimRequest) -> float:
        c = r.prompt + r.gen / 2
        return min(c, self.cap) if self.cap > 0 else c

    def update(self, now: float) -> None:
        if self.members:
            self.v += (now - self.v_at) / self.step_s()
        self.v_at = now

    def join(self, r: SimRequest, now: float) -> float:
        """``r`` starts decoding its ``gen - 1`` remaining tokens; returns its second
        token's time."""
        self.update(now)
        self.keys += self._keys_of(r)
        self.members += 1
        self.largest = max(self.largest, self.members)
        self._seq += 1
        heapq.heappush(self.heap, (self.v + r.gen - 1, self._seq, r))
        return now + self.step_s()

    def due(self, now: float) -> list[SimRequest]:
        """Members done by ``now`` leave the batch."""
        self.update(now)
        out = []
        while self.heap and self.heap[0][0] <= self.v + 1e-9:
            _, _, r = heapq.heappop(self.heap)
            self.keys -= self._keys_of(r)
            self.members -= 1
            out.append(r)
        if not self.members:
            self.keys = 0.0
        return out

    def next_finish(self, now: float) -> float | None:
        if not self.heap:
            return None
        return now + max(0.0, self.heap[0][0] - self.v) * self.step_s()


class DecodeNode:
    """One DE node: engines, storage NIC (read, write), compute NIC (in, out), DE buffer."""

    def __init__(self, node_id: str, n_engines: int, profile: ModelProfile, *, snic: float,
                 cnic_node: float, buffer_blocks: int, hbm_blocks: int, window_s: float):
        self.node_id = node_id
        self.read = Link(f"{node_id}/snic-read", snic, window_s)
        self.write = Link(f"{node_id}/snic-write", snic)
        self.cnic_in = Link(f"{node_id}/cnic-in", cnic_node)
        self.cnic_out = Link(f"{node_id}/cnic-out", cnic_node)
        self.buffer = Pool(f"{node_id}/de-buffer", buffer_blocks)
        # The write-back's queue (paths/writeback.py): (blocks, order, request), the
        # request with the fewest blocks to write first; one written at a time.
        self.writes: list = []
        self.writing = False
        self.expected = 0
        self.in_prefill_queue = 0   # the scheduler's prefill queue: requests with a DE here
        self.leader = None
        self.engines = [DecodeEngine(f"{node_id}/e{k}", self, profile, hbm_blocks)
                        for k in range(n_engines)]

    def read_q(self, now: float, kv_bytes_per_token: int) -> int:
        return int(self.expected + self.read.backlog(now) / kv_bytes_per_token)
