"""TCP provider owners over ``dualpath._native``: the verbs data path's one-sided WRITE
semantics on hosts without an RDMA device. Mechanism only, like :mod:`dualpath.verbs`,
whose records (Item, WriteBatch, WorkCompletion, WcStatus, QpState, PostError) it shares.

Objects: a :class:`TcpEngine` listens on host:port and serves peers' WRITEs into its
:class:`TcpRegion` s from a C server thread; a :class:`TcpConnection` (an RC QP's twin)
writes into a remote engine's regions, its completions arriving on a
:class:`TcpCompletionQueue`.

Admission: an engine serves a peer's connection only after it presents a credential
the engine issued (:meth:`TcpEngine.admit`: a random 128-bit secret the owner hands to
the peer over its authenticated control plane) in a challenge-response at connect
(csrc/tcp_auth.c); anyone else is disconnected without an answer. ``open=True`` turns
that off (benchmarks comparing the cost). rkeys are random.

Connection states (ibv numbering, :class:`QpState`): RESET --connect()--> RTS; a failed
WRITE, a dead peer or a bad local range moves it to ERR, where every outstanding item
completes with an error (the first naming the cause, the rest WR_FLUSH_ERR); reset()
takes any state back to RESET, dropping outstanding items, and connect() may follow.

Threads: ``post_write`` on a connection and ``poll``/``wait`` of its CQ, ``reset`` and
``close`` from one thread at a time (the data-path thread); ``connect`` may run on
another thread while the CQ is polled as long as nothing posts on that connection;
``wake`` from any thread; register/close of regions from any one thread at a time.
Every native call releases the GIL. Bytes move only inside post/poll/wait, so a thread
must keep polling while items are outstanding.

Ownership: TcpEngine > (TcpRegion, TcpCompletionQueue > TcpConnection); a parent closes
its live children first, newest first; ``close()`` is idempotent.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass

import numpy as np

from dualpath._native import ffi, lib
from dualpath._owner import Owner, RegionOwner, check_range, timeout_ns
from dualpath.dp import (
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
)
from dualpath.errors import UsageError, check, check_ptr

__all__ = [
    "ACCESS_RW",
    "SECRET_BYTES",
    "Access",
    "Credential",
    "Item",
    "PostError",
    "QpState",
    "TcpCompletionQueue",
    "TcpConfig",
    "TcpConnection",
    "TcpEngine",
    "TcpRegion",
    "TcpStats",
    "WcStatus",
    "WorkCompletion",
    "WriteBatch",
]


@dataclass(frozen=True)
class TcpConfig:
    """Connection settings (``struct dp_tcp_conn_cfg``)."""

    max_send_wr: int = 256      # items outstanding per connection (the credits)
    sockbuf_bytes: int = 0      # SO_SNDBUF/SO_RCVBUF; 0 = kernel autotuning
    user_timeout_ms: int = 0    # TCP_USER_TIMEOUT; 0 = kernel default

    def __post_init__(self):
        check_range("max_send_wr", self.max_send_wr, 1, 65536)
        check_range("sockbuf_bytes", self.sockbuf_bytes, 0, 1 << 30)
        check_range("user_timeout_ms", self.user_timeout_ms, 0, (1 << 31) - 1)

    def _cdata(self):
        c = ffi.new("struct dp_tcp_conn_cfg *")
        c.max_send_wr, c.sockbuf_bytes = self.max_send_wr, self.sockbuf_bytes
        c.user_timeout_ms = self.user_timeout_ms
        return c


SECRET_BYTES = 16


@dataclass(frozen=True)
class Credential:
    """Admits one connection to the engine that issued it: ``id`` (not secret) and
    ``secret`` (16 random bytes; send it only over an authenticated, encrypted channel)."""

    id: int
    secret: bytes

    def __post_init__(self):
        check_range("credential id", self.id, 0, (1 << 32) - 1)
        if not isinstance(self.secret, bytes) or len(self.secret) != SECRET_BYTES:
            raise UsageError(f"a credential's secret is {SECRET_BYTES} bytes")

    def __repr__(self) -> str:   # never print the secret
        return f"Credential(id={self.id:#x})"


@dataclass(frozen=True)
class TcpStats:
    """Target-side counters of an engine since it started (``struct dp_tcp_stats``)."""

    conns_accepted: int
    conns_admitted: int  # passed the challenge-response
    conns_refused: int   # closed unadmitted: bad hello, handshake timeout, a cap reached
    writes: int         # WRITEs that landed
    bytes: int          # their payload bytes
    refused: int        # refused before writing: rkey, access, bounds, dereg
    flushed: int        # dropped after a failure on their connection
    ack_stalls: int     # a socket was not read because its acks could not be sent
    out_of_scope: int = 0   # of refused: outside the writer's granted windows


class TcpEngine(Owner):
    """A listening engine: the region table and the server thread that writes peers'
    WRITEs into it. Control calls from one thread at a time."""

    _what = "TCP engine"

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, max_regions: int = 1024,
                 sockbuf_bytes: int = 0, open: bool = False, max_pending: int = 64,
                 handshake_timeout_ms: int = 2000, max_conns_per_peer: int = 16,
                 max_credentials: int = 4096, max_pending_per_addr: int = 0,
                 max_grants: int = 4096):
        if not isinstance(host, str) or not host:
            raise UsageError(f"host must be a non-empty str, not {host!r}")
        check_range("port", port, 0, 65535)
        check_range("max_regions", max_regions, 1, 65535)
        check_range("sockbuf_bytes", sockbuf_bytes, 0, 1 << 30)
        check_range("max_pending", max_pending, 1, 65536)
        check_range("handshake_timeout_ms", handshake_timeout_ms, 1, 3_600_000)
        check_range("max_conns_per_peer", max_conns_per_peer, 1, (1 << 32) - 1)
        check_range("max_credentials", max_credentials, 1, 65535)
        check_range("max_pending_per_addr", max_pending_per_addr, 0, max_pending)
        check_range("max_grants", max_grants, 1, 65535)
        super().__init__()
        cfg = ffi.new("struct dp_tcp_cfg *")
        cfg.max_regions, cfg.sockbuf_bytes = max_regions, sockbuf_bytes
        cfg.flags = lib.DP_TCP_OPEN if open else 0
        cfg.max_pending, cfg.handshake_timeout_ms = max_pending, handshake_timeout_ms
        cfg.max_conns_per_peer, cfg.max_credentials = max_conns_per_peer, max_credentials
        cfg.max_pending_per_addr = max_pending_per_addr     # 0: max_pending / 8
        cfg.max_grants = max_grants
        self.open = open
        self._adopt(check_ptr(lib.dp_tcp_create(host.encode(), port, cfg),
                              f"listen on {host}:{port}", ffi))
        self.host = host
        self.port = check(lib.dp_tcp_port(self._handle), "TCP engine port")

    def _destroy(self) -> int:
        return lib.dp_tcp_destroy(self._handle)

    def __repr__(self) -> str:
        return f"<TcpEngine {self.host}:{self.port}{' closed' if self.closed else ''}>"

    @property
    def address(self) -> tuple[str, int]:
        return self.host, self.port

    def register(self, buf=None, access: int = ACCESS_RW, *, addr: int | None = None,
                 length: int | None = None, scoped: bool = False) -> TcpRegion:
        """Register memory; ``scoped``: peers WRITE into it only inside windows granted
        to them (:meth:`grant`)."""
        return TcpRegion(self, buf, access, addr=addr, length=length, scoped=scoped)

    def grant(self, peer: int, region: TcpRegion, ranges) -> int:
        """Let peer tag ``peer`` WRITE into the windows ``ranges`` (``(offset, length)``
        pairs from the region's start) of the scoped ``region``; the grant's id, for
        :meth:`ungrant`. Any thread."""
        self._check_open()
        rows = np.asarray(ranges, dtype=np.uint64).reshape(-1, 2).copy()
        if not len(rows):
            raise UsageError("a grant needs at least one window")
        rows[:, 0] += np.uint64(region.addr)
        rows = np.ascontiguousarray(rows)
        out = ffi.new("uint32_t *")
        check(lib.dp_tcp_grant(self._handle, peer, region.rkey,
                               ffi.cast("const uint64_t *", rows.ctypes.data), len(rows), out),
              f"grant peer {peer} {len(rows)} windows of {region!r}")
        return out[0]

    def ungrant(self, grant_id: int) -> bool:
        """End a grant: from the return on, no byte lands in its windows (a WRITE under
        way included). False when it had ended already. Any thread."""
        self._check_open()
        rc = lib.dp_tcp_ungrant(self._handle, grant_id)
        if rc == -errno.ENOENT:
            return False
        check(rc, f"ungrant {grant_id:#x}")
        return True

    def admit(self, peer: int, *, trusted: bool = False) -> Credential:
        """A fresh credential for one connection of ``peer`` (the caller's tag for it;
        admitted connections per tag are capped); ``trusted``: the owner's own (its
        worker), whose WRITEs no scope limits. Any thread."""
        self._check_open()
        check_range("peer", peer, 0, lib.DP_TCP_PEER_TRUSTED - 1)
        if trusted:
            peer |= lib.DP_TCP_PEER_TRUSTED
        secret = os.urandom(SECRET_BYTES)
        out = ffi.new("uint32_t *")
        check(lib.dp_tcp_admit(self._handle, peer, secret, out),
              f"issue a credential for peer {peer}")
        return Credential(out[0], secret)

    def revoke(self, cred: Credential) -> bool:
        """Withdraw an unused credential; False when it was used or unknown."""
        self._check_open()
        rc = lib.dp_tcp_revoke(self._handle, cred.id)
        if rc == -errno.ENOENT:
            return False
        check(rc, f"revoke credential {cred.id:#x}")
        return True

    def stats(self) -> TcpStats:
        """The target side's counters (any thread)."""
        self._check_open()
        out = ffi.new("struct dp_tcp_stats *")
        check(lib.dp_tcp_stats(self._handle, out), "TCP engine stats")
        return TcpStats(out.conns_accepted, out.conns_admitted, out.conns_refused,
                        out.writes, out.bytes, out.refused, out.flushed, out.ack_stalls,
                        out.out_of_scope)

    def cq(self, depth: int) -> TcpCompletionQueue:
        return TcpCompletionQueue(self, depth)

    def connection(self, cq: TcpCompletionQueue, config: TcpConfig | None = None
                   ) -> TcpConnection:
        return TcpConnection(self, cq, config)


