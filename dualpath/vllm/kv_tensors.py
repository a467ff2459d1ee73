"""vLLM's KV tensors as DualPath memory: ranges to register and a KvPlacement.

``register_kv_caches`` hands the connector one tensor per attention layer. Their shape
and strides say where each block's K and V rows are; this module turns them into the
:class:`~dualpath.kv.placement.KvPlacement` (a Layer Block in the engine's own in-block
order) and the distinct storages to register (on vLLM's CPU backend every layer is a
view into one allocation: one range).

Layouts understood (anything else is refused, naming the shape):

- CPU_ATTN: ``[num_blocks, kv_heads, block_size, 2 * head_size]``, read by the backend
  as ``[num_blocks, kv_heads, 2 * block_size, head_size]``: per head a K plane, then a V
  plane of ``block_size`` rows. Segments: (head, K), (head, V) of head-size "rows". The
  K plane's bytes are element-major, ``[head_size, block_size]`` (what the kernel
  writes; tests/unit/test_vllm_kv_tensors.py), so its "rows" are not tokens: DualPath
  moves vLLM CPU blocks whole, never a range of their tokens.
- Flash-attention style ``[2, num_blocks, block_size, kv_heads, head_size]`` (NHD): K and
  V planes of whole blocks; one segment each of kv_heads x head_size rows.
- ``[2, num_blocks, kv_heads, block_size, head_size]`` (HND): per plane and head.
- MLA (``mla=True``): ``[num_blocks, block_size, head_size]`` or
  ``[num_blocks, 1, block_size, head_size]``: one latent row per token (kv_lora_rank +
  the rope part; no K/V planes, no heads), the block's rows end to end: one segment.
  The same latent on every tensor-parallel rank.

Tensor parallelism: a rank's tensors hold its share of the KV heads (vLLM splits them in
order: rank r of t holds heads ``[r*H/t, (r+1)*H/t)``, or, with fewer heads than ranks,
one head that several ranks repeat). DualPath stores one canonical block whatever the TP
(the TP=1 segments: every head, the layout's own order), so KV saved at one TP loads at
any other: :func:`canonical_segments` says where each of a rank's segments sits in it
(CPU_ATTN and HND segments are per head; an NHD row holds all of a rank's heads, so NHD
is refused at TP > 1; MLA's latent is whole on every rank).
"""

from __future__ import annotations

from dataclasses import dataclass

from dualpath.errors import UsageError
from dualpath.kv.placement import KvFormat, KvPlacement
from dualpath.vllm.agent import MemoryRange


@dataclass(frozen=True)
class KvTensors:
    ranges: list[MemoryRange]
    placement: KvPlacement
    layer_names: list[str]          # index = DualPath layer
    layout: str                     # "cpu" | "nhd" | "hnd" | "mla"
    dtype: str
    # Tensor parallelism (canonical_segments): where each segment of ``placement`` sits
    # in the canonical block, and that block's row bytes; () = the placement's own.
    canonical: tuple[int, ...] = ()
    canonical_rows: tuple[int, ...] = ()


