"""Prefix identity: chained block keys, trie semantics, lookup of leading hit tokens."""

import hashlib

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from dualpath.kv.prefix import ROOT_KEY, PrefixChain, PrefixIndex, block_keys, chain_key, lookup

BT = 4


def test_key_is_blake2b_of_parent_and_le_uint32_tokens():
    # Re-derived from the spec in dualpath/kv/prefix.py's docstring.
    tokens = [1, 2, 3, 70000]
    h = hashlib.blake2b(ROOT_KEY, digest_size=16, person=b"dualpath-kv-v1")
    h.update(np.array(tokens, dtype="<u4").tobytes())
    assert chain_key(ROOT_KEY, tokens) == h.digest()
    assert block_keys(tokens, 4) == [h.digest()]


def test_a_block_key_depends_on_every_earlier_token():
    a = list(range(12))
    b = a.copy()
    b[0] = 99                      # change in block 0: every key changes
    c = a.copy()
    c[9] = 99                      # change in block 2: blocks 0 and 1 keep their keys
    ka, kb, kc = (block_keys(x, BT) for x in (a, b, c))
    assert all(x != y for x, y in zip(ka, kb))
    assert ka[:2] == kc[:2] and ka[2] != kc[2]


def test_only_full_blocks_are_keyed():
    assert len(block_keys(list(range(11)), BT)) == 2
    assert block_keys([1, 2, 3], BT) == []


def test_lookup_counts_leading_hits_and_stops_at_the_first_hole():
    tokens = list(range(20))
    keys = block_keys(tokens, BT)           # 5 blocks
    stored = {keys[0], keys[1], keys[3]}    # block 2 missing: block 3 is unreachable
    assert lookup(stored, tokens, BT) == 2 * BT
    assert lookup(stored, tokens[:6], BT) == BT      # the partial tail never hits
    assert lookup(set(), tokens, BT) == 0


def test_index_is_a_trie_shared_by_common_prefixes():
    idx = PrefixIndex()
    base = list(range(8))
    idx.add_prompt(base + [100, 101, 102, 103], BT)
    other = base + [200, 201, 202, 203]
    assert lookup(idx, other, BT) == 8          # shares the two blocks of `base`
    assert len(idx) == 3
    assert idx.remove(block_keys(base, BT)[1]) == 2   # the node and its child
    assert lookup(idx, other, BT) == 4


@given(st.lists(st.integers(0, 2**32 - 1), max_size=40), st.integers(0, 40))
def test_incremental_chain_matches_block_keys(tokens, split):
    chain = PrefixChain.for_prompt(tokens[:split], BT)
    done = chain.extend(tokens[split:])
    expected = block_keys(tokens, BT)
    assert [k for k, _ in done] == expected[len(tokens[:split]) // BT:]
    assert chain.blocks == len(expected)
    assert chain.pending_tokens == len(tokens) % BT
    assert all(ids == tokens[i * BT:(i + 1) * BT]
               for i, (_, ids) in enumerate(done, start=len(tokens[:split]) // BT))
