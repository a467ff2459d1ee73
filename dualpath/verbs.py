"""Verbs owners over ``dualpath._native``: Device, PD, CQ, QP and MR, policy-free.

Mechanism only (no retries, slicing or device policy). Threads: control calls (open,
create, connect, reset, close) from any one thread at a time per object; a QP's
``post_write`` and its send CQ's ``poll``/``wait`` from one thread at a time (the data-path
thread); every native call releases the GIL. QP states: RESET --connect()--> INIT -> RTR
-> RTS; a failed WR moves it to ERR; reset() takes any state back to RESET, dropping
its credits, and connect() may follow. Ownership: a parent (Device > PD, CQ > QP, MR)
closes its live children first, in reverse order of creation; ``close()`` is idempotent.
"""

from __future__ import annotations

import errno
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass

from dualpath._native import ffi, lib
from dualpath._owner import Owner, RegionOwner, check_range

# The records the TCP provider shares (dualpath/dp.py), part of this module's API too.
from dualpath.dp import (  # noqa: F401
    ACCESS_RW,
    Access,
    CompletionArray,
    Item,
    PostError,
    QpState,
    WcStatus,
    WorkCompletion,
    WriteBatch,
    memory_range,
    wc_dtype,
)
from dualpath.errors import RdmaError, UsageError, check, check_ptr

_NAME_LEN = 64
_MAX_DEVICES = 64
_U32 = 1 << 32
_U64 = 1 << 64


PORT_ACTIVE = 4
LINK_LAYER_INFINIBAND = 1
LINK_LAYER_ETHERNET = 2
GID_TYPE_ROCE_V2 = 1


# ------------------------------------------------------------------ plain records


@dataclass(frozen=True)
class PortAttrs:
    state: int
    max_mtu: int            # bytes
    active_mtu: int         # bytes
    link_layer: int         # LINK_LAYER_INFINIBAND or LINK_LAYER_ETHERNET
    gid_tbl_len: int
    lid: int

    @property
    def active(self) -> bool:
        return self.state == PORT_ACTIVE

    @property
    def is_ethernet(self) -> bool:
        return self.link_layer == LINK_LAYER_ETHERNET


@dataclass(frozen=True)
class Gid:
    index: int
    raw: bytes              # 16 bytes, network order
    type: int               # 0 = IB / RoCE v1, 1 = RoCE v2

    @property
    def address(self) -> ipaddress.IPv6Address:
        return ipaddress.IPv6Address(self.raw)

    @property
    def ipv4(self) -> str | None:
        """The IPv4 address of an IPv4-mapped GID (``::ffff:a.b.c.d``), else None."""
        mapped = self.address.ipv4_mapped
        return str(mapped) if mapped is not None else None

    @property
    def roce_v2(self) -> bool:
        return self.type == GID_TYPE_ROCE_V2

    def __str__(self) -> str:
        # IPv4-mapped ones in the usual dotted form (Python < 3.13 prints ::ffff:a63:1).
        return f"::ffff:{self.ipv4}" if self.ipv4 is not None else str(self.address)


@dataclass(frozen=True)
class Endpoint:
    """What a peer needs to connect to a QP (sent over the control plane)."""

    qpn: int
    psn: int
    lid: int
    mtu: int                # bytes
    gid: bytes = bytes(16)


# ------------------------------------------------------------------ device


def list_devices() -> list[str]:
    """Names of the RDMA devices present (empty when the kernel has no verbs)."""
    buf = ffi.new("char[]", _NAME_LEN * _MAX_DEVICES)
    n = check(lib.dp_device_list(buf, _NAME_LEN, _MAX_DEVICES), "list RDMA devices")
    return [ffi.string(buf + i * _NAME_LEN).decode() for i in range(n)]


