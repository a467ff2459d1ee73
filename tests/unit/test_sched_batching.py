"""The cost model (dualpath.kv.cost) and intra-engine batching (paper §6.2)."""

from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dualpath.engines.emulated.batching import (
    AttentionFit,
    HbmBudget,
    PrefillWork,
    ProfileEstimate,
    advance,
    batch_seconds,
    fit_attention,
    pack_batch,
)
from dualpath.errors import UsageError
from dualpath.kv import cost
from dualpath.kv.profiles import PROFILES, get_profile


def brute_pairs(cached, bsz, cap):
    # Query i (1-based) attends cached + i keys, at most cap (0 = unlimited).
    return sum(min(cached + i, cap) if cap else cached + i for i in range(1, bsz + 1))


@given(st.integers(0, 5000), st.integers(0, 3000), st.sampled_from([0, 1, 64, 2048]))
def test_attention_pairs_closed_form_matches_the_definition(cached, bsz, cap):
    assert cost.attention_pairs(cached, bsz, cap) == brute_pairs(cached, bsz, cap)


def test_prefill_seconds_by_hand():
    # demo profile: 8 layers, linear 2e6 FLOPs/token/layer, 4096 FLOPs/pair, no cap, 1e12
    # FLOP/s. (cached 10, bsz 2): linear 4e6; pairs 11 + 12 = 23 -> 94,208 FLOPs;
    # 8 x 4,094,208 / 1e12 s.
    p = get_profile("demo")
    assert cost.prefill_s(p, [(10, 2)]) == pytest.approx(8 * 4_094_208 / 1e12)
    assert cost.prefill_s(p, [(10, 2), (0, 1)]) == pytest.approx(
        cost.request_prefill_s(p, 10, 2) + cost.request_prefill_s(p, 0, 1))
    with pytest.raises(UsageError):
        cost.attention_pairs(-1, 1)


def test_a_decode_step_grows_with_the_keys_its_batch_attends():
    # demo: 2 ms per step alone, 16 KiB of KV per token read at 256 GB/s: a batch holding
    # 32K tokens reads 512 MiB, 2.097 ms more.
    p = get_profile("demo")
    assert cost.decode_step_s(p, []) == pytest.approx(p.decode_s_per_token)
    assert cost.decode_step_s(p, [16384, 16384]) == pytest.approx(
        0.002 + 32768 * 16384 / 256e9)
    # Sparse attention reads at most attn_key_cap keys per request (ds660b: 2048).
    d = get_profile("ds660b")
    assert cost.decode_step_s(d, [100_000]) == cost.decode_step_s(d, [2048])
    assert cost.decode_step_s(d, [2048] * 64) > cost.decode_step_s(d, [2048] * 8)
    # A GPU 10x slower is 10x slower at both.
    assert cost.decode_step_s(p.scaled(0.1), [16384]) == pytest.approx(
        10 * cost.decode_step_s(p, [16384]))
    with pytest.raises(UsageError):
        cost.decode_step_s(p, [-1])


def test_sparse_attention_caps_the_cost_of_long_contexts():
    # ds660b attends at most 2048 keys, so 1 new token after 100K or 1M cached costs the same.
    p = get_profile("ds660b")
    assert cost.request_prefill_s(p, 100_000, 1) == cost.request_prefill_s(p, 1_000_000, 1)
    q = get_profile("qwen32b")  # dense: grows with the context
    assert cost.request_prefill_s(q, 1_000_000, 1) > cost.request_prefill_s(q, 100_000, 1)


def test_whole_requests_fit_fifo_and_an_overflowing_one_is_chunked():
    p = get_profile("demo")
    one = cost.request_prefill_s(p, 0, 1000)
    quota = 2.5 * one
    q = [PrefillWork("a", 0, 1000), PrefillWork("b", 0, 1000), PrefillWork("c", 0, 1000),
         PrefillWork("d", 0, 10)]
    batch = pack_batch(q, ProfileEstimate(p), quota, min_chunk_tokens=1)
    assert [s.request_id for s in batch] == ["a", "b", "c"]  # FIFO; d waits behind c
    assert batch[0].tokens == batch[1].tokens == 1000
    c = batch[2].tokens
    assert 0 < c < 1000
    assert batch_seconds(ProfileEstimate(p), batch) <= quota
    # Binary search found the largest chunk: one more token would overflow.
    assert 2 * one + cost.request_prefill_s(p, 0, c + 1) > quota


