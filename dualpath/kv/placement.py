"""Where KV bytes live in one memory, and the WRITE runs between two memories (pure code).

DualPath moves KV in one byte format everywhere (storage, DRAM buffers, the wire): a Full
Block is its Layer Blocks end to end (dualpath/kv/layout.py), and a Layer Block is the
*engine's own in-block order*: the ``units`` (engine blocks) it spans, each being its
segments end to end, each segment ``unit_tokens`` rows of ``row_bytes``. A segment is
whatever the engine keeps contiguous per token: on vLLM's CPU backend one (head, K or V)
plane of a block (rows of head_size elements), on a GPU NHD layout a whole K or V plane
(rows of heads x head_size elements), in the emulated engine the token's whole KV.

A :class:`KvPlacement` says where those segments sit in one memory: for each layer, a
region and one base offset per plane; for each segment, its plane and offset inside a
unit; units at ``unit_stride`` (grouped ``group`` at a time at ``group_stride`` for
DRAM buffers, whose slots hold one Full Block of ``group`` units per layer).
:func:`runs` turns "layer l, tokens [t0, t1) of units U on this side and V on that side"
into the few contiguous ``(src_offset, dst_offset, length)`` runs a WRITE needs, merging
neighbours that are contiguous on both sides (a whole vLLM CPU block is one run).

Two placements can exchange KV when their :class:`KvFormat` is equal: same unit tokens,
same segment row sizes in the same order, same layer count.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dualpath._native import ffi, lib
from dualpath.errors import UsageError
from dualpath.kv.layout import BlockLayout


@dataclass(frozen=True)
class KvFormat:
    """The byte format every side agrees on: ``layers`` Layer Blocks per Full Block, each
    of ``units`` engine blocks of ``unit_tokens`` tokens, each unit ``row_bytes``
    segments end to end."""

    layers: int
    unit_tokens: int
    row_bytes: tuple[int, ...]
    units: int = 1                  # engine blocks per DualPath block

    def __post_init__(self) -> None:
        if self.layers < 1 or self.unit_tokens < 1 or self.units < 1 or not self.row_bytes:
            raise UsageError(f"KV format needs layers, unit_tokens, units >= 1 and at least "
                             f"one segment, got {self}")
        if any(r < 1 for r in self.row_bytes):
            raise UsageError(f"KV format: segment row bytes must be >= 1, got {self.row_bytes}")
        object.__setattr__(self, "_rows", np.asarray(self.row_bytes, np.uint64))

    @property
    def token_bytes(self) -> int:
        """KV bytes of one token in one layer."""
        return sum(self.row_bytes)

    @property
    def unit_bytes(self) -> int:
        """Bytes of one engine block of one layer."""
        return self.unit_tokens * self.token_bytes

    @property
    def block_tokens(self) -> int:
        """Tokens per DualPath block."""
        return self.units * self.unit_tokens

    def block_layout(self) -> BlockLayout:
        """The Full Block geometry the store and the DRAM pools use."""
        return BlockLayout(self.layers, self.block_tokens, self.token_bytes)

    def signature(self) -> str:
        """A short text naming the format (logs, store namespaces)."""
        rows = "+".join(str(r) for r in self.row_bytes)
        return f"L{self.layers}xU{self.units}x{self.unit_tokens}t[{rows}]"

    @classmethod
    def flat(cls, layout: BlockLayout) -> KvFormat:
        """One segment holding a token's whole KV (the emulated engine's format)."""
        return cls(layout.layers, layout.tokens, (layout.token_bytes,))


@dataclass(frozen=True)
class Run:
    """One contiguous WRITE: ``length`` bytes from ``src_region+src_offset`` to
    ``dst_region+dst_offset``."""

    src_region: str
    dst_region: str
    src_offset: int
    dst_offset: int
    length: int


@dataclass(frozen=True)
class KvPlacement:
    """Where the units of one memory sit (see the module docstring).

    ``layer_regions[l]`` names layer ``l``'s registered region and ``plane_bases[l]`` the
    base offset of each of its planes; segment ``s`` of a unit sits at
    ``plane_bases[l][segment_planes[s]] + unit_offset(u) + segment_offsets[s]``.
    """

    fmt: KvFormat
    layer_regions: tuple[str, ...]
    plane_bases: tuple[tuple[int, ...], ...]
    segment_planes: tuple[int, ...]
    segment_offsets: tuple[int, ...]
    unit_stride: int
    num_units: int
    group: int = 1                  # units per group (a Full Block slot); 1 = ungrouped
    group_stride: int = 0           # bytes between groups; 0 = unit_stride * group

    def __post_init__(self) -> None:
        f = self.fmt
        n = len(f.row_bytes)
        if len(self.layer_regions) != f.layers or len(self.plane_bases) != f.layers:
            raise UsageError(f"placement: {len(self.layer_regions)} regions and "
                             f"{len(self.plane_bases)} plane bases for {f.layers} layers")
        if len(self.segment_planes) != n or len(self.segment_offsets) != n:
            raise UsageError(f"placement: {n} segments need a plane and an offset each")
        for s, p in enumerate(self.segment_planes):
            if any(not 0 <= p < len(b) for b in self.plane_bases):
                raise UsageError(f"placement: segment {s} uses plane {p}, which some layer "
                                 "does not have")
        if self.num_units < 1 or self.unit_stride < 0 or self.group < 1:
            raise UsageError("placement: num_units, group >= 1 and unit_stride >= 0 needed")
        if not self.group_stride:
            object.__setattr__(self, "group_stride", self.unit_stride * self.group)
        # Per layer and segment: its plane base plus its offset (dp_layer_runs' bases).
        bases = np.asarray([[b[p] + o for p, o in zip(self.segment_planes,
                                                      self.segment_offsets)]
                            for b in self.plane_bases], np.int64)
        object.__setattr__(self, "_bases", bases)

    def unit_offset(self, u: int) -> int:
        """Byte offset of unit ``u`` from its plane base."""
        if not 0 <= u < self.num_units:
            raise UsageError(f"unit {u} out of range 0..{self.num_units - 1}")
        g, i = divmod(u, self.group)
        return g * self.group_stride + i * self.unit_stride

    def segment_offset(self, layer: int, u: int, s: int) -> int:
        return (self.plane_bases[layer][self.segment_planes[s]] + self.unit_offset(u)
                + self.segment_offsets[s])

    # -------------------------------------------------------------- constructors

    @classmethod
    def full_blocks(cls, fmt: KvFormat, region: str, slot_stride: int, slots: int,
                    base: int = 0) -> KvPlacement:
        """DualPath's own Full Block slots (PE/DE buffers, the emulated engine's HBM):
        slot ``i`` holds units ``i*units .. i*units+units-1``; layer ``l`` at ``l*LB``."""
        lb = fmt.units * fmt.unit_bytes
        if slot_stride < fmt.layers * lb:
            raise UsageError(f"slot stride {slot_stride} < a Full Block ({fmt.layers * lb})")
        return cls(fmt, (region,) * fmt.layers,
                   tuple((base + layer * lb,) for layer in range(fmt.layers)),
                   (0,) * len(fmt.row_bytes), _row_offsets(fmt), fmt.unit_bytes,
                   slots * fmt.units, group=fmt.units, group_stride=slot_stride)

    @classmethod
    def layer_slots(cls, fmt: KvFormat, region: str, slot_stride: int, slots: int
                    ) -> KvPlacement:
        """Slots of one Layer Block each (the emulated PE's HBM, allocated a layer at a
        time): every layer's planes start at 0, so which slots hold a request's layer
        is the caller's choice of units, layer by layer (slot ``i`` holds units
        ``i*units .. i*units+units-1`` of whatever layer it holds)."""
        lb = fmt.units * fmt.unit_bytes
        if slot_stride < lb:
            raise UsageError(f"slot stride {slot_stride} < a Layer Block ({lb})")
        return cls(fmt, (region,) * fmt.layers, ((0,),) * fmt.layers,
                   (0,) * len(fmt.row_bytes), _row_offsets(fmt), fmt.unit_bytes,
                   slots * fmt.units, group=fmt.units, group_stride=slot_stride)

    def select(self, segments: Sequence[int]) -> KvPlacement:
        """This placement's segments ``segments``, in that order, as a placement of their
        own (its format holds just those rows): a tensor-parallel rank's part of each
        canonical block, which moves to and from that rank's KV like any placement of
        the rank's format."""
        n = len(self.fmt.row_bytes)
        if not segments or any(not 0 <= s < n for s in segments):
            raise UsageError(f"segments {list(segments)} are not a selection of {n}")
        fmt = KvFormat(self.fmt.layers, self.fmt.unit_tokens,
                       tuple(self.fmt.row_bytes[s] for s in segments), self.fmt.units)
        return KvPlacement(fmt, self.layer_regions, self.plane_bases,
                           tuple(self.segment_planes[s] for s in segments),
                           tuple(self.segment_offsets[s] for s in segments),
                           self.unit_stride, self.num_units, self.group, self.group_stride)

    def units_of_slots(self, slots: Sequence[int]) -> list[int]:
        """The unit ids of Full Block slots ``slots`` (a :meth:`full_blocks` placement)."""
        k = self.group
        return [s * k + j for s in slots for j in range(k)]


