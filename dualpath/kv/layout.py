"""Block layouts (paper appendix A.5): Layer Blocks and Full Blocks as byte tensors.

A Layer Block is ``[1, tokens, bytes]`` and a Full Block is ``[layers, tokens, bytes]``,
both ``uint8`` in C order, so the layer blocks of a block, laid end to end, *are* the
full block: storage I/O moves Full Blocks and the layerwise transfers move Layer Blocks
out of the same memory with no layout conversion. What the bytes of one token in one
layer mean (K/V split, scales) is the model's business; DualPath treats them as opaque.

Everything here is a view: a full block living in a registered buffer is viewed, never
copied, and its layer blocks are slices of that view (``np.shares_memory`` holds).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dualpath.errors import UsageError
from dualpath.kv.profiles import ModelProfile


@dataclass(frozen=True)
class BlockLayout:
    """The geometry of one block: ``layers`` x ``tokens`` x ``token_bytes``."""

    layers: int
    tokens: int
    token_bytes: int     # KV bytes of one token in one layer

    def __post_init__(self) -> None:
        for f in ("layers", "tokens", "token_bytes"):
            v = getattr(self, f)
            if not isinstance(v, int) or v <= 0:
                raise UsageError(f"block layout: {f} must be a positive int, got {v!r}")

    @classmethod
    def of(cls, profile: ModelProfile) -> BlockLayout:
        return cls(profile.layers, profile.block_tokens, profile.kv_bytes_per_token_layer)

    def one_layer(self) -> BlockLayout:
        """A Layer Block's geometry (slots allocated a layer at a time)."""
        return BlockLayout(1, self.tokens, self.token_bytes)

    @property
    def layer_bytes(self) -> int:
        """Bytes of one Layer Block."""
        return self.tokens * self.token_bytes

    @property
    def full_bytes(self) -> int:
        """Bytes of one Full Block."""
        return self.layers * self.layer_bytes

    @property
    def full_shape(self) -> tuple[int, int, int]:
        return (self.layers, self.tokens, self.token_bytes)

    @property
    def layer_shape(self) -> tuple[int, int, int]:
        return (1, self.tokens, self.token_bytes)

    def layer_offset(self, layer: int) -> int:
        """Byte offset of layer ``layer``'s Layer Block inside a Full Block."""
        if not 0 <= layer < self.layers:
            raise UsageError(f"layer {layer} out of range 0..{self.layers - 1}")
        return layer * self.layer_bytes


def full_view(buf, layout: BlockLayout, offset: int = 0) -> np.ndarray:
    """A zero-copy ``[layers, tokens, bytes]`` view of one Full Block inside ``buf``.

    ``buf`` is anything exporting a writable or read-only byte buffer (numpy array,
    memoryview, mmap, bytearray); ``offset`` is in bytes.
    """
    flat = _as_bytes(buf)
    end = offset + layout.full_bytes
    if offset < 0 or end > flat.size:
        raise UsageError(f"full block at offset {offset} needs {layout.full_bytes} bytes; "
                         f"buffer has {flat.size}")
    return flat[offset:end].reshape(layout.full_shape)


def layer_view(full: np.ndarray, layer: int) -> np.ndarray:
    """The ``[1, tokens, bytes]`` Layer Block ``layer`` of a Full Block view (zero-copy)."""
    if full.ndim != 3:
        raise UsageError(f"expected a [layers, tokens, bytes] full block, got shape {full.shape}")
    if not 0 <= layer < full.shape[0]:
        raise UsageError(f"layer {layer} out of range 0..{full.shape[0] - 1}")
    return full[layer:layer + 1]


def layer_views(full: np.ndarray) -> list[np.ndarray]:
    """Every Layer Block of a Full Block, in layer order, as views."""
    return [layer_view(full, i) for i in range(full.shape[0])]


def concat_layers(layers: Sequence[np.ndarray], out: np.ndarray | None = None) -> np.ndarray:
    """Lay Layer Blocks end to end into a Full Block (``out`` if given, else a new array).

    No conversion happens: the result's bytes are the layer blocks' bytes in order.
    """
    if not layers:
        raise UsageError("concat_layers needs at least one layer block")
    shape = layers[0].shape
    for i, lb in enumerate(layers):
        if lb.dtype != np.uint8 or lb.ndim != 3 or lb.shape[0] != 1 or lb.shape != shape:
            raise UsageError(f"layer block {i} has shape {lb.shape} {lb.dtype}; expected "
                             f"uint8 {shape} with a leading 1")
    return np.concatenate(layers, axis=0, out=out)


def _as_bytes(buf) -> np.ndarray:
    if isinstance(buf, np.ndarray):
        if buf.dtype != np.uint8 or not buf.flags.c_contiguous:
            raise UsageError(f"block buffer must be contiguous uint8, got {buf.dtype} "
                             f"contiguous={buf.flags.c_contiguous}")
        return buf.reshape(-1)
    return np.frombuffer(buf, dtype=np.uint8)
