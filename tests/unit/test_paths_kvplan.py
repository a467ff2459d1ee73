"""dualpath/paths/payload.py and kvplan.py: request payloads, prompt blocks, layer runs
and routes (pure code).

Expected values come from the module's own contract (its docstring): block ``i`` covers
tokens ``[i*T, (i+1)*T)``, full blocks carry the chained prefix key of dualpath/kv/prefix.py,
the trailing partial block is keyed by the same chain over its partial tokens, and the
PE fills a layer as the hit tokens' route runs + ``layer_runs(hit, prompt)``
(dualpath/engines/emulated/prefill.py, engine.py), so together they must cover every byte of the
prompt exactly once.
"""

import dataclasses
import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dualpath.errors import UsageError
from dualpath.kv.layout import BlockLayout
from dualpath.kv.placement import KvFormat, KvPlacement
from dualpath.kv.prefix import ROOT_KEY, block_keys, chain_key
from dualpath.paths.kvplan import (
    PrefillPlan,
    Route,
    block_spans,
    blocks_for,
    decode_plan,
    layer_runs,
)
from dualpath.paths.payload import Payload, encode_token_ids
from dualpath.trace.model import synthetic_token_ids, trajectory_key, trajectory_token_ids

T = 4   # tokens per block in these tests: small, so prompts span several blocks


# ------------------------------------------------------------------ Payload

def _payload(**kw) -> Payload:
    base = {"trajectory": "traj-7", "round": 3, "prompt_tokens": 10, "hit_tokens": 4,
            "gen_tokens": 5}
    return Payload(**{**base, **kw})


def test_payload_round_trips_every_field():
    ids = encode_token_ids(np.arange(20, 35))
    p = _payload(mode="basic", sink="127.0.0.1:9", layerwise=False,
                 read_policy="round_robin", token_ids_b64=ids, temperature=0.5,
                 top_p=0.9, seed=7, ignore_eos=False, stream=True, cache_salt="s1",
                 tenant="acme", sampling={"stop": ["\n\n"], "top_k": 5, "min_tokens": 2})
    assert Payload.decode(p.encode()) == p
    # The wire form is compact JSON of exactly the dataclass fields (the scheduler's
    # opaque payload bytes; replay clients and nodes of other versions read it).
    assert json.loads(p.encode()) == {
        "trajectory": "traj-7", "round": 3, "prompt_tokens": 10, "hit_tokens": 4,
        "gen_tokens": 5, "mode": "basic", "sink": "127.0.0.1:9", "layerwise": False,
        "read_policy": "round_robin", "token_ids_b64": ids, "temperature": 0.5,
        "top_p": 0.9, "seed": 7, "ignore_eos": False, "stream": True, "cache_salt": "s1",
        "tenant": "acme", "sampling": {"stop": ["\n\n"], "top_k": 5, "min_tokens": 2}}
    assert b" " not in p.encode()


@pytest.mark.parametrize("kw", [{"temperature": 2.5}, {"temperature": -1}, {"top_p": 0},
                                {"top_p": 1.5}, {"seed": -2}])
def test_payload_refuses_sampling_out_of_range(kw):
    with pytest.raises(UsageError, match="temperature"):
        _payload(**kw)


def test_payload_defaults_survive_a_round_trip():
    p = _payload()
    q = Payload.decode(p.encode())
    assert (q.mode, q.sink, q.layerwise, q.read_policy, q.token_ids_b64) == (
        "dualpath", "", True, "scheduler", "")
    assert not q.oracle and _payload(mode="oracle").oracle


@pytest.mark.parametrize("data,names", [
    (b"not json", "malformed"),
    (b'{"trajectory": "t"}', "malformed"),                       # fields missing
    (_payload().encode()[:-1] + b',"extra":1}', "malformed"),     # unknown field
    (_payload().encode().replace(b'"dualpath"', b'"fast"'), "mode"),
    (_payload().encode().replace(b'"scheduler"', b'"random"'), "read_policy"),
    (_payload().encode().replace(b'"hit_tokens":4', b'"hit_tokens":10'), "hit < prompt"),
])
def test_bad_payloads_are_usage_errors_naming_the_problem(data, names):
    with pytest.raises(UsageError, match=names):
        Payload.decode(data)


