"""A seeded generator of agentic trajectories with the paper's Table 2 statistics.

The model (one trajectory, all lengths in tokens, MaxLen ``M``):

- a size factor ``f ~ LogNormal`` with mean 1 makes some agents terse and others verbose;
  terse agents take many turns before reaching ``M``, which is how the table can have
  60 turns of 756 tokens (45K) under a 32K MaxLen;
- a planned number of turns ``T ~ LogNormal`` (at least 1): the task ends by itself;
- round 1's append is the system prompt plus task, ``A_1 ~ LogNormal(first_append)``;
- later appends ``A_k ~ LogNormal(f * append)``, every generation ``g_k ~ LogNormal(f * gen)``;
- the rollout stops at ``M`` like an RL rollout truncated at MaxLen: a round whose append
  would not leave room for one generated token is not started, and the last generation
  is cut so the stream never exceeds ``M``.

The five parameters per MaxLen were calibrated (``_calibrate`` below, 4000 trajectories,
seed 0) so that :func:`dualpath.trace.model.trace_stats` reproduces every column of
Table 2; the spreads (sigmas) are fixed by hand to plausible values since the paper gives
only means. ``context_scale`` multiplies every length and MaxLen (turns unchanged) so the
trace fits a small machine; it is carried in the trace's metadata and must be reported
with every result.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from dualpath.errors import UsageError
from dualpath.trace.model import Round, Trace, Trajectory, stochastic_round


@dataclass(frozen=True)
class TableRow:
    """One row of the paper's Table 2 (per-turn averages; see TraceStats for the reading)."""

    max_len: int
    turns: float
    append: float
    gen: float
    total: float
    context: float


TABLE2 = {
    "32k": TableRow(32 * 1024, 60, 608, 148, 28639, 17183),
    "48k": TableRow(48 * 1024, 106, 474, 172, 42607, 25120),
    "64k": TableRow(64 * 1024, 157, 429, 176, 55958, 32721),
}


@dataclass(frozen=True)
class GeneratorParams:
    """Means and spreads of the trajectory model (full scale, tokens)."""

    max_len: int
    first_append: float      # mean of A_1 (system prompt + task)
    append: float            # mean of A_k, k >= 2, for an agent with f = 1
    gen: float               # mean of g_k for an agent with f = 1
    planned_turns: float     # mean of T before truncation at max_len
    size_sigma: float        # sigma of ln f
    turns_sigma: float = 0.8
    first_append_sigma: float = 0.5
    append_sigma: float = 1.0  # tool outputs vary a lot
    gen_sigma: float = 0.7


# From _calibrate(TABLE2[name], n=4000, seed=0, iters=40), rounded to 2 decimals; with
# those 4000 trajectories every column lands within 0.3% of Table 2 (docs/traces.md).
PARAMS = {
    "32k": GeneratorParams(32 * 1024, first_append=5908.47, append=456.56, gen=149.40,
                           planned_turns=143.81, size_sigma=0.77),
    "48k": GeneratorParams(48 * 1024, first_append=7816.17, append=359.30, gen=173.78,
                           planned_turns=244.16, size_sigma=0.81),
    "64k": GeneratorParams(64 * 1024, first_append=9681.18, append=328.22, gen=178.07,
                           planned_turns=348.86, size_sigma=0.87),
}


def _lognormal(rng: np.random.Generator, mean, sigma: float, size=None):
    """LogNormal with the given MEAN (not median) and log-space sigma."""
    return rng.lognormal(np.log(mean) - sigma * sigma / 2, sigma, size)


