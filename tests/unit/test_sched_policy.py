"""The §6.1 rules on small hand-made examples (expected values follow the paper's text,
quoted in dualpath/scheduler/core/policy.py)."""

from collections import deque

import pytest

from dualpath.kv.profiles import get_profile
from dualpath.scheduler.core import policy
from dualpath.scheduler.core.model import (
    Engine,
    Group,
    Node,
    Params,
    ReadSide,
    Request,
    Role,
    Stage,
)


def make_group(gid, role, toks, read_q=0, free=0, seqs=None, node_per_engine=False):
    g = Group(gid, role, lease_id=1, deadline=1e9)
    shared = Node(f"{gid}-n", read_tokens_per_s=1000.0, read_q=read_q)
    for i, tok in enumerate(toks):
        node = Node(f"{gid}-n{i}", 1000.0, read_q[i]) if node_per_engine else shared
        e = Engine(f"{gid}.{i}", g, node, i, role, seq=(seqs[i] if seqs else 0),
                   free_hbm_tokens=free, hbm_tokens=free)
        e.tok = tok
        g.engines.append(e)
    return g


def req(i, prompt=100, hit=0, gen=0, de=None):
    r = Request(f"r{i}", prompt, hit, gen, seq=i)
    r.de = de
    return r


# ---------------------------------------------------------------- PE


def test_overloaded_pe_gets_nothing_and_min_tok_wins():
    # beta = 1000: engine 0 (tok 1001) is overloaded; engine 2 (tok 10) is the minimum.
    g = make_group("p", Role.PREFILL, [1001, 500, 10], node_per_engine=True,
                   read_q=[0, 0, 0])
    assert policy.pick_prefill_engine(g.engines, alpha=100, beta=1000) is g.engines[2]
    g.engines[2].tok = 1001
    assert policy.pick_prefill_engine(g.engines, 100, 1000) is g.engines[1]


def test_short_read_queue_category_is_preferred_over_lower_tok():
    # Category 2 (read_q <= alpha) beats category 3 even with more unfinished tokens.
    g = make_group("p", Role.PREFILL, [900, 5], node_per_engine=True, read_q=[50, 5000])
    assert policy.pick_prefill_engine(g.engines, alpha=100, beta=1000) is g.engines[0]
    # With no category-2 engine, category 3's minimum tok_e is taken.
    g.engines[0].node.read_q = 101
    assert policy.pick_prefill_engine(g.engines, alpha=100, beta=1000) is g.engines[1]


def test_tok_equal_to_beta_is_not_overloaded():
    # The paper's overloaded category is tok_e > beta (strict).
    g = make_group("p", Role.PREFILL, [1000])
    assert policy.pick_prefill_engine(g.engines, alpha=0, beta=1000) is g.engines[0]


def test_prefill_fetch_updates_tok_and_ends_when_no_pe_is_eligible():
    # Two PEs at tok 0, beta 250, requests of 100 tokens: each PE takes requests until its
    # tok exceeds 250 (0 -> 100 -> 200 -> 300), i.e. 3 each, alternating by min tok_e;
    # then both are overloaded and the fetch ends with 4 requests still queued.
    de_group = make_group("d", Role.DECODE, [0], free=10**6)
    de = de_group.engines[0]
    pe = make_group("p", Role.PREFILL, [0, 0], node_per_engine=True, read_q=[0, 0])
    q = deque(req(i, de=de) for i in range(10))
    out = policy.assign_prefill(q, pe.engines, Params(alpha_tokens=10**9, beta_tokens=250), 99)
    assert [r.request_id for r in out] == [f"r{i}" for i in range(6)]  # FIFO
    assert [r.pe.rank for r in out] == [0, 1, 0, 1, 0, 1]
    assert [e.tok for e in pe.engines] == [300, 300]
    assert [e.seq for e in pe.engines] == [3, 3]
    assert len(q) == 4 and all(r.stage is Stage.PREFILLING for r in out)


