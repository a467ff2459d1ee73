"""KV placements and the WRITE runs between them (dualpath/kv/placement.py).

The reference is a token-by-token copy: for every token, layer and segment, the row of
``row_bytes`` at its source place goes to its destination place. ``runs`` must move
exactly those bytes (no more, no fewer) in merged contiguous runs.
"""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dualpath.errors import UsageError
from dualpath.kv.placement import KvFormat, KvPlacement, LayerMove, run_arrays, runs


def _engine_placement(fmt: KvFormat, num_units: int, heads_outer: bool) -> KvPlacement:
    """An engine-like memory: one region per layer, units in engine order; segments
    placed in reverse order inside a unit (so the engine order differs from ours)."""
    n = len(fmt.row_bytes)
    offs, acc = [0] * n, 0
    for s in reversed(range(n)):
        offs[s] = acc
        acc += fmt.row_bytes[s] * fmt.unit_tokens
    stride = acc + (16 if heads_outer else 0)    # padding between units
    return KvPlacement(fmt, tuple(f"layer{i}" for i in range(fmt.layers)),
                       tuple((7 * i,) for i in range(fmt.layers)), (0,) * n, tuple(offs),
                       stride, num_units)


def _apply(rs, src_mem, dst_mem):
    for r in rs:
        dst_mem[r.dst_region][r.dst_offset:r.dst_offset + r.length] = \
            src_mem[r.src_region][r.src_offset:r.src_offset + r.length]


def _reference(src, su, dst, du, layer, t0, t1, src_mem, dst_mem):
    T = src.fmt.unit_tokens
    for t in range(t0, t1):
        i, k = divmod(t, T)
        for s, row in enumerate(src.fmt.row_bytes):
            so = src.segment_offset(layer, su[i], s) + k * row
            do = dst.segment_offset(layer, du[i], s) + k * row
            dst_mem[dst.layer_regions[layer]][do:do + row] = \
                src_mem[src.layer_regions[layer]][so:so + row]


@settings(max_examples=60, deadline=None)
@given(layers=st.integers(1, 3), unit_tokens=st.integers(1, 5),
       rows=st.lists(st.integers(1, 6), min_size=1, max_size=4), units=st.integers(1, 3),
       nblocks=st.integers(1, 3), data=st.data())
def test_runs_move_exactly_the_reference_bytes(layers, unit_tokens, rows, units, nblocks,
                                               data):
    fmt = KvFormat(layers, unit_tokens, tuple(rows), units)
    slots = data.draw(st.permutations(range(nblocks + 1)))[:nblocks]
    buf = KvPlacement.full_blocks(fmt, "buf", fmt.layers * units * fmt.unit_bytes + 8,
                                  nblocks + 1)
    eng = _engine_placement(fmt, nblocks * units + 4, data.draw(st.booleans()))
    eng_units = data.draw(st.permutations(range(eng.num_units)))[:nblocks * units]
    buf_units = buf.units_of_slots(slots)
    total = nblocks * fmt.block_tokens
    t0 = data.draw(st.integers(0, total - 1))
    t1 = data.draw(st.integers(t0 + 1, total))
    layer = data.draw(st.integers(0, layers - 1))
    rng = np.random.default_rng(0)
    src_mem = {"buf": rng.integers(0, 256, buf.num_units * fmt.unit_bytes * layers * 2 + 64,
                                   dtype=np.uint8)}
    size = eng.num_units * eng.unit_stride + 7 * layers + 64
    want = {f"layer{i}": np.zeros(size, np.uint8) for i in range(layers)}
    got = {k: v.copy() for k, v in want.items()}
    _reference(buf, buf_units, eng, eng_units, layer, t0, t1, src_mem, want)
    rs = runs(buf, buf_units, eng, eng_units, layer, t0, t1)
    for a, b, x, y in ((buf, buf_units, eng, eng_units), (eng, eng_units, buf, buf_units)):
        # The C runs (the transfer path's, csrc/runs.c) are the same runs, in order.
        sreg, dreg, arr = run_arrays(a, b, x, y, layer, t0, t1)
        want_rs = runs(a, b, x, y, layer, t0, t1)
        assert {(r.src_region, r.dst_region) for r in want_rs} == {(sreg, dreg)}
        assert arr.dtype == np.uint64 and arr.shape == (len(want_rs), 3)
        assert arr.tolist() == [[r.src_offset, r.dst_offset, r.length] for r in want_rs]
    _apply(rs, src_mem, got)
    for k, v in want.items():
        assert np.array_equal(got[k], v), k
    assert sum(r.length for r in rs) == (t1 - t0) * fmt.token_bytes
    # and back: engine -> buffer restores the same bytes
    back = {"buf": np.zeros_like(src_mem["buf"])}
    _apply(runs(eng, eng_units, buf, buf_units, layer, t0, t1), got, back)
    ref_back = {"buf": np.zeros_like(src_mem["buf"])}
    _reference(eng, eng_units, buf, buf_units, layer, t0, t1, want, ref_back)
    assert np.array_equal(back["buf"], ref_back["buf"])


