"""KvPlacement <-> its protobuf form (dualpath.v1.KvPlacementInfo), with bounds.

The one place a placement crosses a process boundary: a vLLM worker describing its KV
tensors to its node daemon, the daemon describing its DRAM buffer back. Everything a
peer sends is checked here before it is used to compute offsets (sizes bounded, every
segment inside its unit, every unit inside its region's stated span).
"""

from __future__ import annotations

from dualpath.errors import UsageError
from dualpath.kv.placement import KvFormat, KvPlacement
from dualpath.v1 import kv_pb2

MAX_LAYERS = 1024
MAX_SEGMENTS = 4096
MAX_UNITS = 1 << 24
MAX_UNIT_TOKENS = 1 << 16


def to_pb(p: KvPlacement) -> kv_pb2.KvPlacementInfo:
    f = p.fmt
    return kv_pb2.KvPlacementInfo(
        layers=f.layers, unit_tokens=f.unit_tokens, row_bytes=list(f.row_bytes),
        units_per_block=f.units, layer_regions=list(p.layer_regions),
        plane_bases=[kv_pb2.PlaneBases(offsets_bytes=list(b)) for b in p.plane_bases],
        segment_planes=list(p.segment_planes), segment_offsets_bytes=list(p.segment_offsets),
        unit_stride_bytes=p.unit_stride, num_units=p.num_units, group=p.group,
        group_stride_bytes=p.group_stride)


def from_pb(m: kv_pb2.KvPlacementInfo, what: str = "placement") -> KvPlacement:
    """Decode and bound a peer's placement; UsageError names what is wrong."""
    if not 1 <= m.layers <= MAX_LAYERS:
        raise UsageError(f"{what}: layers must be 1..{MAX_LAYERS}, got {m.layers}")
    if not 1 <= m.unit_tokens <= MAX_UNIT_TOKENS:
        raise UsageError(f"{what}: unit_tokens must be 1..{MAX_UNIT_TOKENS}")
    if not 1 <= len(m.row_bytes) <= MAX_SEGMENTS:
        raise UsageError(f"{what}: 1..{MAX_SEGMENTS} segments allowed, got {len(m.row_bytes)}")
    if not 1 <= m.num_units <= MAX_UNITS:
        raise UsageError(f"{what}: num_units must be 1..{MAX_UNITS}, got {m.num_units}")
    if not 1 <= m.units_per_block <= 64 or not 1 <= m.group <= 64:
        raise UsageError(f"{what}: units_per_block and group must be 1..64")
    fmt = KvFormat(m.layers, m.unit_tokens, tuple(m.row_bytes), m.units_per_block)
    p = KvPlacement(fmt, tuple(m.layer_regions),
                    tuple(tuple(b.offsets_bytes) for b in m.plane_bases),
                    tuple(m.segment_planes), tuple(m.segment_offsets_bytes),
                    m.unit_stride_bytes, m.num_units, group=m.group,
                    group_stride=m.group_stride_bytes)
    for s, (off, row) in enumerate(zip(p.segment_offsets, fmt.row_bytes)):
        if off + row * fmt.unit_tokens > max(p.unit_stride, fmt.unit_bytes):
            raise UsageError(f"{what}: segment {s} ends past its unit")
    return p


def span(p: KvPlacement, layer: int) -> tuple[int, int]:
    """The lowest and one-past-highest byte offset layer ``layer`` may touch in its region
    (for checking a placement against the region it names)."""
    lo = min(p.plane_bases[layer])
    last = p.unit_offset(p.num_units - 1)
    hi = max(p.plane_bases[layer]) + last + max(
        o + r * p.fmt.unit_tokens for o, r in zip(p.segment_offsets, p.fmt.row_bytes))
    return lo, hi
