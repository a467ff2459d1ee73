"""Intra-engine scheduling of a PE (paper §6.2): which requests enter the next forward batch.

Requests are taken FIFO while the batch's predicted time stays within the compute quota
(300 ms by default, paper A.4). A request that would overflow it is chunked: a binary
search on its new-token count finds the largest chunk that still fits, and it is prefilled
in pieces (chunked prefill) — the rest stays at the head for the next batch. A DE needs
none of this: all its requests join every decode step.

[ours] The quota bounds the predicted time of the whole forward pass (all layers; see
dualpath.kv.cost). The paper says "attention-layer time"; per-layer time is the forward
time divided by the layer count, so the two differ by a constant factor. A chunk below
``min_chunk_tokens`` is not worth a kernel launch and ends the batch instead — except when
the batch would otherwise be empty, where one minimal chunk runs even over the quota so
that a request too large for the quota still makes progress.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

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


def pack_batch(queue: Iterable[PrefillWork], profile: ModelProfile, quota_s: float,
               min_chunk_tokens: int = 64) -> list[BatchSlice]:
    """The next forward batch for ``queue`` (not modified; see :func:`advance`)."""
    if quota_s <= 0 or min_chunk_tokens <= 0:
        raise UsageError(f"pack_batch: quota_s ({quota_s}) and min_chunk_tokens "
                         f"({min_chunk_tokens}) must be > 0")
    def seconds(cached: int, bsz: int) -> float:
        return cost.request_prefill_s(profile, cached, bsz)

    batch: list[BatchSlice] = []
    used = 0.0
    for w in queue:
        if w.remaining_tokens <= 0:
            continue
        t = seconds(w.cached_tokens, w.remaining_tokens)
        if used + t <= quota_s:
            batch.append(BatchSlice(w.request_id, w.cached_tokens, w.remaining_tokens))
            used += t
            continue
        # Largest chunk c in [0, remaining) with used + seconds(cached, c) <= quota:
        # seconds() grows with c, so bisect. Invariant: lo fits, hi does not.
        lo, hi = 0, w.remaining_tokens
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if used + seconds(w.cached_tokens, mid) <= quota_s:
                lo = mid
            else:
                hi = mid
        if lo >= min_chunk_tokens:
            batch.append(BatchSlice(w.request_id, w.cached_tokens, lo))
        elif not batch:
            batch.append(BatchSlice(w.request_id, w.cached_tokens,
                                    min(min_chunk_tokens, w.remaining_tokens)))
        break
    return batch


def batch_seconds(profile: ModelProfile, batch: Iterable[BatchSlice]) -> float:
    """Predicted forward time of a batch (the quantity the quota bounds)."""
    return cost.prefill_s(profile, ((s.cached_tokens, s.tokens) for s in batch))


def advance(queue: deque[PrefillWork], batch: list[BatchSlice]) -> list[str]:
    """Account a finished batch: chunks become cached tokens; returns the ids whose
    prefill is complete (removed from the head of ``queue``)."""
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