class TcpRegion(RegionOwner):
    """Registered memory (lkey == rkey): a buffer-protocol object (kept alive until
    close) or a raw ``addr``/``length`` range the caller keeps alive."""

    _what = "TCP region"

    def __init__(self, engine: TcpEngine, buf=None, access: int = ACCESS_RW, *,
                 addr: int | None = None, length: int | None = None, scoped: bool = False):
        keep, ptr, length = memory_range(buf, access, addr=addr, length=length)
        super().__init__([engine])
        self.scoped = scoped
        info = ffi.new("struct dp_mr_info *")
        flags = int(access) | (lib.DP_TCP_SCOPED if scoped else 0)
        self._registered(check_ptr(lib.dp_tcp_mr_reg(engine._handle, ptr, length, flags,
                                                     info),
                                   f"register {length} bytes on {engine!r}", ffi),
                         engine, info, Access(int(access)), keep)

    def _destroy(self) -> int:
        return lib.dp_tcp_mr_dereg(self._handle)

    def __repr__(self) -> str:
        return f"<TcpRegion {self.length} B>"   # no address, no key: reprs reach logs


class TcpCompletionQueue(CompletionArray):
    """Completions of the connections created on it. ``depth`` bounds the signalled
    items outstanding on it. wait() sleeps in epoll; wake() (any thread) ends it early.
    poll/wait write into one preallocated array: one thread at a time."""

    _what = "TCP completion queue"

    def __init__(self, engine: TcpEngine, depth: int):
        check_range("CQ depth", depth, 1, 1 << 30)
        super().__init__([engine])
        self.engine = engine
        self._init_array(depth)
        self._adopt(check_ptr(lib.dp_tcp_cq_create(engine._handle, depth),
                              f"create a TCP CQ of {depth}", ffi), [engine])

    def _destroy(self) -> int:
        return lib.dp_tcp_cq_destroy(self._handle)

    def _poll_native(self, max_entries: int) -> int:
        return lib.dp_tcp_cq_poll(self._handle, self.wc, max_entries)

    def _wait_native(self, max_entries: int, timeout_ns: int) -> int:
        return lib.dp_tcp_cq_wait(self._handle, self.wc, max_entries, timeout_ns)

    def wake(self) -> None:
        """Make a wait() in progress (or the next one) return now. Any thread."""
        self._check_open()
        check(lib.dp_tcp_cq_wake(self._handle), "wake TCP CQ")