def test_chunks_continue_from_their_cached_tokens():
    p = get_profile("demo")
    q = deque([PrefillWork("a", 500, 4000), PrefillWork("b", 0, 100)])
    quota = cost.request_prefill_s(p, 500, 1500)
    total = 0
    rounds = 0
    while q:
        batch = pack_batch(q, ProfileEstimate(p), quota, min_chunk_tokens=64)
        assert batch_seconds(ProfileEstimate(p), batch) <= quota or len(batch) == 1
        total += sum(s.tokens for s in batch)
        advance(q, batch)
        rounds += 1
    assert total == 4100  # every new token computed exactly once
    assert rounds >= 3    # 4000 tokens at <= 1500 per batch


def test_a_request_bigger_than_the_quota_still_progresses_by_one_minimal_chunk():
    p = get_profile("ds660b")
    batch = pack_batch([PrefillWork("huge", 0, 100_000)], ProfileEstimate(p), quota_s=1e-9,
                       min_chunk_tokens=64)
    assert [(s.request_id, s.tokens) for s in batch] == [("huge", 64)]
    # A small chunk is not started behind other work: the batch just ends.
    q = [PrefillWork("a", 0, 10), PrefillWork("b", 0, 100_000)]
    quota = cost.request_prefill_s(p, 0, 10) + cost.request_prefill_s(p, 0, 30)
    assert [(s.request_id, s.tokens) for s in pack_batch(q, ProfileEstimate(p), quota, 64)] == [("a", 10)]


@settings(max_examples=150, deadline=None)
@given(
    profile=st.sampled_from(sorted(PROFILES)),
    works=st.lists(st.tuples(st.integers(0, 60_000), st.integers(1, 20_000)), min_size=1,
                   max_size=12),
    quota_ms=st.floats(0.01, 2000),
    min_chunk=st.sampled_from([1, 16, 64, 512]),
)
def test_quota_is_never_exceeded_except_by_one_minimal_chunk(profile, works, quota_ms,
                                                             min_chunk):
    p = get_profile(profile)
    quota = quota_ms / 1000
    q = [PrefillWork(f"r{i}", c, n) for i, (c, n) in enumerate(works)]
    batch = pack_batch(q, ProfileEstimate(p), quota, min_chunk)
    assert batch, "a non-empty queue always yields work"
    # FIFO: the batch is a prefix of the queue, every slice whole except maybe the last.
    assert [s.request_id for s in batch] == [w.request_id for w in q[:len(batch)]]
    for s, w in zip(batch[:-1], q, strict=False):
        assert s.tokens == w.remaining_tokens and s.cached_tokens == w.cached_tokens
    t = batch_seconds(ProfileEstimate(p), batch)
    if t > quota * (1 + 1e-9):
        first = q[0]
        assert len(batch) == 1 and batch[0].tokens == min(min_chunk, first.remaining_tokens)


def test_a_batch_factor_makes_small_batches_dearer_per_token_as_fig3_right_says():
    p = get_profile("ds660b")
    one = cost.forward_time(p, [(30_000, 300)]).total_s
    ten = cost.forward_time(p, [(30_000, 300)] * 10).total_s
    # The paper's Fig. 3 right: token throughput at a batch of 10 is ~2.9x that of one.
    assert 10 * one / ten == pytest.approx(2.9, abs=0.05)
    # At the full rate (no batch factor) the two would be equal per token.
    assert cost.prefill_s(p, [(30_000, 300)] * 10) == pytest.approx(
        10 * cost.prefill_s(p, [(30_000, 300)]))
    assert cost.batch_factor(p, 0) == 1.0


