"""Agentic trajectories and the paper's replay rule (A.3), as plain data and pure functions.

A trajectory is one agent run: rounds ``(A_1, g_1), (A_2, g_2), ...``. Replaying it, round
``i+1``'s prompt is the whole context so far (every earlier append and generation) plus
``A_{i+1}``, and exactly ``g_{i+1}`` tokens are generated. The trajectory is therefore one
token stream ``A_1 g_1 A_2 g_2 ...``; round ``k``'s prompt is a prefix of it.

Hits happen only within a trajectory: round ``k``'s hit tokens are the context before its
append rounded DOWN to whole KV blocks, since only full blocks are persisted (§4.1). This
assumes the previous round's KV (its prompt and every generated token) was persisted; the
emulated decode produces KV for every generated token, so it can be.

Token ids are deterministic per (trajectory id, stream position) unless a trace gives them
explicitly, so chained block hashes (dualpath/kv/prefix.py) hit exactly within a
trajectory and never across two (two streams share a first block with probability
``vocab ** -block_tokens``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from dualpath.errors import UsageError

# Token ids lie in [0, VOCAB_SIZE): a realistic vocabulary (DeepSeek-V3 has 129,280
# entries) that fits int32. Only determinism and spread matter to the replay.
VOCAB_SIZE = 1 << 17

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


@dataclass(frozen=True)
class Round:
    """One turn: ``append_tokens`` new prompt tokens (tool output, user input), then
    ``gen_tokens`` generated tokens (at least one)."""

    append_tokens: int
    gen_tokens: int


@dataclass(frozen=True, eq=False)
class Trajectory:
    """One agent run. ``token_ids``, when given (real traces), is the whole stream
    ``A_1 g_1 A_2 g_2 ...`` as int64; otherwise ids are derived from ``id``."""

    id: str
    rounds: tuple[Round, ...]
    token_ids: np.ndarray | None = field(default=None, repr=False)

    def __post_init__(self):
        if not isinstance(self.id, str) or not self.id:
            raise UsageError(f"trajectory id must be a non-empty string, got {self.id!r}")
        object.__setattr__(self, "rounds", tuple(self.rounds))
        if not self.rounds:
            raise UsageError(f"trajectory {self.id!r}: no rounds")
        for k, r in enumerate(self.rounds):
            low = 1 if k == 0 else 0  # the first prompt must not be empty
            if not (isinstance(r.append_tokens, int) and r.append_tokens >= low):
                raise UsageError(f"trajectory {self.id!r} round {k}: append_tokens must be an "
                                 f"integer >= {low}, got {r.append_tokens!r}")
            if not (isinstance(r.gen_tokens, int) and r.gen_tokens >= 1):
                raise UsageError(f"trajectory {self.id!r} round {k}: gen_tokens must be an "
                                 f"integer >= 1, got {r.gen_tokens!r}")
        if self.token_ids is not None:
            ids = np.asarray(self.token_ids, dtype=np.int64)
            if ids.ndim != 1 or len(ids) != self.total_tokens:
                raise UsageError(f"trajectory {self.id!r}: token_ids has {ids.size} entries, "
                                 f"the rounds add up to {self.total_tokens}")
            if len(ids) and (ids.min() < 0 or ids.max() > np.iinfo(np.int32).max):
                raise UsageError(f"trajectory {self.id!r}: token ids must lie in [0, 2**31)")
            ids.flags.writeable = False
            object.__setattr__(self, "token_ids", ids)

    @property
    def total_tokens(self) -> int:
        """Length of the whole stream: every append and every generation."""
        return sum(r.append_tokens + r.gen_tokens for r in self.rounds)

    def __eq__(self, other):
        if not isinstance(other, Trajectory):
            return NotImplemented
        if self.id != other.id or self.rounds != other.rounds:
            return False
        if self.token_ids is None or other.token_ids is None:
            return self.token_ids is None and other.token_ids is None
        return bool(np.array_equal(self.token_ids, other.token_ids))

    def __hash__(self):
        return hash((self.id, self.rounds))


@dataclass(frozen=True)
class Trace:
    """Trajectories plus where they came from (generator parameters or file path).
    ``context_scale`` (1.0 for a real trace unless its header says otherwise) must be
    reported with every result."""

    trajectories: tuple[Trajectory, ...]
    meta: dict = field(default_factory=dict)

    @property
    def context_scale(self) -> float:
        return float(self.meta.get("context_scale", 1.0))


@dataclass(frozen=True)
class RoundPlan:
    """What round ``index`` of a trajectory asks of the cluster, in tokens."""

    index: int
    context_tokens: int  # the stream before this round's append
    append_tokens: int
    prompt_tokens: int   # context + append
    hit_tokens: int      # context rounded down to whole blocks: read from storage
    miss_tokens: int     # prompt - hit: computed by prefill
    gen_tokens: int

    @property
    def stream_start(self) -> int:
        """Stream position of the first generated token."""
        return self.prompt_tokens


def plan_rounds(traj: Trajectory, block_tokens: int) -> list[RoundPlan]:
    """The replay rule (A.3) for every round of ``traj``; see the module docstring."""
    if not (isinstance(block_tokens, int) and block_tokens >= 1):
        raise UsageError(f"block_tokens must be an integer >= 1, got {block_tokens!r}")
    plans = []
    context = 0
    for k, r in enumerate(traj.rounds):
        prompt = context + r.append_tokens
        hit = context // block_tokens * block_tokens
        plans.append(RoundPlan(index=k, context_tokens=context, append_tokens=r.append_tokens,
                               prompt_tokens=prompt, hit_tokens=hit, miss_tokens=prompt - hit,
                               gen_tokens=r.gen_tokens))
        context = prompt + r.gen_tokens
    return plans


def trajectory_key(traj_id: str) -> int:
    """A stable 64-bit key for a trajectory id (not Python's salted ``hash``)."""
    return int.from_bytes(hashlib.blake2b(traj_id.encode(), digest_size=8).digest(), "little")


def synthetic_token_ids(key: int, start: int, stop: int) -> np.ndarray:
    """Token ids of stream positions ``[start, stop)`` for a trajectory key (splitmix64)."""
    pos = np.arange(start, stop, dtype=np.uint64) + np.uint64(1)
    z = np.uint64(key) + pos * _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    z ^= z >> np.uint64(31)
    return (z % np.uint64(VOCAB_SIZE)).astype(np.int64)


def stream_token_ids(traj: Trajectory, start: int, stop: int) -> np.ndarray:
    """Token ids of stream positions ``[start, stop)`` (explicit ids when the trace has them)."""
    if not 0 <= start <= stop <= traj.total_tokens:
        raise UsageError(f"trajectory {traj.id!r}: positions [{start}, {stop}) outside the "
                         f"stream of {traj.total_tokens} tokens")
    if traj.token_ids is not None:
        return traj.token_ids[start:stop]
    return synthetic_token_ids(trajectory_key(traj.id), start, stop)


def prompt_token_ids(traj: Trajectory, plan: RoundPlan) -> np.ndarray:
    """The prompt of a round: the context so far plus its append."""
    return stream_token_ids(traj, 0, plan.prompt_tokens)


def gen_token_ids(traj: Trajectory, plan: RoundPlan) -> np.ndarray:
    """The tokens the round generates (the emulated model 'generates' these ids)."""
    return stream_token_ids(traj, plan.prompt_tokens, plan.prompt_tokens + plan.gen_tokens)


@dataclass(frozen=True)
class TraceStats:
    """Table 2's columns, measured. Turns and total are means over trajectories; append,
    gen and context are per-turn averages taken per trajectory, then averaged over
    trajectories (the only reading under which the paper's columns agree with one
    another and with MaxLen; docs/traces.md shows why). Context is the prompt length
    (context before the turn plus its append)."""

    trajectories: int
    turns: float
    append: float
    gen: float
    total: float
    context: float

    def as_dict(self) -> dict:
        return {"trajectories": self.trajectories, "turns": self.turns, "append_tokens":
                self.append, "gen_tokens": self.gen, "total_tokens": self.total,
                "context_tokens": self.context}


def trace_stats(trajectories: Sequence[Trajectory]) -> TraceStats:
    if not trajectories:
        raise UsageError("trace_stats: no trajectories")
    turns, append, gen, total, context = [], [], [], [], []
    for t in trajectories:
        a = np.array([r.append_tokens for r in t.rounds], dtype=np.float64)
        g = np.array([r.gen_tokens for r in t.rounds], dtype=np.float64)
        ends = np.cumsum(a + g)
        prompts = ends - g
        turns.append(len(a))
        append.append(a.mean())
        gen.append(g.mean())
        total.append(ends[-1])
        context.append(prompts.mean())
    return TraceStats(len(trajectories), *(float(np.mean(x)) for x in
                                           (turns, append, gen, total, context)))


def stochastic_round(x: np.ndarray, rng: np.random.Generator, minimum: int) -> np.ndarray:
    """Round to integers without bias (floor(x + U[0,1))), then clamp at ``minimum``."""
    return np.maximum(minimum, np.floor(x + rng.random(np.shape(x)))).astype(np.int64)


def scale_trajectories(trajectories: Sequence[Trajectory], factor: float,
                       seed: int = 0) -> list[Trajectory]:
    """Scale every append and generation by ``factor`` (unbiased rounding, at least one
    token each; turns unchanged) so a real trace fits a small machine. Explicit token
    ids cannot be scaled, so a trajectory that has them is refused."""
    if not factor > 0:
        raise UsageError(f"scale factor must be > 0, got {factor!r}")
    rng = np.random.default_rng(seed)
    out = []
    for t in trajectories:
        if t.token_ids is not None:
            raise UsageError(f"trajectory {t.id!r} has explicit token ids; they cannot be scaled")
        a = stochastic_round(np.array([r.append_tokens for r in t.rounds]) * factor, rng, 1)
        g = stochastic_round(np.array([r.gen_tokens for r in t.rounds]) * factor, rng, 1)
        out.append(Trajectory(t.id, tuple(Round(int(x), int(y)) for x, y in zip(a, g))))
    return out


def trajectory_token_ids(traj_id: str, stop: int) -> np.ndarray:
    """Token ids of stream positions ``[0, stop)`` of a generated trajectory: the node
    daemons' token source (dualpath/paths/payload.py) for payloads without ids."""
    return synthetic_token_ids(trajectory_key(traj_id), 0, stop)