def rank_heads(rank: int, tp: int, total: int, local: int) -> list[int]:
    """The KV heads (of ``total``) that tensor-parallel rank ``rank`` of ``tp`` holds,
    ``local`` of them, in the order its tensors keep them."""
    if not 0 <= rank < tp:
        raise UsageError(f"tensor-parallel rank {rank} of {tp}")
    if local * tp == total:
        return [rank * local + h for h in range(local)]
    if local == 1 and total < tp and tp % total == 0:
        return [rank * total // tp]             # vLLM repeats each head over tp/total ranks
    if tp == 1 and local == total:
        return list(range(total))
    raise UsageError(f"rank {rank} of {tp} holds {local} KV heads of {total}: not a split "
                     "vLLM makes (heads divided evenly, or one head repeated on each rank)")


def canonical_segments(layout: str, heads: list[int], total: int, row: int,
                       nseg: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(index in the canonical block of each of a rank's ``nseg`` segments, the canonical
    block's row bytes); ((), ()) when the rank's segments are the canonical block."""
    if layout == "mla" or heads == list(range(total)):
        return (), ()
    if layout == "cpu":                 # (head, K), (head, V) per head
        idx = tuple(2 * g + p for g in heads for p in range(2))
    elif layout == "hnd":               # K of every head, then V of every head
        idx = tuple(p * total + g for p in range(2) for g in heads)
    else:
        raise UsageError(f"{layout.upper()} KV tensors keep all of a rank's heads in one row "
                         "per token: DualPath cannot place a rank's part of the canonical "
                         "block (tensor parallelism needs CPU_ATTN, HND or MLA)")
    if len(idx) != nseg:
        raise UsageError(f"{nseg} segments for heads {heads} in the {layout} layout")
    return idx, (row,) * (2 * total)


def describe_kv_caches(kv_caches: dict, block_size: int, head_size: int, num_kv_heads: int,
                       units_per_block: int = 1, *, mla: bool = False, tp_rank: int = 0,
                       tp_size: int = 1, total_kv_heads: int | None = None) -> KvTensors:
    """See the module docstring. ``kv_caches``: layer name -> tensor, in model order;
    ``num_kv_heads``: the heads this rank's tensors hold (of ``total_kv_heads``, default
    the same: TP=1); ``mla``: the model keeps a latent per token (vLLM's ``use_mla``)."""
    if not kv_caches:
        raise UsageError("no KV cache tensors to register")
    names = list(kv_caches)
    tensors = [kv_caches[n] for n in names]
    t0 = tensors[0]
    for n, t in zip(names, tensors):
        if tuple(t.shape) != tuple(t0.shape) or t.dtype != t0.dtype or \
                tuple(t.stride()) != tuple(t0.stride()) or t.device != t0.device:
            raise UsageError(f"KV tensor of {n} is {tuple(t.shape)} {t.dtype} on {t.device}; "
                             f"layer {names[0]} is {tuple(t0.shape)} {t0.dtype}: DualPath "
                             "needs every layer in one shape")
    e = t0.element_size()
    shape, stride = tuple(t0.shape), [s * e for s in t0.stride()]
    segs: list[tuple[int, int, int]]            # (plane, offset in block, row bytes)
    if mla:
        if shape[1:] not in ((block_size, head_size), (1, block_size, head_size)):
            raise UsageError(f"MLA KV tensor layout {shape} (block size {block_size}, latent "
                             f"{head_size}) is not [blocks, (1,) block size, latent]")
        layout, nblocks, unit_stride = "mla", shape[0], stride[0]
        row = head_size * e
        if stride[-1] != e or stride[-2] != row or stride[0] != block_size * row:
            raise UsageError(f"MLA KV tensor {shape} with strides {t0.stride()} is not "
                             "contiguous per block")
        planes = [[0] for _ in tensors]
        segs = [(0, 0, row)]
    elif len(shape) == 4 and shape[1] == num_kv_heads and shape[2] == block_size and \
            shape[3] == 2 * head_size:
        layout, nblocks, unit_stride = "cpu", shape[0], stride[0]
        row = head_size * e
        if stride[3] != e or stride[2] != 2 * row or stride[1] != block_size * 2 * row:
            raise UsageError(f"CPU KV tensor {shape} with strides {t0.stride()} is not "
                             "contiguous per block")
        planes = [[0] for _ in tensors]
        segs = [(0, h * stride[1] + p * block_size * row, row)
                for h in range(num_kv_heads) for p in range(2)]
    elif len(shape) == 5 and shape[0] == 2 and shape[2] == block_size and \
            shape[3] == num_kv_heads and shape[4] == head_size:
        layout, nblocks, unit_stride = "nhd", shape[1], stride[1]
        row = num_kv_heads * head_size * e
        if stride[4] != e or stride[3] != head_size * e or stride[2] != row:
            raise UsageError(f"NHD KV tensor {shape} with strides {t0.stride()} is not "
                             "contiguous per block")
        planes = [[0, stride[0]] for _ in tensors]
        segs = [(0, 0, row), (1, 0, row)]
    elif len(shape) == 5 and shape[0] == 2 and shape[2] == num_kv_heads and \
            shape[3] == block_size and shape[4] == head_size:
        layout, nblocks, unit_stride = "hnd", shape[1], stride[1]
        row = head_size * e
        if stride[4] != e or stride[3] != row or stride[2] != block_size * row:
            raise UsageError(f"HND KV tensor {shape} with strides {t0.stride()} is not "
                             "contiguous per block")
        planes = [[0, stride[0]] for _ in tensors]
        segs = [(p, h * stride[2], row) for p in range(2) for h in range(num_kv_heads)]
    else:
        raise UsageError(f"KV tensor layout {shape} (block size {block_size}, {num_kv_heads} "
                         f"KV heads, head size {head_size}) is not one DualPath knows "
                         "(CPU_ATTN, NHD or HND)")
    # One registered range per distinct storage; each layer's planes relative to it.
    ranges: dict[int, MemoryRange] = {}
    regions, bases = [], []
    gpu = t0.device.index if t0.device.type == "cuda" else None
    if t0.device.type not in ("cpu", "cuda"):
        raise UsageError(f"KV tensors on {t0.device} cannot be registered")
    for t, pl in zip(tensors, planes):
        st = t.untyped_storage()
        base = st.data_ptr()
        if base not in ranges:
            ranges[base] = MemoryRange(f"kv{len(ranges)}", base, st.nbytes(), gpu)
        r = ranges[base]
        regions.append(r.name)
        bases.append(tuple(t.data_ptr() - base + off for off in pl))
    fmt = KvFormat(len(tensors), block_size, tuple(r for _, _, r in segs), units_per_block)
    placement = KvPlacement(fmt, tuple(regions), tuple(bases), tuple(p for p, _, _ in segs),
                            tuple(o for _, o, _ in segs), unit_stride, nblocks)
    total = num_kv_heads if total_kv_heads is None else total_kv_heads
    canon, rows = ((), ()) if mla else canonical_segments(
        layout, rank_heads(tp_rank, tp_size, total, num_kv_heads), total, segs[0][2],
        len(segs))
    return KvTensors(list(ranges.values()), placement, names, layout,
                     str(t0.dtype).removeprefix("torch."), canon, rows)