def test_category_is_reevaluated_as_read_queue_grows():
    # alpha 150, PEs at tok 0 and 500 on their own nodes. Each request reads 100 hit tokens
    # on the PE side (the DE node's queue is longer). r0, r1 -> PE 0 (lower tok); now its
    # node has read_q 200 > alpha, so r2 goes to PE 1 (category 2) despite tok 500 > 202.
    de_group = make_group("d", Role.DECODE, [0], free=10**6, read_q=10**6)
    de = de_group.engines[0]
    pe = make_group("p", Role.PREFILL, [0, 500], node_per_engine=True, read_q=[0, 0])
    q = deque(req(i, prompt=101, hit=100, de=de) for i in range(3))
    out = policy.assign_prefill(q, pe.engines, Params(alpha_tokens=150, beta_tokens=10**9), 9)
    assert [r.pe.rank for r in out] == [0, 0, 1]
    assert [r.read_side for r in out] == [ReadSide.PREFILL] * 3
    # What each node was ordered to read, for ever (ctl top's READ_MB/S).
    assert [e.node.read_tokens_total for e in pe.engines] == [200, 100]
    assert de.node.read_tokens_total == 0


# ---------------------------------------------------------------- read side


def test_read_side_is_the_shorter_queue_and_tie_goes_to_pe():
    pe, de = Node("p", 1.0, read_q=10), Node("d", 1.0, read_q=20)
    assert policy.choose_read_side(64, pe, de, False, 64) == (ReadSide.PREFILL, 64, 0)
    pe.read_q = 30
    assert policy.choose_read_side(64, pe, de, False, 64) == (ReadSide.DECODE, 0, 64)
    pe.read_q = 20
    assert policy.choose_read_side(64, pe, de, False, 64)[0] is ReadSide.PREFILL
    assert policy.choose_read_side(0, pe, de, False, 64) == (ReadSide.NONE, 0, 0)


def test_split_read_drains_both_queues_together():
    # PE node: queue 1000 tokens at 100 tok/s; DE node: queue 0 at 300 tok/s; hit 2000.
    # (1000 + x)/100 = (0 + 2000 - x)/300 -> 300000 + 300x = 200000 - 100x -> x = -250:
    # all on the DE side.
    pe, de = Node("p", 100.0, read_q=1000), Node("d", 300.0, read_q=0)
    assert policy.choose_read_side(2000, pe, de, True, 1) == (ReadSide.DECODE, 0, 2000)
    # Equal rates and queues: half each; x = (q_d + hit - q_p) / 2 = 1024.
    pe, de = Node("p", 100.0, read_q=0), Node("d", 100.0, read_q=0)
    assert policy.choose_read_side(2048, pe, de, True, 64) == (ReadSide.SPLIT, 1024, 1024)
    # Rates 1:3, empty queues: x/1 = (hit - x)/3 -> x = hit/4 = 640 of 2560, a multiple of 64.
    pe, de = Node("p", 100.0), Node("d", 300.0)
    side, a, b = policy.choose_read_side(2560, pe, de, True, 64)
    assert (side, a, b) == (ReadSide.SPLIT, 640, 1920)
    assert a / pe.read_tokens_per_s == b / de.read_tokens_per_s  # drain together


def test_a_split_gives_each_role_its_share_of_the_cluster():
    """1P2D: the PE node's NIC serves both decode nodes' requests, so with the queues
    equal it reads a third of a hit (the two nodes alone would split it in half)."""
    pe, de = Node("p", 100.0), Node("d", 100.0)
    assert policy.choose_read_side(3072, pe, de, True, 64, 0.0, (1, 2)) == \
        (ReadSide.SPLIT, 1024, 2048)
    # 2P1D: the DE node is the shared one.
    assert policy.choose_read_side(3072, pe, de, True, 64, 0.0, (2, 1)) == \
        (ReadSide.SPLIT, 2048, 1024)
    # Queues still count: (q_p + x) / (1 * 100) = (q_d + hit - x) / (2 * 100).
    pe.read_q = 1024
    assert policy.choose_read_side(3072, pe, de, True, 64, 0.0, (1, 2)) == \
        (ReadSide.SPLIT, 320, 2752)