class Device(Owner):
    """An open RDMA device (a verbs context). Control calls from one thread at a time."""

    _what = "RDMA device"

    def __init__(self, name: str | None = None, port: int = 1):
        if name is not None and not isinstance(name, str):
            raise UsageError(f"device name must be a str or None, not {type(name).__name__}")
        check_range("port", port, 1, 255)
        super().__init__()
        self._adopt(check_ptr(lib.dp_ctx_open((name or "").encode()),
                              f"open RDMA device {name or '(first with an ACTIVE port)'}", ffi))
        buf = ffi.new("char[]", _NAME_LEN)
        check(lib.dp_ctx_name(self._handle, buf, _NAME_LEN), "device name")
        self.name = ffi.string(buf).decode()
        self.port = port

    def _destroy(self) -> int:
        return lib.dp_ctx_close(self._handle)

    def __repr__(self) -> str:
        return f"<Device {self.name} port {self.port}{' closed' if self.closed else ''}>"

    def port_attrs(self, port: int | None = None) -> PortAttrs:
        self._check_open()
        port = self.port if port is None else port
        check_range("port", port, 1, 255)
        out = ffi.new("struct dp_port_info *")
        check(lib.dp_port_query(self._handle, port, out), f"query {self.name} port {port}")
        return PortAttrs(out.state, out.max_mtu, out.active_mtu, out.link_layer,
                         out.gid_tbl_len, out.lid)

    def gid(self, index: int, port: int | None = None) -> Gid | None:
        """GID table entry ``index``; None for an empty slot."""
        self._check_open()
        port = self.port if port is None else port
        check_range("port", port, 1, 255)
        check_range("gid index", index, 0, _U32 - 1)
        out = ffi.new("struct dp_gid_info *")
        check(lib.dp_gid_query(self._handle, port, index, out),
              f"query {self.name} port {port} GID {index}")
        return Gid(index, bytes(out.gid), out.type) if out.valid else None

    def gids(self, port: int | None = None) -> list[Gid]:
        """The non-empty GID table entries of a port."""
        n = self.port_attrs(port).gid_tbl_len
        return [g for g in (self.gid(i, port) for i in range(n)) if g is not None]

    def pick_gid(self, index: int = -1, port: int | None = None) -> Gid | None:
        """The GID a QP should use: ``index`` when >= 0; else the RoCE v2 IPv4-mapped one
        (``::ffff:a.b.c.d``) on Ethernet; None on InfiniBand (addressed by LID)."""
        port = self.port if port is None else port
        if index >= 0:
            g = self.gid(index, port)
            if g is None:
                raise RdmaError(errno.ENODATA, f"{self.name} port {port}: GID {index} is empty")
            return g
        if not self.port_attrs(port).is_ethernet:
            return None
        for g in self.gids(port):
            if g.roce_v2 and g.ipv4 is not None:
                return g
        raise RdmaError(errno.ENODATA, f"{self.name} port {port}: no RoCE v2 GID with an "
                        "IPv4 address (::ffff:a.b.c.d); configure one or set a GID index")

    def pd(self) -> ProtectionDomain:
        return ProtectionDomain(self)

    def cq(self, depth: int) -> CompletionQueue:
        return CompletionQueue(self, depth)


# ------------------------------------------------------------------ PD, MR


class ProtectionDomain(Owner):
    """A protection domain; parent of its QPs and MRs."""

    _what = "protection domain"

    def __init__(self, device: Device):
        super().__init__([device])
        self.device = device
        self._adopt(check_ptr(lib.dp_pd_alloc(device._handle),
                              f"allocate a PD on {device.name}", ffi), [device])

    def _destroy(self) -> int:
        return lib.dp_pd_free(self._handle)

    def mr(self, buf=None, access: int = ACCESS_RW, *, addr: int | None = None,
           length: int | None = None) -> MemoryRegion:
        return MemoryRegion(self, buf, access, addr=addr, length=length)

    def qp(self, send_cq: CompletionQueue, recv_cq: CompletionQueue | None = None,
           config: QpConfig | None = None) -> QueuePair:
        return QueuePair(self, send_cq, recv_cq, config)


class MemoryRegion(RegionOwner):
    """Registered memory: a buffer-protocol object (kept alive until close) or a raw
    ``addr``/``length`` range the caller keeps alive (pinned, never freed by us)."""

    _what = "memory region"

    def __init__(self, pd: ProtectionDomain, buf=None, access: int = ACCESS_RW, *,
                 addr: int | None = None, length: int | None = None):
        keep, ptr, length = memory_range(buf, access, addr=addr, length=length)
        super().__init__([pd])
        info = ffi.new("struct dp_mr_info *")
        self._registered(check_ptr(lib.dp_mr_reg(pd._handle, ptr, length, int(access), info),
                                   f"register {length} bytes on {pd.device.name}", ffi),
                         pd, info, Access(int(access)), keep)

    def _destroy(self) -> int:
        return lib.dp_mr_dereg(self._handle)

    def __repr__(self) -> str:
        return f"<MemoryRegion {self.length} B at {self.addr:#x} lkey {self.lkey:#x} rkey {self.rkey:#x}>"