def _one(seed: int, index: int, p: GeneratorParams, scale: float, max_len: int):
    """Draw trajectory ``index``'s (appends, gens) as int arrays; see the module docstring.

    Each quantity has its own random stream keyed by (seed, index), so trajectory ``i``
    does not depend on ``n`` or on the other trajectories, and a small change of a
    parameter changes the draws smoothly (what calibration needs)."""
    scalars, a_z, g_z, a_u, g_u = (np.random.default_rng(s) for s in
                                   np.random.SeedSequence([seed, index]).spawn(5))
    f = _lognormal(scalars, 1.0, p.size_sigma)
    turns = int(min(max(1, round(_lognormal(scalars, p.planned_turns, p.turns_sigma))),
                    max_len // 2))  # every round takes >= 2 tokens
    a = _lognormal(a_z, f * p.append * scale, p.append_sigma, turns)
    a[0] = _lognormal(scalars, p.first_append * scale, p.first_append_sigma)
    g = _lognormal(g_z, f * p.gen * scale, p.gen_sigma, turns)
    a = stochastic_round(a, a_u, 1)
    g = stochastic_round(g, g_u, 1)
    a[0] = min(a[0], max_len - 1)  # round 1 always fits
    ends = np.cumsum(a + g)
    over = np.flatnonzero(ends > max_len)
    if over.size:
        k = int(over[0])
        context = int(ends[k - 1]) if k else 0
        if context + a[k] >= max_len:  # no room for one generated token: not started
            a, g = a[:k], g[:k]
        else:
            a, g = a[: k + 1], g[: k + 1]
            g[k] = max_len - context - a[k]
    return a, g


def generate(n: int, table: str = "32k", *, seed: int = 0, context_scale: float = 1.0,
             params: GeneratorParams | None = None, id_prefix: str = "") -> Trace:
    """Generate ``n`` trajectories for a Table 2 row ("32k", "48k", "64k").

    The trace's metadata names the generator,
    table row, seed, scaled MaxLen and ``context_scale``, and travels with the trace
    (the JSONL writer stores it) so every result can report it.
    """
    if table not in PARAMS:
        raise UsageError(f"unknown trace table {table!r}; choose one of {sorted(PARAMS)}")
    if not (isinstance(n, int) and n >= 1):
        raise UsageError(f"number of trajectories must be an integer >= 1, got {n!r}")
    if not (isinstance(context_scale, int | float) and 0 < context_scale <= 1):
        raise UsageError(f"context_scale must be in (0, 1], got {context_scale!r}")
    p = params or PARAMS[table]
    max_len = max(2, round(p.max_len * context_scale))
    prefix = id_prefix or f"gen{table}-s{seed}-"
    trajs = []
    for i in range(n):
        a, g = _one(seed, i, p, context_scale, max_len)
        # tolist(): Python ints, and map(): no per-round frame (7.5 M rounds at 48K agents)
        trajs.append(Trajectory(f"{prefix}{i}", tuple(map(Round, a.tolist(), g.tolist()))))
    meta = {"source": "generator", "table": table, "seed": seed, "n": n,
            "max_len_tokens": max_len, "context_scale": float(context_scale),
            "params": asdict(p)}
    return Trace(tuple(trajs), meta)


def extend(trajectories: Sequence[Trajectory], n: int, *, seed: int = 0,
           max_len: int | None = None) -> list[Trajectory]:
    """The paper's rule for more agents than trajectories (A.3): keep the originals, then
    for each extra one sample a trajectory and prepend a synthetic round with a random
    ``A_1`` and ``g_1 = 1``, so its prefix (and hence its KV) is new.

    ``A_1`` is uniform in [1, 2 x the mean append of the set], cut so the trajectory stays
    within ``max_len`` where there is room. The extra's id is ``<source id>+x<k>``; when
    the source has explicit token ids, the synthetic round gets random ids from ``seed``.
    """
    if not trajectories:
        raise UsageError("extend: no trajectories to sample from")
    if not (isinstance(n, int) and n >= 1):
        raise UsageError(f"number of agents must be an integer >= 1, got {n!r}")
    out = list(trajectories[:n])
    rng = np.random.default_rng(seed)
    mean_append = np.mean([r.append_tokens for t in trajectories for r in t.rounds])
    high = max(1, math.ceil(2 * mean_append))
    for k in range(n - len(out)):
        src = trajectories[int(rng.integers(len(trajectories)))]
        top = high
        if max_len is not None and max_len - src.total_tokens - 1 >= 1:
            top = min(high, max_len - src.total_tokens - 1)
        a1 = int(rng.integers(1, top + 1))
        ids = None
        if src.token_ids is not None:
            ids = np.concatenate([rng.integers(0, 1 << 17, a1 + 1), src.token_ids])
        out.append(Trajectory(f"{src.id}+x{k}", (Round(a1, 1), *src.rounds), ids))
    return out


def _calibrate(row: TableRow, n: int = 4000, seed: int = 0, iters: int = 40,
               start: GeneratorParams | None = None) -> GeneratorParams:
    """Fit the five free parameters to a Table 2 row by damped multiplicative updates,
    each parameter steered by the column it drives most (common random numbers, so the
    objective is smooth). Offline tool: its output is pasted into PARAMS."""
    from dualpath.trace.model import trace_stats

    p = start or GeneratorParams(row.max_len, first_append=2 * row.append, append=row.append,
                                 gen=row.gen, planned_turns=2 * row.turns, size_sigma=0.5)
    for _ in range(iters):
        s = trace_stats(generate(n, params=p, seed=seed).trajectories)
        # size_sigma: a wider spread of f gives terse agents more turns under MaxLen.
        sig = p.size_sigma * (row.turns / s.turns) ** 0.5
        p = GeneratorParams(
            row.max_len,
            first_append=p.first_append * (row.context / s.context) ** 1.5,
            append=p.append * (row.append / s.append),
            gen=p.gen * (row.gen / s.gen),
            planned_turns=p.planned_turns * (row.total / s.total) ** 2,
            size_sigma=min(max(sig, 0.05), 2.0),
        )
    return p
