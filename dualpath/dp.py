"""The records both data-path providers share (verbs.py, tcp.py), as csrc/dp.h declares
them for both: access flags, QP states and completion statuses (ibv_* numbers), a
completion and a WRITE item (``struct dp_wc``, ``struct dp_item``), the native arrays of
each (CompletionArray, WriteBatch), a post that stopped part way (PostError) and the
checks of a range to register. Policy-free; no provider's calls.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import NamedTuple

from dualpath._native import ffi, lib
from dualpath._owner import Owner, check_range, timeout_ns
from dualpath.errors import RdmaError, UsageError, check

_U32 = 1 << 32
_U64 = 1 << 64


class Access(enum.IntFlag):
    """MR access bits (the values of ``ibv_access_flags``)."""

    LOCAL_WRITE = lib.DP_ACCESS_LOCAL_WRITE
    REMOTE_WRITE = lib.DP_ACCESS_REMOTE_WRITE
    REMOTE_READ = lib.DP_ACCESS_REMOTE_READ


#: What an MR that is both a WRITE source and a WRITE target needs.
ACCESS_RW = Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ


class QpState(enum.IntEnum):
    """``ibv_qp_state``."""

    RESET = 0
    INIT = 1
    RTR = 2
    RTS = 3
    SQD = 4
    SQE = 5
    ERR = 6


class WcStatus(enum.IntEnum):
    """Work completion status (``ibv_wc_status`` numbering, shared by the TCP provider)."""

    SUCCESS = 0
    LOC_LEN_ERR = 1
    LOC_QP_OP_ERR = 2
    LOC_EEC_OP_ERR = 3
    LOC_PROT_ERR = 4
    WR_FLUSH_ERR = 5
    MW_BIND_ERR = 6
    BAD_RESP_ERR = 7
    LOC_ACCESS_ERR = 8
    REM_INV_REQ_ERR = 9
    REM_ACCESS_ERR = 10
    REM_OP_ERR = 11
    RETRY_EXC_ERR = 12
    RNR_RETRY_EXC_ERR = 13


class PostError(RdmaError):
    """``ibv_post_send`` failed: items ``[:posted]`` went out, the rest did not."""

    def __init__(self, err: int, what: str, posted: int, total: int):
        super().__init__(err, f"{what} ({posted} of {total} items went out)")
        self.posted = posted
        self.not_posted = total - posted


class WorkCompletion(NamedTuple):
    """One entry of a completion queue (``struct dp_wc``, verbs' ``ibv_wc``): a work
    request ended. Not a request's completion (scheduler/core/model.py)."""

    wr_id: int              # the caller's id of the WR that completed
    status: int             # WcStatus; 0 = success
    qp_num: int
    retired: int            # WRs of that QP this completion retires (it and those before)
    vendor_err: int

    @property
    def ok(self) -> bool:
        return self.status == WcStatus.SUCCESS


class Item(NamedTuple):
    """One RDMA WRITE: ``length`` bytes at ``local_addr`` (lkey) to ``remote_addr`` (rkey)."""

    local_addr: int
    remote_addr: int
    length: int
    lkey: int
    rkey: int
    wr_id: int = 0


def wc_dtype():
    """A numpy dtype matching ``struct dp_wc`` (numpy is imported only when asked)."""
    import numpy as np

    return np.dtype([("wr_id", "<u8"), ("status", "<i4"), ("qp_num", "<u4"),
                     ("retired", "<u4"), ("vendor_err", "<u4")])


def memory_range(buf, access: int, *, addr: int | None, length: int | None):
    """Check what an MR-like owner registers; return (keep-alive, pointer, length).

    ``buf``: a buffer-protocol object, writable when ``access`` lets anyone write it; the
    keep-alive (a cffi buffer) holds it, and its memory, until the owner drops it.
    Else ``addr``/``length``: a raw range the caller keeps alive (keep-alive None)."""
    check_range("access", int(access), 0, int(ACCESS_RW))
    if (buf is None) == (addr is None):
        raise UsageError("register either a buffer or an addr=/length= range")
    if buf is None:
        check_range("addr", addr, 0, _U64 - 1)
        check_range("length", length, 1, _U64 - addr)
        return None, ffi.cast("void *", addr), length
    writable = bool(access & (Access.LOCAL_WRITE | Access.REMOTE_WRITE))
    try:
        cbuf = ffi.from_buffer(buf, require_writable=writable)
    except (TypeError, BufferError) as e:
        raise UsageError(f"cannot register {type(buf).__name__}: {e}") from e
    if len(cbuf) == 0:
        raise UsageError("cannot register an empty buffer")
    return cbuf, cbuf, len(cbuf)


class CompletionArray(Owner):
    """What every provider's CQ shares: completions polled into one preallocated
    ``struct dp_wc`` array (``self.wc``), read as WorkCompletion tuples, a count (hot loops)
    or a numpy array. A subclass sets ``_poll_native(max)`` and
    ``_wait_native(max, timeout_ns)``. poll/wait from one thread at a time."""

    def _init_array(self, depth: int) -> None:
        self.depth = depth
        self.wc = ffi.new("struct dp_wc[]", min(depth, 4096))

    def _poll_native(self, max_entries: int) -> int:
        raise NotImplementedError

    def _wait_native(self, max_entries: int, timeout_ns: int) -> int:
        raise NotImplementedError

    def _max(self, max_entries: int | None) -> int:
        self._check_open()
        n = len(self.wc) if max_entries is None else max_entries
        check_range("max completions", n, 1, len(self.wc))
        return n

    def completions(self, n: int) -> list[WorkCompletion]:
        """The first ``n`` entries of ``self.wc`` as WorkCompletion tuples."""
        wc = self.wc
        return [WorkCompletion(wc[i].wr_id, wc[i].status, wc[i].qp_num, wc[i].retired,
                           wc[i].vendor_err) for i in range(n)]

    def poll_n(self, max_entries: int | None = None) -> int:
        """Poll without blocking, leaving the completions in ``self.wc``; their count."""
        return check(self._poll_native(self._max(max_entries)), f"poll {self._what}")

    def wait_n(self, timeout: float, max_entries: int | None = None) -> int:
        """Wait up to ``timeout`` seconds for a completion, left in ``self.wc``; their
        count (0: the time ran out)."""
        return check(self._wait_native(self._max(max_entries), timeout_ns(timeout)),
                     f"wait on {self._what}")

    def poll(self, max_entries: int | None = None) -> list[WorkCompletion]:
        """Completions ready now (possibly none); never blocks."""
        return self.completions(self.poll_n(max_entries))

    def wait(self, timeout: float, max_entries: int | None = None) -> list[WorkCompletion]:
        """Completions, waiting up to ``timeout`` seconds for the first; [] when the
        time ran out."""
        return self.completions(self.wait_n(timeout, max_entries))

    def poll_array(self, max_entries: int | None = None):
        """Like poll() but a numpy structured array (dtype :func:`wc_dtype`)."""
        import numpy as np

        n = self.poll_n(max_entries)
        return np.frombuffer(ffi.buffer(self.wc, n * ffi.sizeof("struct dp_wc")),
                             dtype=wc_dtype()).copy()


class WriteBatch:
    """Items prepared and validated once, as a native ``struct dp_item`` array, to post
    many times (or in parts: ``post_write(batch, start=..)``)."""

    def __init__(self, items: Sequence[Item | tuple]):
        self._items = ffi.new("struct dp_item[]", max(len(items), 1))
        for i, it in enumerate(items):
            it = Item(*it)
            check_range(f"items[{i}].length", it.length, 1, _U32 - 1)
            for field in ("local_addr", "remote_addr", "wr_id"):
                check_range(f"items[{i}].{field}", getattr(it, field), 0, _U64 - 1)
            for field in ("lkey", "rkey"):
                check_range(f"items[{i}].{field}", getattr(it, field), 0, _U32 - 1)
            d = self._items[i]
            d.local_addr, d.remote_addr, d.length = it.local_addr, it.remote_addr, it.length
            d.lkey, d.rkey, d.wr_id = it.lkey, it.rkey, it.wr_id
        self.n = len(items)
        #: the native array itself, for callers that refill it in place before posting
        self.items = self._items

    def __len__(self) -> int:
        return self.n