# ------------------------------------------------------------------ CQ


class CompletionQueue(CompletionArray):
    """A verbs CQ; ``depth`` bounds the signalled WRs outstanding on it (posts stop
    there). wait() busy-polls, yielding the CPU after a short spin."""

    _what = "completion queue"

    def __init__(self, device: Device, depth: int):
        check_range("CQ depth", depth, 1, (1 << 31) - 1)
        super().__init__([device])
        self.device = device
        self._init_array(depth)
        self._adopt(check_ptr(lib.dp_cq_create(device._handle, depth),
                              f"create a CQ of {depth} on {device.name}", ffi), [device])

    def _destroy(self) -> int:
        return lib.dp_cq_destroy(self._handle)

    def _poll_native(self, max_entries: int) -> int:
        return lib.dp_cq_poll(self._handle, self.wc, max_entries)

    def _wait_native(self, max_entries: int, timeout_ns: int) -> int:
        return lib.dp_cq_wait(self._handle, self.wc, max_entries, timeout_ns)


# ------------------------------------------------------------------ QP


@dataclass(frozen=True)
class QpConfig:
    """RC QP settings (``struct dp_qp_cfg``); the lane is service_level + traffic_class."""

    max_send_wr: int = 256      # also the longest chain one post carries
    max_inline: int = 0         # bytes sent inline (no lkey needed) at or below this
    path_mtu: int = 0           # bytes, 256..4096; 0 = the port's active MTU
    gid_index: int = -1         # local GID index for RoCE; -1 = none (InfiniBand LID)
    port: int = 1
    service_level: int = 0      # IB SL, 0..15
    traffic_class: int = 0      # GRH traffic class; DSCP = traffic_class >> 2
    hop_limit: int = 64
    timeout: int = 14           # local ACK timeout exponent: 4.096 us * 2^timeout
    retry_cnt: int = 7
    rnr_retry: int = 7

    def __post_init__(self):
        check_range("max_send_wr", self.max_send_wr, 1, 65536)
        check_range("max_inline", self.max_inline, 0, 65536)
        if self.path_mtu not in (0, 256, 512, 1024, 2048, 4096):
            raise UsageError(f"path_mtu must be 0 or 256..4096 (a power of 2), "
                             f"not {self.path_mtu!r}")
        check_range("gid_index", self.gid_index, -1, 255)
        check_range("port", self.port, 1, 255)
        check_range("service_level", self.service_level, 0, 15)
        check_range("traffic_class", self.traffic_class, 0, 255)
        check_range("hop_limit", self.hop_limit, 1, 255)
        check_range("timeout", self.timeout, 1, 31)
        check_range("retry_cnt", self.retry_cnt, 1, 7)
        check_range("rnr_retry", self.rnr_retry, 1, 7)

    def _cdata(self):
        c = ffi.new("struct dp_qp_cfg *")
        for name in ("max_send_wr", "max_inline", "path_mtu", "gid_index", "port",
                     "service_level", "traffic_class", "hop_limit", "timeout", "retry_cnt",
                     "rnr_retry"):
            setattr(c, name, getattr(self, name))
        c.max_recv_wr = 1
        return c