def test_a_whole_contiguous_unit_is_one_run():
    # vLLM's CPU layout: a block of one layer is [heads, K|V, tokens, head bytes],
    # contiguous, so a whole block moves as a single run however many segments it has.
    fmt = KvFormat(2, 4, (8,) * 6)              # 3 heads x (K, V), 8-byte rows
    unit = 4 * 8 * 6
    eng = KvPlacement(fmt, ("kv", "kv"), ((0,), (10 * unit,)), (0,) * 6,
                      tuple(i * 32 for i in range(6)), unit, 10)
    buf = KvPlacement.full_blocks(fmt, "pe_buffer", 4096, 4)
    rs = runs(buf, buf.units_of_slots([2]), eng, [5], 1, 0, 4)
    assert rs == [type(rs[0])("pe_buffer", "kv", 2 * 4096 + unit, 10 * unit + 5 * unit, unit)]
    # a partial block: one run per segment (tokens 1..2 of each head's K and V)
    assert len(runs(buf, buf.units_of_slots([2]), eng, [5], 1, 1, 3)) == 6


def test_errors_name_the_problem():
    fmt = KvFormat(1, 4, (8,))
    buf = KvPlacement.full_blocks(fmt, "b", 4096, 2)
    other = KvPlacement.full_blocks(KvFormat(1, 4, (4, 4)), "b", 4096, 2)
    with pytest.raises(UsageError, match="formats differ"):
        runs(buf, [0], other, [0], 0, 0, 4)
    with pytest.raises(UsageError, match="exceed"):
        runs(buf, [0], buf, [1], 0, 0, 5)
    for move in (runs, run_arrays):             # the C runs check every unit too
        with pytest.raises(UsageError, match="unit 9 out of range 0..1"):
            move(buf, [9], buf, [1], 0, 0, 4)
        with pytest.raises(UsageError, match="unit -1 out of range 0..1"):
            move(buf, [0, 1], buf, [1, -1], 0, 0, 8)
    with pytest.raises(UsageError, match="slot stride"):
        KvPlacement.full_blocks(fmt, "b", 16, 2)


def _two_planes(fmt: KvFormat, num_units: int, together: bool) -> KvPlacement:
    """Segments alternating between two planes (K and V tensors, say) whose layer bases
    move by one amount (``together``: a later layer's runs are the first one's shifted)
    or by different amounts (they are not)."""
    n = len(fmt.row_bytes)
    planes = tuple(s % 2 for s in range(n))
    offs, acc = [0] * n, 0
    for s in range(n):
        offs[s] = acc
        acc += fmt.row_bytes[s] * fmt.unit_tokens
    v = (lambda i: 5000 + 11 * i) if together else (lambda i: 5000 + 13 * i * i)
    return KvPlacement(fmt, ("kv",) * fmt.layers,
                       tuple((11 * i, v(i)) for i in range(fmt.layers)),
                       planes, tuple(offs), acc, num_units)


@settings(max_examples=60, deadline=None)
@given(layers=st.integers(1, 4), unit_tokens=st.integers(1, 5),
       rows=st.lists(st.integers(1, 6), min_size=1, max_size=4), units=st.integers(1, 3),
       nblocks=st.integers(1, 3), data=st.data())
def test_a_layer_move_gives_every_layer_the_runs_run_arrays_gives(layers, unit_tokens, rows,
                                                                  units, nblocks, data):
    fmt = KvFormat(layers, unit_tokens, tuple(rows), units)
    slots = data.draw(st.permutations(range(nblocks + 1)))[:nblocks]
    buf = KvPlacement.full_blocks(fmt, "buf", fmt.layers * units * fmt.unit_bytes + 8,
                                  nblocks + 1)
    other = data.draw(st.sampled_from(["engine", "planes_together", "planes_apart"]))
    eng = (_engine_placement(fmt, nblocks * units + 4, data.draw(st.booleans()))
           if other == "engine" else
           _two_planes(fmt, nblocks * units + 4, other == "planes_together"))
    eng_units = data.draw(st.permutations(range(eng.num_units)))[:nblocks * units]
    buf_units = buf.units_of_slots(slots)
    total = nblocks * fmt.block_tokens
    cuts = sorted(data.draw(st.lists(st.integers(0, total), min_size=2, max_size=5)))
    spans = list(itertools.pairwise(cuts))
    order = data.draw(st.permutations(range(layers)))       # any layer first
    for a, b, x, y in ((buf, buf_units, eng, eng_units), (eng, eng_units, buf, buf_units)):
        move = LayerMove(a, b, x, y, spans)
        for layer in order:
            sreg, dreg, got = move.rows(layer)
            parts = [run_arrays(a, b, x, y, layer, lo, hi)[2] for lo, hi in spans if hi > lo]
            want = np.concatenate(parts) if parts else np.zeros((0, 3), np.uint64)
            assert (sreg, dreg) == (a.layer_regions[layer], x.layer_regions[layer])
            assert got.dtype == np.uint64 and got.tolist() == want.tolist(), (other, layer)
            got[:] = 0                     # the caller's own array: the next is intact
    with pytest.raises(UsageError, match="layer"):
        LayerMove(buf, buf_units, eng, eng_units, spans).rows(layers)
