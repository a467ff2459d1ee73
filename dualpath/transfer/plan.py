"""Pure planning for the TransferEngine: cut a batch into slices, share slices among
connections. No I/O, so tests and the bench call exactly what the engine runs."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

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
        if n == 0:
            raise UsageError(f"items[{i}].length must be > 0")
        if lo + n > local_length:
            raise UsageError(f"items[{i}]: local range [{lo}, {lo + n}) is outside the local "
                             f"region ({local_length} bytes)")
        if ro + n > remote_length:
            raise UsageError(f"items[{i}]: remote range [{ro}, {ro + n}) is outside the "
                             f"peer's region ({remote_length} bytes)")
        for off in range(0, n, slice_bytes):
            out.append((lo + off, ro + off, min(slice_bytes, n - off)))
    return out


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