def _row_offsets(fmt: KvFormat) -> tuple[int, ...]:
    """Each segment's offset inside a unit of DualPath's own slots: segments end to end."""
    offs, acc = [], 0
    for r in fmt.row_bytes:
        offs.append(acc)
        acc += r * fmt.unit_tokens
    return tuple(offs)


def _check_layer_move(src: KvPlacement, src_units: Sequence[int], dst: KvPlacement,
                      dst_units: Sequence[int], layer: int, first_token: int,
                      stop_token: int) -> KvFormat:
    """The arguments of :func:`runs` / :func:`run_arrays` checked; their common format."""
    if src.fmt != dst.fmt:
        raise UsageError(f"KV formats differ: {src.fmt.signature()} vs {dst.fmt.signature()}")
    f = src.fmt
    if not 0 <= layer < f.layers:
        raise UsageError(f"layer {layer} out of range 0..{f.layers - 1}")
    if first_token < 0 or stop_token > f.unit_tokens * min(len(src_units), len(dst_units)):
        raise UsageError(f"tokens [{first_token}, {stop_token}) exceed the "
                         f"{min(len(src_units), len(dst_units))} units given")
    return f


def runs(src: KvPlacement, src_units: Sequence[int], dst: KvPlacement,
         dst_units: Sequence[int], layer: int, first_token: int, stop_token: int
         ) -> list[Run]:
    """The WRITE runs moving layer ``layer``'s KV of tokens ``[first_token, stop_token)``
    from ``src`` to ``dst``. ``src_units[i]`` / ``dst_units[i]`` hold the request's tokens
    ``[i*T, (i+1)*T)`` (T = unit tokens) on each side. Contiguous neighbours are merged."""
    f = _check_layer_move(src, src_units, dst, dst_units, layer, first_token, stop_token)
    T = f.unit_tokens
    out: list[Run] = []
    sreg, dreg = src.layer_regions[layer], dst.layer_regions[layer]
    t = first_token
    while t < stop_token:
        i, t0 = divmod(t, T)
        t1 = min(T, t0 + stop_token - t)
        su, du = src_units[i], dst_units[i]
        for s, row in enumerate(f.row_bytes):
            so = src.segment_offset(layer, su, s) + t0 * row
            do = dst.segment_offset(layer, du, s) + t0 * row
            n = (t1 - t0) * row
            last = out[-1] if out else None
            if (last is not None and last.src_offset + last.length == so
                    and last.dst_offset + last.length == do):
                out[-1] = Run(sreg, dreg, last.src_offset, last.dst_offset, last.length + n)
            else:
                out.append(Run(sreg, dreg, so, do, n))
        t += t1 - t0
    return out