def test_a_group_layer_waits_for_its_slowest_attention_and_shares_the_ffn():
    p = get_profile("demo")
    light, heavy = [(1000, 64)], [(8000, 64)] * 4
    t, attn = cost.group_layer_time(p, [light, heavy])
    assert attn[1] > attn[0]
    ffn = t - max(attn)
    assert ffn > 0
    # Alone, each engine pays its own attention and its own FFN.
    t_heavy, _ = cost.group_layer_time(p, [heavy])
    assert t_heavy == pytest.approx(cost.forward_time(p, heavy).total_s / p.layers)
    assert t >= max(attn) and t < attn[0] + attn[1] + ffn * 2


def test_the_fitted_estimator_tracks_the_engine_it_profiled():
    p = get_profile("demo")

    def engine(batch):
        return cost.forward_time(p, batch).attention_s
    fit = fit_attention(p, engine)
    assert isinstance(fit, AttentionFit) and fit.s_per_flop > 0 and fit.s_per_flop_token > 0
    # Batches unlike the profiled ones, a lone small one and a mixed one among them: the
    # batch's size is in the fit, so a small chunk of a long context is priced as dear
    # as the engine makes it (FLOPs alone put it at a quarter of that).
    for batch in ([(4096, 256)] * 8, [(1024, 1024)] * 4, [(16384, 64)] * 16,
                  [(1024, 64)], [(30_000, 150)], [(3000, 150), (100, 2000)]):
        f = sum(fit.flops(c, b) for c, b in batch)
        assert fit.seconds(f, sum(b for _, b in batch)) == pytest.approx(engine(batch),
                                                                       rel=0.02)
    with pytest.raises(UsageError, match="usable samples"):
        fit_attention(p, lambda batch: 0.0)


def test_a_fit_drops_a_term_the_engine_does_not_have():
    p = get_profile("demo")
    probe = AttentionFit(p, 0.0, 0.0)

    def flat(batch):                      # time follows FLOPs whatever the batch's size
        return 0.002 + sum(probe.flops(c, b) for c, b in batch) / 1e12
    fit = fit_attention(p, flat)
    assert fit.s_per_flop == pytest.approx(1e-12, rel=0.01)
    assert fit.intercept_s == pytest.approx(0.002, rel=0.05)
    assert fit.s_per_flop_token == pytest.approx(0.0, abs=1e-15)
    with pytest.raises(UsageError, match="does not grow"):
        fit_attention(p, lambda batch: 0.5)


def test_a_chunk_of_a_long_context_stays_within_the_quota_on_the_engine():
    # Fig. 14's imbalance in stop 25: the packer cut a request of a long context to a
    # chunk its FLOPs-only fit put at the quota, and the engine spent ~4x that.
    p = get_profile("demo")

    def engine(batch):
        return cost.forward_time(p, batch).attention_s
    fit = fit_attention(p, engine)
    work = [PrefillWork("long", p.context_tokens // 2, 4096)]
    quota = engine([(p.context_tokens // 2, 4096)]) / 3
    batch = pack_batch(work, fit, quota)
    assert len(batch) == 1 and 64 <= batch[0].tokens < 4096
    spent = engine([(s.cached_tokens, s.tokens) for s in batch])
    assert 0.8 * quota <= spent <= quota * 1.02


def test_hbm_ends_a_batch_fifo_and_cuts_a_chunk_to_what_fits():
    p = get_profile("demo")
    T = p.block_tokens

    def need(w, tokens):
        return -(-tokens // T)          # one slot per block of context
    q = [PrefillWork("a", 0, 4 * T), PrefillWork("b", 0, 4 * T), PrefillWork("c", 0, T)]
    quota = 1e9                          # only memory binds
    batch = pack_batch(q, ProfileEstimate(p), quota, min_chunk_tokens=1,
                       hbm=HbmBudget(6, need))
    # a fits (4 slots); b gets the 2 blocks left as a chunk; c waits behind it (FIFO).
    assert [(s.request_id, s.tokens) for s in batch] == [("a", 4 * T), ("b", 2 * T)]
    # Nothing fits: the batch is empty, even where the quota would allow a minimal chunk.
    assert pack_batch(q, ProfileEstimate(p), 1e-9, hbm=HbmBudget(0, need)) == []
