"""Intra-engine scheduling of a PE (paper §6.2): which requests enter the next forward batch.

Requests are taken FIFO while the batch's predicted time stays within the compute quota
(300 ms by default, paper A.4). A request that would overflow it is chunked: a binary
search on its new-token count finds the largest chunk that still fits, and it is prefilled
in pieces (chunked prefill) — the rest stays at the head for the next batch. A DE needs
none of this: all its requests join every decode step.

The prediction is an :class:`Estimator`: FLOPs per request, added up over the batch, then
converted to seconds at the batch's size (its new tokens). As in the paper, a PE converts
with a fit it profiled in advance (:func:`fit_attention`: the batch's attention FLOPs ->
the engine's attention time, "as PrefillOnly and Sarathi-Serve do"), not with the
engine's own formula; :class:`ProfileEstimate` (the cost model's whole forward at the
full rate) is the formula, for planning and tests.

[ours] The fit has two terms, the batch's FLOPs and its FLOPs per new token. The paper
gives neither its features nor its fit; FLOPs alone cannot say that a small chunk of a
long context is slow (a batch of few new tokens leaves the GPU partly idle, the paper's
Fig. 3 right): with FLOPs alone a 150-token chunk over a long context ran at 4x the
quota, and the engines' attention was never balanced (docs/reproduction.md, fig14).

[ours] The quota bounds the predicted attention time of the whole forward pass (all
layers). The paper says "attention-layer time"; per-layer time is the forward's divided
by the layer count, so the two differ by a constant factor. A chunk below
``min_chunk_tokens`` is not worth a kernel launch and ends the batch instead — except when
the batch would otherwise be empty, where one minimal chunk runs even over the quota so
that a request too large for the quota still makes progress.

Memory: a batch also needs HBM for every member's KV while it computes
(:class:`HbmBudget`: a layer at a time with layerwise prefill, all layers without). A
request whose KV does not fit ends the batch (FIFO: nobody overtakes it); a chunk is cut
to what fits, as to what the quota allows.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from dualpath.errors import UsageError
from dualpath.kv import cost
from dualpath.kv.profiles import ModelProfile


@dataclass(slots=True)
class PrefillWork:
    """A request waiting on a PE: ``cached_tokens`` already have KV (storage hit plus
    earlier chunks), ``remaining_tokens`` still need computing."""

    request_id: str
    cached_tokens: int
    remaining_tokens: int


@dataclass(frozen=True, slots=True)
class BatchSlice:
    """One request's part of a forward batch: the (cached, bsz) pair of the paper."""

    request_id: str
    cached_tokens: int
    tokens: int


class Estimator(Protocol):
    """A forward batch's predicted seconds: ``seconds(sum of flops(cached, bsz), sum of
    bsz)``, with ``flops`` additive over the batch's requests and ``seconds``
    non-decreasing in its FLOPs."""

    def flops(self, cached: int, bsz: int) -> float: ...

    def seconds(self, flops: float, tokens: int) -> float: ...


@dataclass(frozen=True)
class ProfileEstimate:
    """The cost model's own prediction: a whole forward's FLOPs at the GPU's full rate."""

    profile: ModelProfile

    def flops(self, cached: int, bsz: int) -> float:
        return self.profile.layers * cost.prefill_layer_flops(self.profile, ((cached, bsz),))

    def seconds(self, flops: float, tokens: int) -> float:
        return flops / self.profile.gpu_flops_per_s    # the full rate: any batch size


@dataclass(frozen=True)
class AttentionFit:
    """Predicted attention seconds of a forward over its attention FLOPs F (all layers)
    and new tokens n: ``intercept_s + s_per_flop * F + s_per_flop_token * F / n``, a
    fit profiled on an engine (:func:`fit_attention`). An empty batch costs nothing."""

    profile: ModelProfile
    intercept_s: float
    s_per_flop: float
    s_per_flop_token: float = 0.0     # seconds per (FLOP per new token)

    def flops(self, cached: int, bsz: int) -> float:
        return self.profile.layers * cost.attention_member_flops(self.profile, cached, bsz)

    def seconds(self, flops: float, tokens: int) -> float:
        if flops <= 0:
            return 0.0
        return (self.intercept_s + self.s_per_flop * flops
                + self.s_per_flop_token * flops / max(tokens, 1))

    def describe(self) -> str:
        rate = f"FLOPs / {1 / self.s_per_flop:.3g} FLOP/s" if self.s_per_flop > 0 else "0"
        return (f"attention s = {self.intercept_s * 1e3:.3g} ms + {rate} + "
                f"(FLOPs per new token) x {self.s_per_flop_token:.3g} s")