def run_arrays(src: KvPlacement, src_units: Sequence[int], dst: KvPlacement,
               dst_units: Sequence[int], layer: int, first_token: int, stop_token: int
               ) -> tuple[str, str, np.ndarray]:
    """:func:`runs` as arrays, in one C call whatever the number of blocks
    (csrc/runs.c dp_layer_runs): (source region, target region, uint64 rows of
    (src_offset, dst_offset, length)), the same runs in the same order (a layer's runs
    all go between one pair of regions)."""
    f = _check_layer_move(src, src_units, dst, dst_units, layer, first_token, stop_token)
    T = f.unit_tokens
    sreg, dreg = src.layer_regions[layer], dst.layer_regions[layer]
    if stop_token <= first_token:
        return sreg, dreg, np.zeros((0, 3), np.uint64)
    i0, i1 = first_token // T, (stop_token - 1) // T + 1
    su = np.ascontiguousarray(src_units[i0:i1], np.int64)
    du = np.ascontiguousarray(dst_units[i0:i1], np.int64)
    nseg = len(f.row_bytes)
    out = np.empty(((i1 - i0) * nseg, 3), np.uint64)
    n = lib.dp_layer_runs(_side(src, su), _side(dst, du), ffi.from_buffer("uint64_t[]", f._rows),
                          nseg, layer, T, first_token, stop_token,
                          ffi.from_buffer("uint64_t[]", out), len(out))
    if n == -errno.ERANGE:
        pl = dst if out[0, 1] else src
        raise UsageError(f"unit {out[0, 0].astype(np.int64)} out of range "
                         f"0..{pl.num_units - 1}")
    if n < 0:                                   # not expected of checked arguments
        raise UsageError(f"computing layer {layer}'s runs: {os.strerror(-n)}")
    return sreg, dreg, out[:n]


