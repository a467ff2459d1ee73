"""Block layout (paper A.5): Layer Blocks laid end to end are the Full Block, zero-copy."""

import mmap

import numpy as np
import pytest

from dualpath.errors import UsageError
from dualpath.kv.layout import BlockLayout, concat_layers, full_view, layer_view, layer_views
from dualpath.kv.profiles import get_profile


def test_layout_sizes_follow_the_profile():
    # ds660b: 61 layers x 656 B/token/layer (paper appendix), 64-token blocks (paper §4.1).
    lay = BlockLayout.of(get_profile("ds660b"))
    assert lay.full_shape == (61, 64, 656)
    assert lay.layer_bytes == 64 * 656
    assert lay.full_bytes == 61 * 64 * 656
    assert lay.layer_offset(3) == 3 * 64 * 656


def test_layer_blocks_to_full_block_to_layer_blocks_round_trip():
    lay = BlockLayout(5, 4, 24)
    rng = np.random.default_rng(7)
    layers = [rng.integers(0, 256, lay.layer_shape, dtype=np.uint8) for _ in range(lay.layers)]
    full = concat_layers(layers)
    assert full.shape == lay.full_shape
    # "no conversion": the full block's bytes are the layer blocks' bytes in order
    assert full.tobytes() == b"".join(lb.tobytes() for lb in layers)
    back = layer_views(full)
    assert len(back) == lay.layers
    for orig, view in zip(layers, back):
        assert view.shape == lay.layer_shape
        assert np.array_equal(orig, view)
        assert np.shares_memory(view, full)


def test_concat_into_a_buffer_slot_and_layer_views_are_zero_copy():
    lay = BlockLayout(3, 2, 8)
    region = mmap.mmap(-1, 4096)
    full = full_view(region, lay, offset=512)
    layers = [np.full(lay.layer_shape, i + 1, dtype=np.uint8) for i in range(lay.layers)]
    concat_layers(layers, out=full)
    assert region[512:512 + lay.layer_bytes] == b"\x01" * lay.layer_bytes
    lv = layer_view(full, 2)
    assert np.shares_memory(lv, full)
    lv[0, 1, 3] = 0xEE          # a write through a layer view lands in the region
    assert region[512 + lay.layer_offset(2) + 1 * 8 + 3] == 0xEE
    del full, lv
    region.close()


def test_layout_rejects_bad_input():
    lay = BlockLayout(2, 2, 2)
    with pytest.raises(UsageError):
        BlockLayout(0, 64, 656)
    with pytest.raises(UsageError, match="needs 8 bytes"):
        full_view(bytearray(7), lay)
    with pytest.raises(UsageError, match="out of range"):
        layer_view(np.zeros(lay.full_shape, np.uint8), 2)
    with pytest.raises(UsageError, match="leading 1"):
        concat_layers([np.zeros((2, 2, 2), np.uint8)])