def test_explicit_token_ids_are_carried_and_bounded():
    ids = np.array([5, 0, 2**31 - 1, 17, 9], dtype=np.int64)
    p = _payload(prompt_tokens=4, hit_tokens=0, gen_tokens=1,
                 token_ids_b64=encode_token_ids(ids))
    assert p.token_ids(5, trajectory_token_ids).tolist() == ids.tolist()
    assert p.token_ids(3, trajectory_token_ids).tolist() == ids[:3].tolist()
    with pytest.raises(UsageError, match="5 token ids, 6 needed"):
        p.token_ids(6, trajectory_token_ids)


def test_derived_token_ids_are_the_trajectory_stream_and_prefix_stable():
    p = _payload()
    want = synthetic_token_ids(trajectory_key("traj-7"), 0, 15)
    assert p.token_ids(15, trajectory_token_ids).tolist() == want.tolist()
    # The prompt's ids are a prefix of prompt + generation: the PE (prompt) and the
    # DE's persist (prompt + gen) key the same leading blocks.
    assert p.token_ids(10, trajectory_token_ids).tolist() == want[:10].tolist()


# ------------------------------------------------------------------ blocks

def test_full_block_keys_are_the_prefix_chain_keys():
    tokens = np.arange(100, 112)                  # 12 tokens = 3 full blocks
    spans = block_spans(tokens, T)
    assert [s.index for s in spans] == [0, 1, 2]
    assert [s.tokens for s in spans] == [T, T, T]
    assert [s.key for s in spans] == block_keys(tokens, T)


def test_trailing_partial_block_rule():
    tokens = np.arange(100, 110)                  # 10 tokens = 2 full blocks + 2 tokens
    spans = block_spans(tokens, T)
    full = block_keys(tokens, T)
    assert len(spans) == 3 and len(full) == 2     # the partial block is never stored
    assert [s.key for s in spans[:2]] == full
    tail = spans[2]
    assert (tail.index, tail.tokens) == (2, 2)
    # Keyed by the same chain over its partial tokens (module docstring)...
    assert tail.key == chain_key(full[1], tokens[8:10])
    # ...so it differs from the key the full block at that place gets once decode
    # fills it: a partial block can never be mistaken for a stored Full Block.
    longer = np.arange(100, 112)
    assert tail.key != block_keys(longer, T)[2]
    assert [s.key for s in block_spans(longer, T)[:2]] == full


def test_a_prompt_shorter_than_a_block_is_one_partial_block_from_the_root():
    spans = block_spans(np.array([7, 8, 9]), T)
    assert len(spans) == 1
    assert (spans[0].index, spans[0].tokens) == (0, 3)
    assert spans[0].key == chain_key(ROOT_KEY, [7, 8, 9])


