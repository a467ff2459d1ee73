"""Synthetic KV (stands in for the model's output): deterministic, addressable, verified."""

import numpy as np
import pytest

from dualpath.kv.layout import BlockLayout
from dualpath.kv.prefix import block_keys
from dualpath.kv.synth import LABEL, SyntheticKV, SyntheticMismatch, layer_seed

LAY = BlockLayout(4, 8, 48)
K1, K2 = block_keys(list(range(16)), 8)


def _splitmix(x: int) -> int:
    # SplitMix64 finaliser, written out from Steele, Lea & Flood (2014) as a cross-check.
    m = (1 << 64) - 1
    x &= m
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & m
    return x ^ (x >> 31)


def test_words_are_splitmix_of_seed_plus_counter():
    block = SyntheticKV(LAY).full_block(K1)
    words = block[2].reshape(-1).view("<u8")
    seed = layer_seed(K1, 2)
    assert [int(w) for w in words[:3]] == [_splitmix(seed + i) for i in range(3)]


def test_deterministic_and_distinct_per_key_and_layer():
    s = SyntheticKV(LAY)
    a, b = s.full_block(K1), s.full_block(K1)
    assert np.array_equal(a, b)
    assert not np.array_equal(a, s.full_block(K2))
    assert not np.array_equal(a[0], a[1])


def test_token_ranges_are_slices_of_the_full_block():
    s = SyntheticKV(LAY)
    full = s.full_block(K1)
    part = np.empty(3 * LAY.token_bytes, np.uint8)
    s.fill_layer(part, K1, layer=1, token_start=5)
    assert np.array_equal(part, full[1, 5:8].reshape(-1))
    grown = np.zeros(LAY.full_shape, np.uint8)
    s.fill_tokens(grown, K1, 0, 3)
    s.fill_tokens(grown, K1, 3, 8)
    assert np.array_equal(grown, full)


def test_verifier_names_the_first_wrong_byte():
    s = SyntheticKV(LAY)
    full = s.full_block(K1)
    assert s.verify_full(full, K1) is None
    full[2, 6, 11] ^= 0x40
    full[3, 0, 0] ^= 0x01                    # a later error: not the first
    m = s.verify_full(full, K1)
    assert (m.layer, m.token, m.token_byte) == (2, 6, 11)
    assert m.offset == 2 * LAY.layer_bytes + 6 * 48 + 11
    assert m.got == m.expected ^ 0x40
    assert LABEL in str(m)
    with pytest.raises(SyntheticMismatch):
        s.check_full(full, K1)
    assert s.verify_full(s.full_block(K1), K2) is not None   # right bytes, wrong block


def test_geometry_that_is_not_whole_words():
    lay = BlockLayout(3, 5, 13)              # 13-byte tokens: the byte-wise slow path
    s = SyntheticKV(lay)
    full = s.full_block(K1)
    part = np.empty(2 * 13, np.uint8)
    s.fill_layer(part, K1, 1, token_start=2)
    assert np.array_equal(part, full[1, 2:4].reshape(-1))
    assert s.verify_layer(part, K1, 1, token_start=2) is None
    part[17] ^= 1
    m = s.verify_layer(part, K1, 1, token_start=2)
    assert (m.token, m.token_byte, m.offset) == (3, 4, 17)
