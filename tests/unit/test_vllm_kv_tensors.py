"""vLLM's KV tensors as a KvPlacement (dualpath/vllm/kv_tensors.py), checked against the
tensors' own meaning: moving block b of layer l through the placement's runs must give
the engine's in-block order (per head K rows then V rows on the CPU backend; K then V
planes for NHD; per plane and head for HND), read from the tensors by indexing."""

import numpy as np
import pytest
import torch

from dualpath.errors import UsageError
from dualpath.kv.placement import KvPlacement, runs
from dualpath.vllm.kv_tensors import describe_kv_caches

L, NB, H, B, D = 3, 5, 2, 8, 4


def _full_block_bytes(kv, layer: int, block: int) -> bytes:
    """Layer ``layer`` of engine block ``block`` moved into a Full Block slot."""
    p = kv.placement
    buf = KvPlacement.full_blocks(p.fmt, "buf", p.fmt.layers * p.fmt.unit_bytes, 1)
    mem = {r.name: np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * r.length)
                                         .from_address(r.addr)) for r in kv.ranges}
    out = np.zeros(p.fmt.layers * p.fmt.unit_bytes, np.uint8)
    for r in runs(p, [block], buf, [0], layer, 0, B):
        out[r.dst_offset:r.dst_offset + r.length] = \
            mem[r.src_region][r.src_offset:r.src_offset + r.length]
    lb = p.fmt.unit_bytes
    return out[layer * lb:(layer + 1) * lb].tobytes()


def test_cpu_attn_layout_is_heads_then_k_and_v_rows():
    big = torch.randn(L, NB, H, B, 2 * D)              # one allocation, per-layer views
    caches = {f"model.layers.{i}.self_attn.attn": big[i] for i in range(L)}
    kv = describe_kv_caches(caches, B, D, H)
    assert kv.layout == "cpu" and len(kv.ranges) == 1 and kv.dtype == "float32"
    assert kv.layer_names == list(caches)
    for layer, block in ((0, 0), (2, 3), (1, 4)):
        t = big[layer].view(NB, H, 2 * B, D)           # how the backend reads it
        want = b"".join(t[block, h, :B].numpy().tobytes() + t[block, h, B:].numpy().tobytes()
                        for h in range(H))
        assert _full_block_bytes(kv, layer, block) == want
    assert len(runs(kv.placement, [1], kv.placement, [2], 0, 0, B)) == 1  # one whole run


@pytest.mark.parametrize("layout", ["nhd", "hnd"])
def test_gpu_style_layouts(layout):
    shape = (2, NB, B, H, D) if layout == "nhd" else (2, NB, H, B, D)
    caches = {f"l{i}": torch.randn(*shape) for i in range(L)}      # separate allocations
    kv = describe_kv_caches(caches, B, D, H)
    assert kv.layout == layout and len(kv.ranges) == L
    for layer, block in ((0, 1), (2, 4)):
        t = caches[f"l{layer}"]
        if layout == "nhd":
            want = t[0, block].numpy().tobytes() + t[1, block].numpy().tobytes()
        else:
            want = b"".join(t[p, block, h].numpy().tobytes() for p in (0, 1) for h in range(H))
        assert _full_block_bytes(kv, layer, block) == want


@pytest.mark.parametrize("shape", [(NB, B, 9), (NB, 1, B, 9)])
def test_the_mla_latent_is_one_row_per_token(shape):
    # vLLM's CPU MLA backend: a [blocks, (1,) block size, latent] tensor per layer (the
    # latent is kv_lora_rank + rope wide; 9 here); a block is its rows, token order.
    big = torch.randn(L, *shape)
    caches = {f"l{i}": big[i] for i in range(L)}
    kv = describe_kv_caches(caches, B, 9, 1, mla=True)
    assert kv.layout == "mla" and kv.placement.fmt.row_bytes == (9 * 4,)
    for layer, block in ((0, 0), (2, 3)):
        assert _full_block_bytes(kv, layer, block) == big[layer, block].numpy().tobytes()
    with pytest.raises(UsageError, match="MLA KV tensor layout"):
        describe_kv_caches({"a": torch.zeros(NB, 2, B, 9)}, B, 9, 1, mla=True)
    with pytest.raises(UsageError, match="is not one DualPath knows"):   # MLA unsaid
        describe_kv_caches(caches, B, 9, 1)


def test_unknown_or_mixed_layouts_are_refused_naming_the_shape():
    with pytest.raises(UsageError, match=r"\(5, 8, 4\) .* is not one DualPath knows"):
        describe_kv_caches({"a": torch.zeros(5, 8, 4)}, B, D, H)
    with pytest.raises(UsageError, match="needs every layer in one shape"):
        describe_kv_caches({"a": torch.zeros(NB, H, B, 2 * D),
                            "b": torch.zeros(NB + 1, H, B, 2 * D)}, B, D, H)
    with pytest.raises(UsageError, match="not contiguous"):
        describe_kv_caches({"a": torch.zeros(NB, H, 2 * D, B).transpose(2, 3)}, B, D, H)
    with pytest.raises(UsageError, match="no KV cache tensors"):
        describe_kv_caches({}, B, D, H)


def test_the_cpu_backend_stores_a_blocks_k_plane_element_major():
    """What vLLM's CPU kernel really writes (ops.cpu_attn_reshape_and_cache): a block's
    V plane holds token rows, but its K plane is [head_size, block_size], each element
    of every token together. So only whole blocks move as bytes: a range of a block's
    tokens is no range of its K plane (the P/D decode node's partial last block is
    moved whole, and before the forward: dualpath/vllm/worker_side.py)."""
    ops = pytest.importorskip("vllm._custom_ops")
    nb, h, b, d = 2, 2, 32, 32
    kv = torch.zeros(nb, h, b, 2 * d)
    kc, vc = kv.view(nb, h, 2 * b, d).chunk(2, dim=2)
    n = 3
    key = (torch.arange(n * h * d, dtype=torch.float32) + 1).view(n, h, d)
    ops.cpu_attn_reshape_and_cache(key, -key, kc, vc, torch.arange(b, b + n), "vec")
    k_plane = kv.view(nb, h, 2 * b, d)[1, 0, :b].reshape(-1)      # block 1, head 0
    v_plane = kv.view(nb, h, 2 * b, d)[1, 0, b:].reshape(-1)
    assert torch.equal(v_plane[d:2 * d], -key[1, 0])               # token 1: one row
    assert torch.equal(k_plane.view(d, b)[:, 1], key[1, 0])        # token 1: a column
    assert not torch.equal(k_plane[d:2 * d], key[1, 0])