def profiling_batches(profile: ModelProfile) -> list[list[tuple[int, int]]]:
    """The batches a PE times to fit its estimator: 1 to 16 like requests of short to
    long contexts (up to a quarter of the model's), each appending 64 to 1024 tokens."""
    ctx = profile.context_tokens
    out = []
    for n in (1, 2, 4, 8, 16):
        for cached in (0, ctx // 64, ctx // 16, ctx // 4):
            for bsz in (64, 256, 1024):
                out.append([(cached, bsz)] * n)
    return out


def fit_attention(profile: ModelProfile,
                  measure: Callable[[Sequence[tuple[int, int]]], float],
                  batches: Iterable[Sequence[tuple[int, int]]] | None = None
                  ) -> AttentionFit:
    """Fit predicted attention seconds to a batch's attention FLOPs and its FLOPs per new
    token: ``measure(batch)`` is the engine's attention time of one forward of ``batch``
    (the paper profiles the engine in advance); least squares on the relative error
    (weights 1/t^2), so short and long batches count alike. The engine's time need not
    have the fit's form: the fit is what the PE knows. A term that comes out negative
    (the samples say it does not matter) is left out and the rest fitted again."""
    probe = AttentionFit(profile, 0.0, 0.0)
    rows, ys = [], []
    for batch in (profiling_batches(profile) if batches is None else batches):
        f = sum(probe.flops(c, b) for c, b in batch)
        n = sum(b for _, b in batch)
        t = measure(batch)
        if f > 0 and t > 0:
            rows.append((1.0, f, f / max(n, 1)))
            ys.append(t)
    if len(ys) < 2:
        raise UsageError(f"fit_attention: {len(ys)} usable samples for {profile.name} "
                         "(its attention costs nothing?)")
    x = np.array(rows)
    y = np.array(ys)
    terms = [0, 1, 2]                    # intercept, FLOPs, FLOPs per new token
    while True:
        scale = x[:, terms].max(axis=0)          # conditioning: every column ~1
        a = x[:, terms] / scale / y[:, None]     # rows weighted by 1/t
        if np.linalg.matrix_rank(a) < len(terms):
            raise UsageError(f"fit_attention: degenerate samples for {profile.name}")
        coef = np.linalg.lstsq(a, np.ones(len(y)), rcond=None)[0] / scale
        bad = [t for t, c in zip(terms, coef) if c < 0 and t != 1]
        if not bad:
            break
        terms.remove(bad[-1])
    got = dict(zip(terms, coef.tolist()))
    # Rounding leaves a FLOPs term of ~1e-30 s/FLOP where time does not follow FLOPs at
    # all (its share of the longest sample, not its sign, says whether it is there).
    if got.get(1, 0.0) * x[:, 1].max() <= 1e-9 * y.max():
        raise UsageError(f"fit_attention: time does not grow with FLOPs for {profile.name}")
    return AttentionFit(profile, got.get(0, 0.0), got[1], got.get(2, 0.0))


@dataclass(frozen=True)
class HbmBudget:
    """HBM a batch may use: ``free`` units, request ``w`` needing ``need(w, tokens)`` of
    them to compute up to ``tokens`` tokens of context (more tokens, no fewer units)."""

    free: int
    need: Callable[[PrefillWork, int], int]


def pack_batch(queue: Iterable[PrefillWork], estimate: Estimator, quota_s: float,
               min_chunk_tokens: int = 64, hbm: HbmBudget | None = None
               ) -> list[BatchSlice]:
    """The next forward batch for ``queue`` (not modified; see :func:`advance`)."""
    if quota_s <= 0 or min_chunk_tokens <= 0:
        raise UsageError(f"pack_batch: quota_s ({quota_s}) and min_chunk_tokens "
                         f"({min_chunk_tokens}) must be > 0")
    batch: list[BatchSlice] = []
    used = 0.0                           # FLOPs of the batch so far
    used_tokens = 0                      # and its new tokens
    held = 0                             # HBM units of the batch so far

    def fits(w: PrefillWork, c: int, *, timed: bool = True) -> bool:
        if hbm is not None and held + hbm.need(w, w.cached_tokens + c) > hbm.free:
            return False
        return not timed or estimate.seconds(used + estimate.flops(w.cached_tokens, c),
                                             used_tokens + c) <= quota_s

    for w in queue:
        if w.remaining_tokens <= 0:
            continue
        if fits(w, w.remaining_tokens):
            batch.append(BatchSlice(w.request_id, w.cached_tokens, w.remaining_tokens))
            used += estimate.flops(w.cached_tokens, w.remaining_tokens)
            used_tokens += w.remaining_tokens
            held += hbm.need(w, w.cached_tokens + w.remaining_tokens) if hbm else 0
            continue
        # Largest chunk c in [0, remaining) that fits: memory grows with c, and so does
        # the predicted time but for the per-new-token term, which can fall a little as
        # c grows when earlier members have more FLOPs per token; bisect all the same
        # (at worst a slightly smaller chunk). Invariant: lo fits (0 trivially), hi not.
        lo, hi = 0, w.remaining_tokens
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if fits(w, mid):
                lo = mid
            else:
                hi = mid
        if lo >= min_chunk_tokens:
            batch.append(BatchSlice(w.request_id, w.cached_tokens, lo))
        elif not batch:
            c = min(min_chunk_tokens, w.remaining_tokens)
            if fits(w, c, timed=False):         # over the quota, never over memory
                batch.append(BatchSlice(w.request_id, w.cached_tokens, c))
        break
    return batch


def batch_seconds(estimate: Estimator, batch: Iterable[BatchSlice]) -> float:
    """Predicted time of a batch (the quantity the quota bounds)."""
    batch = list(batch)
    return estimate.seconds(sum(estimate.flops(s.cached_tokens, s.tokens) for s in batch),
                            sum(s.tokens for s in batch))


def advance(queue: deque[PrefillWork], batch: list[BatchSlice]) -> list[str]:
    """Account a finished batch: chunks become cached tokens; returns the ids whose
    prefill is complete (removed from ``queue``)."""
    done = []
    for s in batch:
        w = queue[0] if queue and queue[0].request_id == s.request_id else None
        if w is None:
            w = next((x for x in queue if x.request_id == s.request_id), None)
            if w is None:
                raise UsageError(f"advance: request {s.request_id} is not in the queue")
        w.cached_tokens += s.tokens
        w.remaining_tokens -= s.tokens
        if w.remaining_tokens <= 0:
            queue.remove(w)
            done.append(w.request_id)
    return done
