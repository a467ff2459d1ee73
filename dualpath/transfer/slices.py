"""Pure planning for the TransferEngine: cut a batch into slices, share slices among
connections. No I/O (an array of rows is cut by a C loop, csrc/runs.c), so tests and
the bench call exactly what the engine runs."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable, Sequence

import numpy as np

from dualpath._native import ffi, lib
from dualpath.errors import UsageError


def plan_slices(items: Iterable, slice_bytes: int, local_length: int,
                remote_length: int) -> list[tuple[int, int, int]]:
    """``(local_offset, remote_offset, length)`` items -> slices of at most ``slice_bytes``,
    in order. Every range must lie inside its region; the first bad item is named."""
    if slice_bytes <= 0:
        raise UsageError(f"slice_bytes must be > 0, not {slice_bytes!r}")
    out: list[tuple[int, int, int]] = []
    for i, it in enumerate(items):
        try:
            lo, ro, n = it
        except (TypeError, ValueError):
            raise UsageError(f"items[{i}] must be (local_offset, remote_offset, length), "
                             f"not {it!r}") from None
        for what, v in (("local_offset", lo), ("remote_offset", ro), ("length", n)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise UsageError(f"items[{i}].{what} must be an integer >= 0, not {v!r}")
        _check_ranges(i, lo, ro, n, local_length, remote_length)
        for off in range(0, n, slice_bytes):
            out.append((lo + off, ro + off, min(slice_bytes, n - off)))
    return out


def _check_ranges(i: int, lo: int, ro: int, n: int, local_length: int,
                  remote_length: int) -> None:
    """Item ``i`` (offsets and length >= 0) is not empty and lies inside both regions
    (the checks dp_plan_rows makes, in the same order), or UsageError naming it."""
    if n == 0:
        raise UsageError(f"items[{i}].length must be > 0")
    if lo + n > local_length:
        raise UsageError(f"items[{i}]: local range [{lo}, {lo + n}) is outside the local "
                         f"region ({local_length} bytes)")
    if ro + n > remote_length:
        raise UsageError(f"items[{i}]: remote range [{ro}, {ro + n}) is outside the "
                         f"peer's region ({remote_length} bytes)")


def plan_rows(items, slice_bytes: int, local_length: int, remote_length: int) -> np.ndarray:
    """:func:`plan_slices` as uint64 rows of ``(local_offset, remote_offset, length)``,
    C-contiguous (what ``dp_items_fill`` reads). ``items`` may be an (n, 3) integer array
    (a layer's runs, dualpath/kv/placement.run_arrays): checked and cut in one C call
    whatever its length (csrc/runs.c dp_plan_rows), with the same errors naming the first
    bad item."""
    if not isinstance(items, np.ndarray):
        return np.asarray(plan_slices(items, slice_bytes, local_length, remote_length),
                          np.uint64).reshape(-1, 3)
    if slice_bytes <= 0:
        raise UsageError(f"slice_bytes must be > 0, not {slice_bytes!r}")
    if items.ndim != 2 or items.shape[1] != 3 or items.dtype.kind not in "iu":
        raise UsageError(f"an items array must be (n, 3) integers, not {items.shape} "
                         f"{items.dtype}")
    if items.dtype != np.uint64 or not items.flags.c_contiguous:
        if items.dtype.kind == "i" and (items < 0).any():
            return plan_rows(items.tolist(), slice_bytes, local_length, remote_length)
        items = np.ascontiguousarray(items, np.uint64)
    out = np.empty_like(items)                  # no item cut: as many slices as items
    bad = ffi.new("uint64_t[1]")
    k = _plan(items, out, slice_bytes, local_length, remote_length, bad)
    if k == -errno.ENOSPC:                      # some cut: bad[0] slices
        out = np.empty((bad[0], 3), np.uint64)
        k = _plan(items, out, slice_bytes, local_length, remote_length, bad)
    if k == -errno.ERANGE:                      # bad[0]: the first item out of range
        _check_ranges(bad[0], *(int(v) for v in items[bad[0]]), local_length, remote_length)
    if k < 0:
        raise UsageError(f"planning {len(items)} items: {os.strerror(-k)}")
    return out[:k]


def _plan(items: np.ndarray, out: np.ndarray, slice_bytes: int, local_length: int,
          remote_length: int, bad) -> int:
    return lib.dp_plan_rows(ffi.from_buffer("uint64_t[]", items), len(items), slice_bytes,
                            local_length, remote_length, ffi.from_buffer("uint64_t[]", out),
                            len(out), bad)


def window_keys(windows, rows: np.ndarray, fallback: int) -> tuple[np.ndarray, bool]:
    """The rkey of each row's window (``windows``: ``(offset, length, rkey)`` sorted by
    offset, disjoint) as uint32, and whether every row lies inside one; a row outside
    gets ``fallback`` (a key its target refuses)."""
    keys = np.full(len(rows), fallback, np.uint32)
    if not len(windows) or not len(rows):
        return keys, not len(rows)
    w = np.asarray(windows, dtype=np.uint64).reshape(-1, 3)
    i = np.searchsorted(w[:, 0], rows[:, 1], side="right").astype(np.int64) - 1
    inside = i >= 0
    j = np.where(inside, i, 0)
    inside &= rows[:, 1] + rows[:, 2] <= w[j, 0] + w[j, 1]
    keys[inside] = w[j[inside], 2]
    return keys, bool(inside.all())


def spread(total: int, rooms: Sequence[int]) -> list[int]:
    """How many of ``total`` slices each connection takes: as even as the rooms (free
    credits) allow, earlier connections taking the remainder; sum = min(total, rooms).

    Water-filling: visit connections from the least room up; each takes its fair share
    of what is left, or all its room if that is less (which raises the others' share).
    """
    counts = [0] * len(rooms)
    order = sorted((i for i, r in enumerate(rooms) if r > 0), key=lambda i: (rooms[i], -i))
    left = total
    for pos, i in enumerate(order):
        counts[i] = min(rooms[i], left // (len(order) - pos))
        left -= counts[i]
    return counts
