"""Synthetic KV: deterministic bytes that stand in for the model's output.

DualPath carries no model weights. Wherever a real engine would produce KV, we write
*synthetic KV*: bytes that are a pure function of (block key, layer, byte position), so
any path (storage -> buffer -> HBM -> buffer) can prove end to end that what arrived
is exactly what should be there, and say where the first wrong byte is.

Generator: counter-based. Layer ``l`` of block ``k`` is a stream of little-endian
uint64 words ``w_i = mix(seed(k, l) + i)`` where ``seed`` is BLAKE2b of the key and
layer and ``mix`` is the SplitMix64 finaliser (a bijection, so no two positions of one
layer block share a word). Being counter-based, any token range is generated on its
own, vectorised in numpy over cache-sized chunks (several GB/s on one core; see
bench/storage.py).
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass

import numpy as np

from dualpath.errors import DualPathError, UsageError
from dualpath.kv.layout import BlockLayout

LABEL = "synthetic KV (stands in for the model's output)"

_M1 = np.uint64(0xBF58476D1CE4E5B9)    # SplitMix64 finaliser constants (Steele et al.)
_M2 = np.uint64(0x94D049BB133111EB)
_S1, _S2, _S3 = np.uint64(30), np.uint64(27), np.uint64(31)
_CHUNK_WORDS = 16384                    # 128 KiB per pass: stays in L2 with its temporary
_COUNTER = np.arange(_CHUNK_WORDS, dtype=np.uint64)
_COUNTER.flags.writeable = False
_MASK64 = (1 << 64) - 1


class SyntheticMismatch(DualPathError):
    """A buffer does not hold the synthetic KV it should; ``.mismatch`` says where."""

    def __init__(self, mismatch: Mismatch):
        super().__init__(str(mismatch))
        self.mismatch = mismatch


@dataclass(frozen=True)
class Mismatch:
    """The first wrong byte of a checked range."""

    key: bytes
    layer: int
    token: int          # token position within the block
    token_byte: int     # byte within that token's KV for this layer
    offset: int         # byte offset within the checked buffer
    expected: int
    got: int

    def __str__(self) -> str:
        return (f"{LABEL} mismatch in block {self.key.hex()} layer {self.layer} token "
                f"{self.token} byte {self.token_byte} (buffer offset {self.offset}): "
                f"expected 0x{self.expected:02x}, got 0x{self.got:02x}")


def layer_seed(key: bytes, layer: int) -> int:
    """The 64-bit counter base of one Layer Block."""
    d = hashlib.blake2b(key, digest_size=8, person=b"dualpath-synth")
    d.update(layer.to_bytes(4, "little"))
    return int.from_bytes(d.digest(), "little")


class _Scratch(threading.local):
    def __init__(self) -> None:
        self.tmp = np.empty(_CHUNK_WORDS, dtype=np.uint64)
        self.exp = np.empty(_CHUNK_WORDS, dtype=np.uint64)


_scratch = _Scratch()


def _gen(out: np.ndarray, base: int, tmp: np.ndarray) -> None:
    """Write words ``mix(base + i)`` for i in range(out.size) into uint64 ``out``."""
    n = out.size
    for s in range(0, n, _CHUNK_WORDS):
        o = out[s:s + _CHUNK_WORDS]
        m = o.size
        t = tmp[:m]
        np.add(_COUNTER[:m], np.uint64((base + s) & _MASK64), out=o)
        np.right_shift(o, _S1, out=t)
        np.bitwise_xor(o, t, out=o)
        np.multiply(o, _M1, out=o)
        np.right_shift(o, _S2, out=t)
        np.bitwise_xor(o, t, out=o)
        np.multiply(o, _M2, out=o)
        np.right_shift(o, _S3, out=t)
        np.bitwise_xor(o, t, out=o)


def _pieces(nbytes: int, seed: int, byte_start: int):
    """Yield ``(pos, expected_bytes)`` covering ``nbytes`` of the stream from ``byte_start``.

    The slow path for geometries that are not whole words (views into scratch: use each
    piece before asking for the next).
    """
    tmp, exp = _scratch.tmp, _scratch.exp
    w0, lead = divmod(byte_start, 8)
    pos = 0
    while pos < nbytes:
        nwords = min(_CHUNK_WORDS, (lead + nbytes - pos + 7) // 8)
        _gen(exp[:nwords], seed + w0, tmp)
        src = exp[:nwords].view(np.uint8)[lead:lead + nbytes - pos]
        yield pos, src
        pos += src.size
        w0 += nwords
        lead = 0


def _flat(buf) -> np.ndarray:
    arr = buf if isinstance(buf, np.ndarray) else np.frombuffer(buf, dtype=np.uint8)
    if arr.dtype != np.uint8 or not arr.flags.c_contiguous:
        raise UsageError("synthetic KV works on contiguous uint8 buffers")
    return arr.reshape(-1)


class SyntheticKV:
    """Generator and verifier of synthetic KV for one block layout.

    Thread-safe: scratch space is per thread. Every method takes the block key (from
    dualpath.kv.prefix) and works on views, never allocating per call beyond scratch.
    """

    def __init__(self, layout: BlockLayout):
        self.layout = layout

    # --- generation -------------------------------------------------------------------
    def fill_layer(self, out, key: bytes, layer: int, token_start: int = 0) -> None:
        """Fill ``out`` with layer ``layer``'s KV of tokens ``token_start``.. (as many as fit)."""
        flat = _flat(out)
        self._check_range(layer, token_start, flat.size)
        self._fill_bytes(flat, layer_seed(key, layer), token_start * self.layout.token_bytes)

    def fill_full(self, out, key: bytes) -> None:
        """Fill a whole Full Block (``out`` is the block view or its flat bytes)."""
        flat = self._full_flat(out)
        lb = self.layout.layer_bytes
        for layer in range(self.layout.layers):
            self._fill_bytes(flat[layer * lb:(layer + 1) * lb], layer_seed(key, layer), 0)

    def fill_tokens(self, full: np.ndarray, key: bytes, start: int, stop: int) -> None:
        """Fill token positions ``start:stop`` of every layer of a ``[L, T, B]`` block view."""
        if full.shape != self.layout.full_shape:
            raise UsageError(f"expected a block view of shape {self.layout.full_shape}")
        for layer in range(self.layout.layers):
            self.fill_layer(full[layer, start:stop].reshape(-1), key, layer, start)

    def full_block(self, key: bytes) -> np.ndarray:
        """A new array holding the Full Block of ``key`` (tests and benches)."""
        out = np.empty(self.layout.full_shape, dtype=np.uint8)
        self.fill_full(out, key)
        return out

    # --- verification -----------------------------------------------------------------
    def verify_layer(self, buf, key: bytes, layer: int, token_start: int = 0) -> Mismatch | None:
        """``None`` when ``buf`` holds exactly layer ``layer``'s KV from ``token_start``."""
        flat = _flat(buf)
        self._check_range(layer, token_start, flat.size)
        bad = self._first_diff(flat, layer_seed(key, layer), token_start * self.layout.token_bytes)
        return None if bad is None else self._mismatch(key, layer, token_start, flat, bad)

    def verify_full(self, buf, key: bytes) -> Mismatch | None:
        """``None`` when ``buf`` holds exactly the Full Block of ``key``."""
        flat = self._full_flat(buf)
        lb = self.layout.layer_bytes
        for layer in range(self.layout.layers):
            part = flat[layer * lb:(layer + 1) * lb]
            bad = self._first_diff(part, layer_seed(key, layer), 0)
            if bad is not None:
                m = self._mismatch(key, layer, 0, part, bad)
                return Mismatch(m.key, m.layer, m.token, m.token_byte, layer * lb + bad,
                                m.expected, m.got)
        return None

    def check_full(self, buf, key: bytes) -> None:
        """Raise :class:`SyntheticMismatch` unless ``buf`` holds the Full Block of ``key``."""
        m = self.verify_full(buf, key)
        if m is not None:
            raise SyntheticMismatch(m)

    # --- internals --------------------------------------------------------------------
    def _check_range(self, layer: int, token_start: int, nbytes: int) -> None:
        lay = self.layout
        if not 0 <= layer < lay.layers:
            raise UsageError(f"layer {layer} out of range 0..{lay.layers - 1}")
        if token_start < 0 or token_start * lay.token_bytes + nbytes > lay.layer_bytes:
            raise UsageError(f"{nbytes} bytes from token {token_start} run past the layer "
                             f"block ({lay.layer_bytes} bytes)")

    def _full_flat(self, buf) -> np.ndarray:
        flat = _flat(buf)
        if flat.size != self.layout.full_bytes:
            raise UsageError(f"a full block is {self.layout.full_bytes} bytes, got {flat.size}")
        return flat

    @staticmethod
    def _fill_bytes(flat: np.ndarray, seed: int, byte_start: int) -> None:
        if byte_start % 8 == 0 and flat.size % 8 == 0:
            _gen(flat.view(np.uint64), seed + byte_start // 8, _scratch.tmp)
            return
        for pos, src in _pieces(flat.size, seed, byte_start):
            flat[pos:pos + src.size] = src

    @staticmethod
    def _first_diff(flat: np.ndarray, seed: int, byte_start: int) -> int | None:
        """Index of the first byte of ``flat`` that differs from the stream, or None."""
        tmp, exp = _scratch.tmp, _scratch.exp
        if byte_start % 8 == 0 and flat.size % 8 == 0:
            words = flat.view(np.uint64)
            base = seed + byte_start // 8
            for s in range(0, words.size, _CHUNK_WORDS):
                got = words[s:s + _CHUNK_WORDS]
                e = exp[:got.size]
                _gen(e, base + s, tmp)
                if not np.array_equal(got, e):
                    diff = np.flatnonzero(got.view(np.uint8) != e.view(np.uint8))
                    return s * 8 + int(diff[0])
            return None
        for pos, src in _pieces(flat.size, seed, byte_start):
            diff = np.flatnonzero(flat[pos:pos + src.size] != src)
            if diff.size:
                return pos + int(diff[0])
        return None

    def _mismatch(self, key: bytes, layer: int, token_start: int, flat: np.ndarray,
                  bad: int) -> Mismatch:
        tb = self.layout.token_bytes
        absolute = token_start * tb + bad
        expected = np.empty(1, dtype=np.uint8)
        self._fill_bytes(expected, layer_seed(key, layer), absolute)
        return Mismatch(key, layer, absolute // tb, absolute % tb, bad,
                        int(expected[0]), int(flat[bad]))
