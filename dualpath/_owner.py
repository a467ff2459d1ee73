"""What the native owners of :mod:`dualpath.verbs`, :mod:`dualpath.tcp` and
:mod:`dualpath.gpu` share: the owner base (idempotent close, children first), the
registered-memory owner, and the argument checks run before every C call."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

from dualpath._native import ffi
from dualpath.errors import UsageError, check

#: The largest timeout the C calls take (int64 nanoseconds): "for ever" in practice.
MAX_TIMEOUT_NS = (1 << 63) - 1


def check_range(what: str, value, lo: int, hi: int) -> None:
    """UsageError unless ``value`` is an int (not a bool) in [lo, hi]."""
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise UsageError(f"{what} must be an integer in [{lo}, {hi}], not {value!r}")


def timeout_ns(seconds: float, what: str = "timeout") -> int:
    """Seconds >= 0 as the C calls' int64 nanoseconds; beyond that range (or inf) the
    largest, which they treat as no deadline."""
    if not seconds >= 0:
        raise UsageError(f"{what} must be >= 0 seconds, not {seconds!r}")
    ns = seconds * 1e9
    return MAX_TIMEOUT_NS if ns >= MAX_TIMEOUT_NS else int(ns)


class Owner:
    """A native handle with an idempotent close(); children close first, newest first."""

    _handle = ffi.NULL
    _what = "resource"
    _parents: tuple[Owner, ...] = ()

    def __init__(self, parents: Sequence[Owner] = ()):
        self._children: list[Owner] = []
        for p in parents:
            p._check_open()

    def _adopt(self, handle, parents: Sequence[Owner] = ()) -> None:
        """Take ownership of a freshly created handle; only now do the parents know us."""
        self._handle = handle
        self._parents = tuple(parents)
        for p in self._parents:
            p._children.append(self)

    @property
    def closed(self) -> bool:
        return self._handle == ffi.NULL

    def _check_open(self) -> None:
        if self.closed:
            raise UsageError(f"{self._what} is closed")

    def close(self) -> None:
        """Close the live children (newest first), then this; a second call does nothing."""
        if self.closed:
            return
        for child in reversed(list(self._children)):
            child.close()
        check(self._destroy(), f"destroy {self._what}")
        self._handle = ffi.NULL
        for p in self._parents:
            p._children.remove(self)

    def _destroy(self) -> int:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        # Backstop only: owners are closed explicitly. A child keeps its parents alive,
        # so by the time a parent is collected its children are gone.
        with contextlib.suppress(Exception):    # nothing may escape a finalizer
            if not self.closed and not self._parents:
                self.close()


class RegionOwner(Owner):
    """Registered memory (a verbs MR, a TCP region, a GPU MR): its keys, and the buffer
    it keeps alive until close."""

    _buffer = None

    def _registered(self, handle, parent: Owner, info, access, keep=None) -> None:
        """Adopt ``handle`` under ``parent`` with the ``struct dp_mr_info`` it filled."""
        self._adopt(handle, [parent])
        self._buffer = keep
        self.addr, self.length = int(info.addr), int(info.length)
        self.lkey, self.rkey = int(info.lkey), int(info.rkey)
        self.access = access

    def close(self) -> None:
        super().close()
        self._buffer = None