class TcpConnection(Owner):
    """An initiator connection to a remote TcpEngine (see the module docstring for its
    states). ``conn_id`` is what completions carry in ``qp_num``."""

    _what = "TCP connection"

    def __init__(self, engine: TcpEngine, cq: TcpCompletionQueue,
                 config: TcpConfig | None = None):
        if cq.engine is not engine:
            raise UsageError("a TCP connection and its CQ must belong to the same engine")
        config = TcpConfig() if config is None else config
        super().__init__([engine, cq])
        self.engine, self.cq, self.config = engine, cq, config
        self._adopt(check_ptr(lib.dp_tcp_conn_create(engine._handle, cq._handle,
                                                     config._cdata()),
                              "create a TCP connection", ffi), [engine, cq])
        self.conn_id = check(lib.dp_tcp_conn_id(self._handle), "TCP connection id")
        self.remote: tuple[str, int] | None = None
        self._n_posted = ffi.new("uint32_t *")

    def _destroy(self) -> int:
        return lib.dp_tcp_conn_destroy(self._handle)

    def __repr__(self) -> str:
        to = f" to {self.remote[0]}:{self.remote[1]}" if self.remote else ""
        return f"<TcpConnection {self.conn_id}{to}>"

    @property
    def qp_num(self) -> int:
        return self.conn_id

    @property
    def state(self) -> QpState:
        self._check_open()
        return QpState(check(lib.dp_tcp_conn_state(self._handle), "TCP connection state"))

    @property
    def outstanding(self) -> int:
        """Items posted and not yet retired by a completion."""
        self._check_open()
        return check(lib.dp_tcp_conn_outstanding(self._handle), "TCP connection outstanding")

    def connect(self, host: str, port: int, timeout: float = 5.0,
                credential: Credential | None = None) -> None:
        """RESET -> RTS: connect to the engine at host:port within ``timeout`` seconds,
        presenting ``credential`` (issued by that engine; None only for an open one).
        ECONNRESET: the target refused the credential; EACCES: the target could not
        prove it holds it."""
        self._check_open()
        if not isinstance(host, str) or not host:
            raise UsageError(f"host must be a non-empty str, not {host!r}")
        check_range("port", port, 1, 65535)
        if credential is not None:
            check(lib.dp_tcp_conn_set_credential(self._handle, credential.id,
                                                 credential.secret), "set credential")
        check(lib.dp_tcp_conn_connect(self._handle, host.encode(), port, timeout_ns(timeout)),
              f"connect TCP connection {self.conn_id} to {host}:{port}")
        self.remote = (host, port)

    def connect_self(self) -> None:
        """RESET -> RTS to this engine itself, without a socket: a post copies into the
        engine's own regions (checked as a target checks a WRITE), completions as usual."""
        self._check_open()
        check(lib.dp_tcp_conn_connect_self(self._handle),
              f"connect TCP connection {self.conn_id} to its own engine")
        self.remote = ("self", 0)

    def reset(self) -> None:
        """Back to RESET (recovery): the socket closes, outstanding items are forgotten
        without completions."""
        self._check_open()
        check(lib.dp_tcp_conn_reset(self._handle), f"reset TCP connection {self.conn_id}")

    def post_write(self, items, signal_every: int = 1, *, start: int = 0,
                   count: int | None = None) -> int:
        """Post items ``[start, start+count)`` of a WriteBatch (or a sequence of Items)
        with one gathered send; return how many were accepted. Fewer than asked is the
        normal credit limit (poll, then post the rest)."""
        self._check_open()
        batch = items if isinstance(items, WriteBatch) else WriteBatch(items)
        count = batch.n - start if count is None else count
        if start < 0 or count < 0 or start + count > batch.n:
            raise UsageError(f"items [{start}, {start + count}) outside a batch of {batch.n}")
        check_range("signal_every", signal_every, 1, (1 << 32) - 1)
        return self.post_raw(batch.items + start, count, signal_every)

    def post_raw(self, items, count: int, signal_every: int) -> int:
        """post_write over a caller-filled ``struct dp_item`` array, unchecked (hot path).
        ENOTCONN in RESET raises PostError."""
        rc = lib.dp_tcp_post_write(self._handle, items, count, signal_every, self._n_posted)
        posted = self._n_posted[0]
        if rc < 0 and rc != -errno.EAGAIN:
            raise PostError(-rc, f"post {count} WRITEs on TCP connection {self.conn_id}",
                            posted, count)
        return posted
