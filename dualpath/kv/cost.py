"""The cost model: FLOPs of a prefill batch and decode steps, converted to seconds.

The paper predicts a forward batch's time from its FLOPs with a fit profiled in advance
(§6.2, "as PrefillOnly and Sarathi-Serve do") but gives neither the FLOP formula nor the
fit. Ours, per layer, for a request that has ``cached`` tokens whose KV already exists and
computes ``bsz`` new tokens in this batch:

* linear (dense / active-expert matmuls): ``bsz * linear_flops_per_token_layer``;
* attention: causal, so new token ``i`` (1-based) attends ``cached + i`` keys, capped at
  ``attn_key_cap`` keys when the model uses sparse attention (DSA's top-k); each
  (query, key) pair costs ``attn_flops_per_pair_layer``.

Seconds = FLOPs / ``gpu_flops_per_s`` (the linear fit through the origin; the profile's
rate is an effective, not peak, figure) for a batch large enough to fill the GPU
(:func:`prefill_s`, the scheduler's throughput figures). What the emulated engine
spends on a forward batch (:func:`forward_time`, :func:`group_layer_time`) is that times
the batch factor ``1 + batch_half_tokens / n`` for a batch of ``n`` new tokens: small
batches leave the GPU partly idle (the paper's Fig. 3 right, which the profiles'
``batch_half_tokens`` is fitted to). A PE does not use these formulas to pack its
batches: it fits its own estimator by profiling the engine (engines/emulated/batching.py).

All functions are pure and cheap enough to run inside the scheduler's binary search
(closed forms, no loops over tokens).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from dualpath.errors import UsageError
from dualpath.kv.profiles import ModelProfile


def attention_pairs(cached: int, bsz: int, key_cap: int = 0) -> int:
    """(query, key) pairs of ``bsz`` causal queries after ``cached`` keys; ``key_cap`` 0 = no cap.

    Query i (1..bsz) sees ``min(cached + i, key_cap)`` keys.
    """
    if cached < 0 or bsz < 0:
        raise UsageError(f"attention_pairs: cached={cached} and bsz={bsz} must be >= 0")
    if key_cap <= 0:
        return bsz * cached + bsz * (bsz + 1) // 2
    # Queries before the cap is reached: i <= key_cap - cached.
    under = min(max(key_cap - cached, 0), bsz)
    return under * cached + under * (under + 1) // 2 + (bsz - under) * key_cap


def prefill_layer_flops(profile: ModelProfile, pairs: Iterable[tuple[int, int]]) -> float:
    """FLOPs of one layer for a batch of ``(cached, bsz)`` pairs."""
    lin = profile.linear_flops_per_token_layer
    att = profile.attn_flops_per_pair_layer
    cap = profile.attn_key_cap
    total = 0.0
    for cached, bsz in pairs:
        total += bsz * lin + attention_pairs(cached, bsz, cap) * att
    return total


def attention_layer_flops(profile: ModelProfile, pairs: Iterable[tuple[int, int]]) -> float:
    """Attention FLOPs of one layer for a batch of ``(cached, bsz)`` pairs."""
    cap = profile.attn_key_cap
    return float(sum(attention_pairs(c, b, cap) for c, b in pairs)) * \
        profile.attn_flops_per_pair_layer


def attention_member_flops(profile: ModelProfile, cached: int, bsz: int) -> float:
    """:func:`attention_layer_flops` of one member, without a generator (the batch
    packer's bisection asks this a dozen times a member)."""
    return float(attention_pairs(cached, bsz, profile.attn_key_cap)) * \
        profile.attn_flops_per_pair_layer


def batch_factor(profile: ModelProfile, new_tokens: float) -> float:
    """How many times its FLOPs at the full rate a forward batch of ``new_tokens`` new
    tokens takes (>= 1; 1 for an empty batch)."""
    if new_tokens < 0:
        raise UsageError(f"batch_factor: {new_tokens} new tokens")
    return 1.0 + profile.batch_half_tokens / new_tokens if new_tokens > 0 else 1.0


@dataclass(frozen=True)
class ForwardTime:
    """What one forward pass (all layers) of a batch costs one engine, in seconds."""

    attention_s: float
    linear_s: float

    @property
    def total_s(self) -> float:
        return self.attention_s + self.linear_s


def forward_time(profile: ModelProfile, pairs: Sequence[tuple[int, int]]) -> ForwardTime:
    """The emulated engine's time for one forward pass of a batch of ``(cached, bsz)``
    pairs: its attention and its linear FLOPs at the GPU's rate, each times the batch
    factor of the batch's new tokens."""
    rate = profile.gpu_flops_per_s
    m = batch_factor(profile, sum(b for _, b in pairs)) * profile.layers / rate
    lin = sum(b for _, b in pairs) * profile.linear_flops_per_token_layer
    return ForwardTime(attention_layer_flops(profile, pairs) * m, lin * m)


def group_layer_time(profile: ModelProfile, batches: Sequence[Sequence[tuple[int, int]]]
                     ) -> tuple[float, list[float]]:
    """One layer of one forward step of an engine group that runs expert parallel, as
    the paper's does (§6.2): every engine computes attention over its own batch, the
    group synchronises, and the FFN/MoE then spreads every engine's tokens over all
    of them. Returns (the layer's seconds, each engine's attention seconds): the slowest
    attention holds every engine up, which is what the compute quota balances."""
    if not batches:
        return 0.0, []
    rate, L = profile.gpu_flops_per_s, profile.layers
    attn = [forward_time(profile, b).attention_s / L for b in batches]
    tokens = sum(bsz for b in batches for _, bsz in b)
    per_engine = tokens / len(batches)
    ffn = (tokens * profile.linear_flops_per_token_layer / len(batches) / rate
           * batch_factor(profile, per_engine))
    return max(attn) + ffn, attn


def prefill_s(profile: ModelProfile, pairs: Iterable[tuple[int, int]]) -> float:
    """Predicted seconds of one forward pass (all layers) of a prefill batch."""
    return profile.layers * prefill_layer_flops(profile, pairs) / profile.gpu_flops_per_s


def request_prefill_s(profile: ModelProfile, cached: int, bsz: int) -> float:
    """Predicted seconds to prefill ``bsz`` new tokens after ``cached`` ones, alone."""
    return prefill_s(profile, ((cached, bsz),))


def decode_step_s(profile: ModelProfile, contexts: Iterable[int]) -> float:
    """Predicted seconds of one decode step of a batch whose requests hold ``contexts``
    tokens each (one new token per request). Decode is memory-bound: a pass over the
    weights (``decode_s_per_token``, the step of a lone short request) plus reading the
    keys each request attends (all of its context, or ``attn_key_cap`` of them under
    sparse attention) from HBM at ``hbm_bytes_per_s``."""
    if profile.hbm_bytes_per_s <= 0:
        return profile.decode_s_per_token
    cap = profile.attn_key_cap
    keys = 0
    for c in contexts:
        if c < 0:
            raise UsageError(f"decode_step_s: a context of {c} tokens")
        keys += min(c, cap) if cap > 0 else c
    return profile.decode_s_per_token + keys * profile.kv_bytes_per_token / profile.hbm_bytes_per_s


def prompt_tokens_per_s(profile: ModelProfile, context_tokens: int, append_tokens: int) -> float:
    """Prompt tokens one GPU gets through per second for requests of ``context_tokens``
    tokens of which the last ``append_tokens`` miss the cache (the rest are read, not
    computed). This is the rate at which a PE's ``tok_e`` drains, used to derive β."""
    if append_tokens <= 0 or context_tokens < append_tokens:
        raise UsageError(f"prompt_tokens_per_s: need 0 < append_tokens ({append_tokens}) "
                         f"<= context_tokens ({context_tokens})")
    return context_tokens / request_prefill_s(profile, context_tokens - append_tokens,
                                              append_tokens)