def test_split_reads_balance_a_1p2d_cluster_however_requests_arrive():
    """Requests that each find the read queues empty (they arrive apart): every node
    ends up reading a third of all. Weighing the two nodes alone, the PE node read half."""
    def run(shares):
        p = Node("p0", 100.0)
        ds = [Node("d0", 100.0), Node("d1", 100.0)]
        for i in range(12):
            _, a, b = policy.choose_read_side(3072, p, ds[i % 2], True, 64, 0.0, shares)
            p.read_tokens_total += a
            ds[i % 2].read_tokens_total += b
        return [n.read_tokens_total for n in (p, *ds)]
    assert run((1, 2)) == [12 * 1024, 6 * 2048, 6 * 2048]
    assert run((1, 1)) == [12 * 1536, 6 * 1536, 6 * 1536]


def test_a_split_that_saves_less_than_the_minimum_is_one_sided():
    # Equal rates, empty queues, hit 2048 at 100 tok/s: one side ends in 20.48 s, a split
    # in 10.24 s; it splits when 10.24 s is worth it, not when more is asked.
    pe, de = Node("p", 100.0), Node("d", 100.0)
    assert policy.choose_read_side(2048, pe, de, True, 64, 10.0)[0] is ReadSide.SPLIT
    assert policy.choose_read_side(2048, pe, de, True, 64, 10.5) == (ReadSide.PREFILL, 2048, 0)
    # A fast idle NIC (a compute-bound cluster): a split saves microseconds, the PE reads.
    pe, de = Node("p", 3e6), Node("d", 3e6)
    assert policy.choose_read_side(2048, pe, de, True, 64, 0.05) == (ReadSide.PREFILL, 2048, 0)
    # Not worth splitting, but the DE's side ends sooner: the DE reads it all.
    pe, de = Node("p", 100.0, read_q=300), Node("d", 100.0, read_q=100)
    assert policy.choose_read_side(640, pe, de, True, 64, 60.0) == (ReadSide.DECODE, 0, 640)


# ---------------------------------------------------------------- DE


def test_group_phase_sends_each_request_to_the_least_loaded_group():
    # Loads 300, 100, 250 (sum tok_e); 100-token requests go to the minimum each time:
    # g1 (100 -> 200), g1 (200 -> 300), then ties at 250 (g2) vs 300: g2 (250 -> 350).
    gs = [make_group("g0", Role.DECODE, [300]), make_group("g1", Role.DECODE, [50, 50]),
          make_group("g2", Role.DECODE, [250])]
    q = deque(req(i) for i in range(3))
    assert policy.distribute_to_groups(q, gs) == 3
    assert [r.de_group.group_id for r in (*gs[1].private_queue, *gs[2].private_queue)] == \
        ["g1", "g1", "g2"]
    assert not q and gs[1].private_tokens == 200 and gs[1].total_tok == 300


def test_z_target_follows_the_paper_formula():
    # free HBM 600 + 600 = 1200; requests need 500 each (prompt 400 + 100 generated): R is
    # the first two (1000 <= 1200 < 1500). Z = 1.05 * (400 + 400 + 100 + 300) / 2 = 630.
    g = make_group("d", Role.DECODE, [100, 300], free=600)
    q = deque(req(i, prompt=400, gen=100) for i in range(3))
    assert policy.z_target(q, g.engines, 1.05, limit=99) == pytest.approx(630.0)
    assert policy.z_target(q, g.engines, 1.05, limit=1) == pytest.approx(1.05 * 800 / 2)