@given(n=st.integers(0, 40), bt=st.integers(1, 9))
def test_spans_cover_the_prompt_and_blocks_for_counts_them(n, bt):
    tokens = np.arange(n) * 3 + 1
    spans = block_spans(tokens, bt)
    assert sum(s.tokens for s in spans) == n
    assert len(spans) == blocks_for(n, bt) == -(-n // bt)     # ceiling division
    assert all(s.tokens == bt for s in spans[:-1])
    assert [s.key for s in spans if s.tokens == bt] == block_keys(tokens, bt)


def test_blocks_for_examples():
    assert [blocks_for(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


# ------------------------------------------------------------------ layer runs

def test_layer_runs_example():
    # tokens [5, 19) with 8-token blocks: the tail of block 0, all of block 1, the
    # head of block 2 (5..7, 8..15, 16..18).
    assert list(layer_runs(5, 19, 8)) == [(0, 5, 8), (1, 0, 8), (2, 0, 3)]
    assert list(layer_runs(8, 16, 8)) == [(1, 0, 8)]
    assert list(layer_runs(7, 7, 8)) == []


@given(first=st.integers(0, 50), extra=st.integers(0, 50), bt=st.integers(1, 9))
def test_layer_runs_cover_every_token_once_within_blocks(first, extra, bt):
    stop = first + extra
    seen = []
    for b, s0, s1 in layer_runs(first, stop, bt):
        assert 0 <= s0 < s1 <= bt                   # never empty, never past a block
        seen.extend(b * bt + t for t in range(s0, s1))
    assert seen == list(range(first, stop))


@given(hit_blocks=st.integers(0, 4), miss=st.integers(1, 14))
def test_pe_layer_fill_covers_every_prompt_byte_exactly_once(hit_blocks, miss):
    """The PE's per-layer writes into HBM (prefill.py): the hit tokens' runs of the PE
    buffer -> HBM route, then the miss tokens' bytes from layer_runs(hit, prompt)
    (engines/emulated/engine.py). Together they must write every byte the DE verifies (span.tokens *
    token_bytes per layer) exactly once, and nothing past the prompt in the trailing
    partial block. HBM slot i is at i * full_bytes here, so offsets map to blocks."""
    layout = BlockLayout(layers=3, tokens=T, token_bytes=5)
    LB, TB = layout.layer_bytes, layout.token_bytes
    hit = hit_blocks * T
    prompt = hit + miss
    spans = block_spans(np.arange(prompt), T)
    fmt = KvFormat.flat(layout)
    nb = len(spans)
    pe = KvPlacement.full_blocks(fmt, "pe_buffer", layout.full_bytes, max(nb, 1))
    hbm = KvPlacement.full_blocks(fmt, "hbm0", layout.full_bytes, nb)
    route = Route(pe, list(range(nb)), hbm, list(range(nb)))
    count = np.zeros((len(spans), layout.full_bytes), dtype=np.int64)
    for layer in range(layout.layers):
        flat = count.reshape(-1)
        for r in route.runs(layer, 0, hit):
            flat[r.dst_offset:r.dst_offset + r.length] += 1
        for b, s0, s1 in layer_runs(hit, prompt, T):
            count[b, layer * LB + s0 * TB: layer * LB + s1 * TB] += 1
    want = np.zeros_like(count)
    for i, s in enumerate(spans):
        for layer in range(layout.layers):
            want[i, layer * LB: layer * LB + s.tokens * TB] = 1
    assert np.array_equal(count, want)


@pytest.mark.parametrize("sampling, needle", [
    ({"stop": ["x"] * 17}, "stop"), ({"stop": [""]}, "stop"), ({"stop": "x"}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"), ({"top_k": 1.5}, "top_k"),
    ({"presence_penalty": 3}, "presence_penalty"), ({"min_p": 2}, "min_p"),
    ({"min_tokens": True}, "min_tokens"), ({"logit_bias": []}, "logit_bias"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"logprobs": 21}, "logprobs"),
    ({"logprobs": True}, "logprobs"), ({"logprobs": -1}, "logprobs"),
    ({"logit_bias": {"5": 101}}, "logit_bias"), ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias")])
def test_payload_refuses_sampling_fields_out_of_bounds_naming_them(sampling, needle):
    with pytest.raises(UsageError, match=needle):
        _payload(sampling=sampling)


def test_each_instance_gets_its_share_of_min_tokens():
    from dualpath.engines.vllm.decode import rest_sampling
    from dualpath.engines.vllm.prefill import first_token_sampling

    s = {"min_tokens": 5, "top_k": 3}
    assert first_token_sampling(s) == {"min_tokens": 1, "top_k": 3}
    assert rest_sampling(s, 1) == {"min_tokens": 4, "top_k": 3}
    assert rest_sampling({"min_tokens": 1}, 1) == {"min_tokens": 0}
    assert first_token_sampling({"top_k": 3}) == {"top_k": 3}


def test_top_logprobs_on_the_wire_are_bounded():
    from dualpath.paths.peers import MAX_TOP, top_from_pb, top_pb
    from dualpath.v1 import node_pb2

    t = ((5, 7), (-0.5, -1.25))
    assert top_from_pb(top_pb(t)) == t
    with pytest.raises(UsageError, match="top logprobs"):
        top_from_pb(node_pb2.TopLogprobs(token_ids=[1, 2], logprobs=[0.0]))
    with pytest.raises(UsageError, match="top logprobs"):
        top_from_pb(node_pb2.TopLogprobs(token_ids=list(range(MAX_TOP + 1)),
                                         logprobs=[0.0] * (MAX_TOP + 1)))


def test_an_instances_top_logprobs_are_read_by_token_id_in_its_order():
    from dualpath.engines.vllm.instance import _top

    assert _top({"token_id:7": -0.1, "token_id:3": -2.5}) == ((7, 3), (-0.1, -2.5))
    for bad in ({"hello": -1.0}, None, {f"token_id:{i}": 0.0 for i in range(22)}):
        with pytest.raises(ValueError):
            _top(bad)


# ------------------------------------------------------------------ plans: pure, immutable, one per attempt and side

def _prefill(prompt: int, local: int, remote: int) -> PrefillPlan:
    ids = np.arange(prompt, dtype=np.int32)
    return PrefillPlan("r", prompt, T, tuple(block_spans(ids, T)), local, remote, ids)


def test_a_prefill_plan_names_the_stored_blocks_and_the_partial_tail_apart():
    p = _prefill(10, 1, 1)                 # blocks [0,4) [4,8) full, [8,10) partial
    assert len(p.keys) == 3 and p.full_keys == p.keys[:2] and p.tail_keys == p.keys[2:]
    assert (p.read_tokens, p.decode_read_tokens, p.hit_blocks) == (4, 4, 2)
    whole = _prefill(8, 2, 0)
    assert whole.tail_keys == [] and whole.full_keys == whole.keys


def test_a_prefill_plan_is_never_edited_and_never_grows():
    p = _prefill(13, 2, 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.local = 0
    q = p.with_parts(0, 3)
    assert (p.local, p.remote, q.local, q.remote) == (2, 1, 0, 3) and q.keys == p.keys
    for parts in [(3, 1), (-1, 1), (0, 4)]:
        with pytest.raises(ValueError, match="exceed the planned hit of 3 blocks"):
            p.with_parts(*parts)


def _spans(blocks: int):
    return block_spans(np.arange(blocks * T, dtype=np.int32), T)


def test_a_decode_plan_keeps_one_block_for_the_prefill_node_to_send():
    spans = _spans(3)
    p = decode_plan("r", 2, 12, T, spans, True, held=9, read_tokens=0)
    assert (p.held, p.base, p.slots, p.attempt) == (2, 2, 1, 2)   # the last block comes
    none = decode_plan("r", 1, 12, T, spans, True, held=0, read_tokens=0)
    assert (none.held, none.base, none.slots) == (0, 0, 3)


def test_a_decode_plan_that_reads_for_the_prefill_node_slots_every_block():
    # Its reads land in its own slots, held by its instance or not (node.proto).
    p = decode_plan("r", 1, 12, T, _spans(3), True, held=2, read_tokens=2 * T)
    assert (p.held, p.reads, p.base, p.slots) == (2, 2, 0, 3)


def test_an_oracle_decode_plan_reserves_nothing_and_holds_nothing():
    p = decode_plan("r", 1, 12, T, _spans(3), False, held=2, read_tokens=0)
    assert (p.held, p.slots) == (0, 0)
    with pytest.raises(ValueError, match="oracle request holds no blocks"):
        dataclasses.replace(p, held=1)
    with pytest.raises(ValueError, match="one at least must come from the PE"):
        dataclasses.replace(p, moves_kv=True, held=3)
