"""Pure planning: slicing a batch and sharing slices among connections."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dualpath.errors import UsageError
from dualpath.transfer.slices import plan_rows, plan_slices, spread


def test_items_are_cut_at_slice_bytes_in_order():
    # 10 bytes with slices of 4: 4 + 4 + 2, offsets advancing on both sides.
    assert plan_slices([(100, 200, 10), (0, 0, 3)], 4, 1000, 1000) == [
        (100, 200, 4), (104, 204, 4), (108, 208, 2), (0, 0, 3)]


def test_exact_multiple_makes_no_empty_slice():
    assert plan_slices([(0, 0, 8)], 4, 8, 8) == [(0, 0, 4), (4, 4, 4)]


@pytest.mark.parametrize("items,match", [
    ([(0, 0, 0)], r"items\[0\].length must be > 0"),
    ([(0, 0, 1), (-1, 0, 1)], r"items\[1\].local_offset must be an integer >= 0"),
    ([(0, 0, True)], r"items\[0\].length must be an integer"),
    ([(0, 0)], r"items\[0\] must be \(local_offset, remote_offset, length\)"),
    ([(90, 0, 11)], r"items\[0\]: local range \[90, 101\) is outside the local region"),
    ([(0, 95, 6)], r"items\[0\]: remote range \[95, 101\) is outside the peer's region"),
])
def test_bad_items_name_the_item_and_the_problem(items, match):
    with pytest.raises(UsageError, match=match):
        plan_slices(items, 4, 100, 100)
    if all(len(it) == 3 and not any(isinstance(v, bool) for v in it) for it in items):
        for dtype in (np.int64, np.uint64):       # the array path says the same
            if dtype is np.uint64 and any(v < 0 for it in items for v in it):
                continue
            with pytest.raises(UsageError, match=match):
                plan_rows(np.array(items, dtype), 4, 100, 100)


def test_an_items_array_must_be_n_by_3_integers():
    with pytest.raises(UsageError, match=r"must be \(n, 3\) integers"):
        plan_rows(np.zeros((2, 2), np.int64), 4, 100, 100)
    with pytest.raises(UsageError, match=r"must be \(n, 3\) integers"):
        plan_rows(np.zeros((2, 3)), 4, 100, 100)


@given(st.lists(st.tuples(st.integers(0, 500), st.integers(0, 500), st.integers(1, 500)),
                max_size=20), st.integers(1, 64))
def test_slices_cover_each_item_exactly(items, slice_bytes):
    slices = plan_slices(items, slice_bytes, 1000, 1000)
    assert all(0 < n <= slice_bytes for _, _, n in slices)
    covered = iter(slices)
    for lo, ro, n in items:
        off = 0
        while off < n:
            assert next(covered) == (lo + off, ro + off, min(slice_bytes, n - off))
            off += slice_bytes
    assert next(covered, None) is None
    # The array path (a layer's runs: C) plans the very same rows.
    for dtype in (np.int64, np.uint64):
        rows = plan_rows(np.array(items, dtype).reshape(-1, 3), slice_bytes, 1000, 1000)
        assert rows.dtype == np.uint64 and rows.flags.c_contiguous and rows.shape[1:] == (3,)
        assert [tuple(r) for r in rows.tolist()] == slices


def test_spread_is_even_then_capped_by_credits():
    assert spread(48, [256, 256, 256]) == [16, 16, 16]
    assert spread(10, [3, 100]) == [3, 7]
    assert spread(5, [2, 2]) == [2, 2]              # only 4 credits in all
    assert spread(1, [5, 5]) == [1, 0]
    assert spread(7, [0, 10, 10]) == [0, 4, 3]


@given(st.integers(0, 1000), st.lists(st.integers(0, 300), min_size=1, max_size=8))
def test_spread_never_exceeds_room_or_total_and_fills_what_it_can(total, rooms):
    counts = spread(total, rooms)
    assert all(0 <= c <= r for c, r in zip(counts, rooms))
    assert sum(counts) == min(total, sum(rooms))
    # Even: two connections that both still had room differ by at most one slice.
    open_ = [c for c, r in zip(counts, rooms) if c < r]
    assert not open_ or max(open_) - min(open_) <= 1


def test_window_keys_give_each_row_its_windows_key_or_the_fallback():
    from dualpath.transfer.slices import window_keys

    windows = [(0, 8192, 11), (16384, 4096, 12)]
    rows = np.array([[0, 0, 4096], [0, 4096, 4096],          # inside the first
                     [0, 16384, 4096],                       # the second, whole
                     [0, 8192, 4096],                        # in the gap
                     [0, 4096, 8192],                        # runs past the first
                     [0, 20400, 100]], dtype=np.uint64)      # past the last
    keys, inside = window_keys(windows, rows, 99)
    assert keys.dtype == np.uint32 and list(keys) == [11, 11, 12, 99, 99, 99]
    assert not inside
    keys, inside = window_keys(windows, rows[:3], 99)
    assert inside and list(keys) == [11, 11, 12]
    keys, inside = window_keys([], rows[:1], 99)
    assert not inside and list(keys) == [99]


def test_grant_runs_merge_and_stay_inside_the_region():
    from dualpath.transfer.verbs_provider import merge_runs

    assert merge_runs([(8192, 4096), (0, 4096), (4096, 4096), (20000, 10)], 1 << 20) == \
        [(0, 12288), (20000, 10)]
    assert merge_runs([(0, 8192), (4096, 100)], 8192) == [(0, 8192)]   # overlapping
    for bad in ((0, 0), (-1, 10), (8000, 200)):
        with pytest.raises(UsageError, match="not inside"):
            merge_runs([bad], 8192)