def test_in_group_prefers_low_token_des_by_seq_then_high_by_tok():
    # Z = 1000 (given). r needs 100 HBM, len 100.
    g = make_group("d", Role.DECODE, [850, 500, 950], free=1000, seqs=[1, 7, 0])
    # Low class (tok + 100 <= 1000): e0 (950, seq 1) and e1 (600, seq 7): min seq -> e0.
    assert policy.pick_decode_engine(g.engines, 100, 100, 1000.0) is g.engines[0]
    # e0 without HBM: e1 is the only low-class DE.
    g.engines[0].free_hbm_tokens = 99
    assert policy.pick_decode_engine(g.engines, 100, 100, 1000.0) is g.engines[1]
    # Only high-class DEs left (Z 500): the minimum tok_e of those with HBM -> e1 (500).
    assert policy.pick_decode_engine(g.engines, 100, 100, 500.0) is g.engines[1]
    # Nobody has 2000 tokens of HBM.
    assert policy.pick_decode_engine(g.engines, 2000, 100, 1e9) is None


def test_in_group_phase_reserves_hbm_and_stops_when_none_fits():
    # Two DEs with 1000 tokens free; requests need 600: one per DE, the third waits.
    g = make_group("d", Role.DECODE, [0, 0], free=1000)
    for i in range(3):
        r = req(i, prompt=500, gen=100)
        r.de_group = g
        g.private_queue.append(r)
        g.private_tokens += 500
    out = policy.assign_in_group(g, Params(alpha_tokens=0, beta_tokens=0), limit=99)
    assert [r.request_id for r in out] == ["r0", "r1"]
    assert {r.de.rank for r in out} == {0, 1}
    assert [e.free_hbm_tokens for e in g.engines] == [400, 400]
    assert len(g.private_queue) == 1 and g.private_tokens == 500
    assert all(r.stage is Stage.PREFILL_QUEUE for r in out)


def test_drained_engines_are_skipped_everywhere():
    g = make_group("d", Role.DECODE, [0, 0], free=1000)
    g.engines[0].drained = True
    r = req(0, prompt=10)
    g.private_queue.append(r)
    out = policy.assign_in_group(g, Params(alpha_tokens=0, beta_tokens=0), limit=9)
    assert [x.de.rank for x in out] == [1]
    p = make_group("p", Role.PREFILL, [0, 99])
    p.engines[0].drained = True
    assert policy.pick_prefill_engine(p.engines, 10**9, 10**9) is p.engines[1]


# ---------------------------------------------------------------- alpha / beta


def test_alpha_and_beta_derive_from_rates():
    prof = get_profile("ds660b")
    # 50 GB/s for 3 s over 61 layers x 656 B per token (paper appendix) = 3,748,500 tokens.
    assert policy.derive_alpha(50e9, prof.kv_bytes_per_token, 3.0) == int(150e9 // 40016)
    # beta = 5 s x tokens/s of a 32,721-token turn with 429 new tokens.
    from dualpath.kv import cost

    t = cost.request_prefill_s(prof, 32721 - 429, 429)
    assert policy.derive_beta(prof, 5.0) == int(5.0 * 32721 / t)
    assert policy.derive_beta(prof, 10.0) == pytest.approx(2 * policy.derive_beta(prof, 5.0),
                                                           abs=1)


def test_the_scheduler_weighs_a_split_by_the_up_nodes_of_each_role():
    """Wired through a fetch: a 1P2D cluster's PE node reads a third of a hit that finds
    the queues empty; with one DE group down (1P1D now), half."""
    from dualpath.scheduler.core import RequestSpec
    from tests.unit.test_sched_reliability import cluster, run_to_pe

    s, gs = cluster(split_read=True, split_align_tokens=64)
    s.submit([RequestSpec(4000, 3072, 10, "a")])
    (r,) = run_to_pe(s, gs, 1.0)
    assert (r.read_side, r.prefill_read_tokens, r.decode_read_tokens) == \
        (ReadSide.SPLIT, 1024, 2048)
    s.release_group("d1", gs["d1"].lease_id, 1.5)
    s.submit([RequestSpec(4000, 3072, 10, "b")])
    for g in s.groups.values():      # the queues are empty again (the nodes' reports)
        for e in g.engines:
            e.node.read_q = 0
    got = [x for x in run_to_pe(s, gs, 2.0) if x.request_id == "b"]
    assert (got[0].prefill_read_tokens, got[0].decode_read_tokens) == (1536, 1536)