class QueuePair(Owner):
    """An RC QP (see the module docstring for its states). post_write and its send CQ's
    poll from one thread at a time."""

    _what = "queue pair"

    def __init__(self, pd: ProtectionDomain, send_cq: CompletionQueue,
                 recv_cq: CompletionQueue | None = None, config: QpConfig | None = None):
        recv_cq = send_cq if recv_cq is None else recv_cq
        config = QpConfig() if config is None else config
        for cq in (send_cq, recv_cq):
            if cq.device is not pd.device:
                raise UsageError("a QP's CQs and PD must belong to the same device")
        parents = [pd, send_cq] + ([recv_cq] if recv_cq is not send_cq else [])
        super().__init__(parents)
        self.pd, self.send_cq, self.recv_cq, self.config = pd, send_cq, recv_cq, config
        self._adopt(check_ptr(lib.dp_qp_create(pd._handle, send_cq._handle, recv_cq._handle,
                                               config._cdata()),
                              f"create an RC QP on {pd.device.name}", ffi), parents)
        self.qp_num = check(lib.dp_qp_num(self._handle), "QP number")
        self._n_posted = ffi.new("uint32_t *")

    def _destroy(self) -> int:
        return lib.dp_qp_destroy(self._handle)

    def __repr__(self) -> str:
        return f"<QueuePair {self.qp_num:#x} on {self.pd.device.name}>"

    @property
    def state(self) -> QpState:
        self._check_open()
        return QpState(check(lib.dp_qp_state(self._handle), "query QP state"))

    @property
    def lane(self) -> tuple[int, int]:
        """(service level, GRH traffic class) of the connected QP, as the device holds
        them (ibv_query_qp)."""
        self._check_open()
        sl, tc = ffi.new("uint8_t *"), ffi.new("uint8_t *")
        check(lib.dp_qp_lane(self._handle, sl, tc), "query QP lane")
        return sl[0], tc[0]

    @property
    def outstanding(self) -> int:
        """WRs posted and not yet retired by a completion."""
        self._check_open()
        return check(lib.dp_qp_outstanding(self._handle), "QP outstanding")

    def endpoint(self) -> Endpoint:
        self._check_open()
        e = ffi.new("struct dp_qp_endpoint *")
        check(lib.dp_qp_endpoint(self._handle, e), "QP endpoint")
        return Endpoint(e.qpn, e.psn, e.lid, e.mtu, bytes(e.gid))

    def connect(self, remote: Endpoint) -> None:
        """RESET (or INIT) -> INIT -> RTR -> RTS towards ``remote``."""
        self._check_open()
        if not isinstance(remote, Endpoint):
            raise UsageError(f"connect() takes an Endpoint, not {type(remote).__name__}")
        check_range("remote qpn", remote.qpn, 0, (1 << 24) - 1)
        check_range("remote psn", remote.psn, 0, (1 << 24) - 1)
        check_range("remote lid", remote.lid, 0, 0xffff)
        check_range("remote mtu", remote.mtu, 0, _U32 - 1)
        if len(remote.gid) != 16:
            raise UsageError(f"remote gid must be 16 bytes, not {len(remote.gid)}")
        e = ffi.new("struct dp_qp_endpoint *")
        e.qpn, e.psn, e.lid, e.mtu = remote.qpn, remote.psn, remote.lid, remote.mtu
        e.gid = remote.gid
        check(lib.dp_qp_connect(self._handle, e), f"connect QP {self.qp_num:#x} to "
              f"QP {remote.qpn:#x}")

    def reset(self) -> None:
        """Back to RESET (recovery): outstanding WRs are forgotten and their late
        completions discarded; a new PSN is chosen, so take a fresh endpoint()."""
        self._check_open()
        check(lib.dp_qp_reset(self._handle), f"reset QP {self.qp_num:#x}")

    def post_write(self, items: WriteBatch | Sequence[Item | tuple], signal_every: int = 1,
                   *, start: int = 0, count: int | None = None) -> int:
        """Post items ``[start, start+count)`` as RDMA WRITEs with one doorbell; return
        how many went out. Fewer than asked is the normal credit limit (poll, then post
        the rest); a failed post raises PostError saying how many went out."""
        self._check_open()
        batch = items if isinstance(items, WriteBatch) else WriteBatch(items)
        count = batch.n - start if count is None else count
        if start < 0 or count < 0 or start + count > batch.n:
            raise UsageError(f"items [{start}, {start + count}) outside a batch of {batch.n}")
        check_range("signal_every", signal_every, 1, _U32 - 1)
        rc = lib.dp_qp_post_write(self._handle, batch._items + start, count, signal_every,
                                  self._n_posted)
        posted = self._n_posted[0]
        if rc < 0 and rc != -errno.EAGAIN:
            raise PostError(-rc, f"post {count} WRITEs on QP {self.qp_num:#x}", posted, count)
        return posted

    def post_raw(self, items, count: int, signal_every: int) -> int:
        """post_write over a caller-filled ``struct dp_item`` array (``items``: a cffi
        pointer, e.g. ``WriteBatch.items + start``), unchecked: the hot path of callers
        that validated their items once. Same result and PostError as post_write."""
        rc = lib.dp_qp_post_write(self._handle, items, count, signal_every, self._n_posted)
        posted = self._n_posted[0]
        if rc < 0 and rc != -errno.EAGAIN:
            raise PostError(-rc, f"post {count} WRITEs on QP {self.qp_num:#x}", posted, count)
        return posted

