"""The replay rule (paper A.3) on hand-made trajectories, and deterministic token ids."""

import numpy as np
import pytest

from dualpath.errors import UsageError
from dualpath.trace.model import (
    Round,
    Trajectory,
    gen_token_ids,
    plan_rounds,
    prompt_token_ids,
    scale_trajectories,
    stream_token_ids,
    trace_stats,
)

# A1=100 g1=20 | A2=50 g2=10 | A3=7 g3=1, block size 64.
HAND = Trajectory("hand", (Round(100, 20), Round(50, 10), Round(7, 1)))


def test_replay_rule_prompt_hit_miss_by_hand():
    p = plan_rounds(HAND, block_tokens=64)
    # round 0: no context; prompt = A1 = 100; nothing persisted yet -> hit 0, miss 100.
    assert (p[0].context_tokens, p[0].prompt_tokens, p[0].hit_tokens, p[0].miss_tokens) == \
        (0, 100, 0, 100)
    # round 1: context = 100 + 20 = 120; prompt = 120 + 50 = 170;
    # hit = 120 rounded down to 64 = 64; miss = 170 - 64 = 106.
    assert (p[1].context_tokens, p[1].prompt_tokens, p[1].hit_tokens, p[1].miss_tokens) == \
        (120, 170, 64, 106)
    # round 2: context = 170 + 10 = 180; prompt = 187; hit = 128 (2 blocks); miss = 59.
    assert (p[2].context_tokens, p[2].prompt_tokens, p[2].hit_tokens, p[2].miss_tokens) == \
        (180, 187, 128, 59)
    assert [x.gen_tokens for x in p] == [20, 10, 1]
    assert HAND.total_tokens == 188  # 100+20+50+10+7+1


def test_block_tokens_is_a_parameter():
    # block 16: round 1 hit = 120 // 16 * 16 = 112; round 2 hit = 180 // 16 * 16 = 176.
    assert [x.hit_tokens for x in plan_rounds(HAND, block_tokens=16)] == [0, 112, 176]
    # block 1: everything in the context hits.
    assert [x.hit_tokens for x in plan_rounds(HAND, block_tokens=1)] == [0, 120, 180]
    with pytest.raises(UsageError, match="block_tokens"):
        plan_rounds(HAND, block_tokens=0)


def test_prompt_extends_previous_context_within_a_trajectory():
    p = plan_rounds(HAND, 64)
    r0, r1 = prompt_token_ids(HAND, p[0]), prompt_token_ids(HAND, p[1])
    g0 = gen_token_ids(HAND, p[0])
    assert len(r1) == 170 and len(g0) == 20
    # round 1's prompt = round 0's prompt + round 0's generation + A2 new tokens.
    assert np.array_equal(r1[:120], np.concatenate([r0, g0]))
    # and ids are a pure function of (trajectory id, position).
    again = Trajectory("hand", HAND.rounds)
    assert np.array_equal(prompt_token_ids(again, p[1]), r1)


def test_no_shared_prefix_across_trajectories():
    other = Trajectory("other", HAND.rounds)
    a = stream_token_ids(HAND, 0, 64)
    b = stream_token_ids(other, 0, 64)
    # Two streams share a first block only if all 64 ids agree; here the very first
    # ids already differ (probability of equality is 2**-17 per position).
    assert not np.array_equal(a, b)
    assert (a != b).sum() >= 60
    assert a.min() >= 0 and a.max() < 1 << 17


def test_explicit_token_ids_are_used_and_checked():
    ids = np.arange(188)
    t = Trajectory("x", HAND.rounds, ids)
    p = plan_rounds(t, 64)
    assert prompt_token_ids(t, p[1]).tolist() == list(range(170))
    with pytest.raises(UsageError, match="187"):
        Trajectory("x", HAND.rounds, np.arange(187))
    with pytest.raises(UsageError, match="positions"):
        stream_token_ids(t, 0, 189)


@pytest.mark.parametrize("rounds, field", [
    ((Round(0, 1),), "append_tokens"),
    ((Round(1, 0),), "gen_tokens"),
    ((Round(1, 1), Round(-1, 1)), "append_tokens"),
    ((), "no rounds"),
])
def test_invalid_trajectories_are_refused(rounds, field):
    with pytest.raises(UsageError, match=field):
        Trajectory("bad", rounds)


def test_trace_stats_by_hand():
    s = trace_stats([HAND, Trajectory("b", (Round(10, 2),))])
    # HAND: turns 3, append mean (100+50+7)/3 = 52.333, gen mean 31/3 = 10.333,
    # total 188, prompts 100, 170, 187 -> context mean 152.333. b: 1, 10, 2, 12, 10.
    assert s.turns == 2.0
    assert s.append == pytest.approx((157 / 3 + 10) / 2)
    assert s.gen == pytest.approx((31 / 3 + 2) / 2)
    assert s.total == 100.0
    assert s.context == pytest.approx((457 / 3 + 10) / 2)


def test_scale_keeps_turns_and_floors_at_one_token():
    big = [Trajectory(f"t{i}", tuple(Round(600, 150) for _ in range(40))) for i in range(20)]
    small = scale_trajectories(big, 0.1, seed=1)
    assert [len(t.rounds) for t in small] == [40] * 20
    s = trace_stats(small)
    # 600 x 0.1 = 60 and 150 x 0.1 = 15 exactly, so rounding has nothing to do.
    assert (s.append, s.gen) == (60.0, 15.0)
    tiny = scale_trajectories(big, 0.001, seed=1)  # 0.6 and 0.15 -> floor of one token
    assert all(r.append_tokens >= 1 and r.gen_tokens >= 1 for t in tiny for r in t.rounds)
    with pytest.raises(UsageError, match="explicit token ids"):
        scale_trajectories([Trajectory("x", HAND.rounds, np.arange(188))], 0.5)


def _chain_hashes(ids, block):
    """Chained block hashes as dualpath/kv/prefix.py defines prefix identity (issue 4):
    block j's key covers every token before it. Only full blocks get a key."""
    import hashlib

    keys, h = [], b""
    for j in range(len(ids) // block):
        h = hashlib.blake2b(h + ids[j * block:(j + 1) * block].tobytes(), digest_size=16).digest()
        keys.append(h)
    return keys


def test_chained_hashes_hit_exactly_the_planned_tokens_and_only_within_a_trajectory():
    from dualpath.trace.generator import generate

    block = 8
    trajs = generate(6, "32k", seed=5, context_scale=0.01).trajectories
    store = set()  # one shared store: every trajectory's persisted full blocks
    for t in trajs:
        for p in plan_rounds(t, block):
            keys = _chain_hashes(prompt_token_ids(t, p), block)
            hit_blocks = 0
            while hit_blocks < len(keys) and keys[hit_blocks] in store:
                hit_blocks += 1
            # The store holds other trajectories' blocks too, yet the lookup finds
            # exactly the plan's hits: none from elsewhere, all from this trajectory.
            assert hit_blocks * block == p.hit_tokens, (t.id, p.index)
            # after the round, every full block of prompt + generation is persisted
            end = p.prompt_tokens + p.gen_tokens
            store.update(_chain_hashes(stream_token_ids(t, 0, end), block))
    assert sum(p.hit_tokens for t in trajs for p in plan_rounds(t, block)) > 0