def _side(pl: KvPlacement, units: np.ndarray):
    """dp_layer_runs' view of one side: ``pl`` holding ``units``."""
    return ffi.new("struct dp_run_side *", (ffi.from_buffer("int64_t[]", units),
                                            ffi.from_buffer("int64_t[]", pl._bases),
                                            pl.unit_stride, pl.group, pl.group_stride,
                                            pl.num_units))


def _layer_shift(pl: KvPlacement, a: int, b: int) -> int | None:
    """How far every segment of layer ``b`` sits from the same segment of layer ``a`` in
    ``pl`` (one offset for all of them), or None when the planes move apart."""
    shifts = {pl.plane_bases[b][p] - pl.plane_bases[a][p] for p in set(pl.segment_planes)}
    return shifts.pop() if len(shifts) == 1 else None


class LayerMove:
    """One move's WRITE runs (:func:`run_arrays`), for any layer, over token ``spans``
    ``[lo, hi)`` (in order, empty ones skipped): the runs of a request's layers differ
    only where each placement puts the layer, so they are computed at the first layer
    asked and later layers' are those shifted, where both placements move every segment
    of a layer by one offset (the same runs then merge: contiguity on both sides is kept).
    Otherwise a layer's are computed anew. Each call returns an array of its own."""

    def __init__(self, src: KvPlacement, src_units: Sequence[int], dst: KvPlacement,
                 dst_units: Sequence[int], spans: Sequence[tuple[int, int]]):
        self.src, self.src_units, self.dst, self.dst_units = src, src_units, dst, dst_units
        self.spans = [(lo, hi) for lo, hi in spans if hi > lo]
        self._ref: tuple[int, np.ndarray] | None = None

    def _compute(self, layer: int) -> np.ndarray:
        parts = [run_arrays(self.src, self.src_units, self.dst, self.dst_units, layer,
                            lo, hi)[2] for lo, hi in self.spans]
        return np.concatenate(parts) if parts else np.zeros((0, 3), np.uint64)

    def rows(self, layer: int) -> tuple[str, str, np.ndarray]:
        """(source region, target region, uint64 rows) of layer ``layer``."""
        if not 0 <= layer < self.src.fmt.layers:
            raise UsageError(f"layer {layer} out of range 0..{self.src.fmt.layers - 1}")
        sreg, dreg = self.src.layer_regions[layer], self.dst.layer_regions[layer]
        if self._ref is None:
            rows = self._compute(layer)         # checks the move once
            self._ref = (layer, rows)
            return sreg, dreg, rows.copy()
        ref, rows = self._ref
        ds, dd = _layer_shift(self.src, ref, layer), _layer_shift(self.dst, ref, layer)
        if ds is None or dd is None:
            return sreg, dreg, self._compute(layer)
        out = rows.copy()
        if ds:
            out[:, 0] = (rows[:, 0].astype(np.int64) + ds).astype(np.uint64)
        if dd:
            out[:, 1] = (rows[:, 1].astype(np.int64) + dd).astype(np.uint64)
        return sreg, dreg, out
