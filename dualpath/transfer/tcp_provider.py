"""The TCP provider behind the TransferEngine: one :class:`~dualpath.tcp.TcpEngine`
(listener, regions, server thread) and one completion queue for every connection.

Endpoints: the passive side answers with its listen address and a fresh credential for
that one connection (``host:port#<id>:<secret>``, hex; dualpath.tcp.Credential): the
engine admits a connection only with a credential it issued, and the endpoint travels in
the ConnectReply of the authenticated out-of-band exchange, so only a peer that passed
that exchange can connect at all. The active side's endpoint is empty. ``accept``
withdraws the unused credential of the same (peer, connection) it issued before, so a
peer holds at most connections_per_peer of them; ``forget`` withdraws all of a peer's.

Scope: a region registered ``scoped`` takes a peer's WRITEs only inside windows granted
to that peer's admission tag (csrc/tcp_scope.c); the tag of a peer named by ``trust``
(the node's own worker) is admitted trusted, unscoped.
"""

from __future__ import annotations

from dualpath._native import ffi
from dualpath.dp import WorkCompletion
from dualpath.errors import UsageError
from dualpath.tcp import ACCESS_RW, SECRET_BYTES, Credential, TcpConfig, TcpEngine
from dualpath.transfer.provider import MAX_CONNECTIONS_PER_PEER, Admissions, Connection, Provider


def encode_address(host: str, port: int, cred: Credential | None = None) -> bytes:
    addr = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if cred is not None:
        addr += f"#{cred.id:08x}:{cred.secret.hex()}"
    return addr.encode()


def decode_address(data: bytes) -> tuple[str, int, Credential | None]:
    """``host:port[#id:secret]`` -> (host, port, credential or None)."""
    try:
        text = data.decode()
        addr, sep, cred = text.partition("#")
        host, hsep, port = addr.rpartition(":")
        credential = None
        if sep:
            cid, _, secret = cred.partition(":")
            credential = Credential(int(cid, 16), bytes.fromhex(secret))
    except (UnicodeDecodeError, ValueError):
        raise UsageError(f"not a TCP provider endpoint (host:port#id:secret): "
                         f"{len(data)} bytes") from None
    if not hsep or not port.isdigit() or not host or (sep and len(credential.secret) !=
                                                      SECRET_BYTES):
        raise UsageError(f"not a TCP provider endpoint (host:port#id:secret): "
                         f"{len(data)} bytes")
    return host.strip("[]"), int(port), credential


class TcpProvider(Provider):
    """Listens on ``host:port`` (0 = any free port) and advertises ``advertise`` (default:
    ``host``) to peers."""

    kind = "tcp"
    scopes = True
    poll_slice_s = 0.05     # wait() sleeps in epoll and wake() interrupts it
    copies_to_self = True

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, cq_depth: int = 4096,
                 sockbuf_bytes: int = 0, user_timeout_ms: int = 0, advertise: str = "",
                 open: bool = False):
        # ``open``: no admission (bench/dataplane.py's unauthenticated baseline only).
        self.engine = TcpEngine(host, port, sockbuf_bytes=sockbuf_bytes, open=open,
                                max_conns_per_peer=MAX_CONNECTIONS_PER_PEER)
        try:
            self.cq = self.engine.cq(cq_depth)
        except BaseException:
            self.engine.close()
            raise
        self._conn_config = {"sockbuf_bytes": sockbuf_bytes, "user_timeout_ms": user_timeout_ms}
        self._advertise = (advertise or host, self.engine.port)
        self.address = encode_address(*self._advertise)
        self._admissions = Admissions()
        self._creds: dict[tuple[str, int], Credential] = {}   # unused, by (peer, index)
        self._trusted: set[str] = set()
        self.description = (f"tcp listening on {host}:{self.engine.port}, "
                            + ("OPEN (no admission)" if open else "admission by credential"))

    def register(self, buf=None, *, addr=None, length=None, scoped=False):
        return self.engine.register(buf, ACCESS_RW, addr=addr, length=length,
                                    scoped=scoped and not self.engine.open)

    def grant(self, peer: str, region, ranges) -> int | None:
        if not region.scoped:
            return None
        return self.engine.grant(self._admissions.tag(peer), region, ranges)

    def ungrant(self, grant) -> None:
        if grant is not None:
            self.engine.ungrant(grant)

    def target_stats(self) -> dict[str, int]:
        if self.engine.closed:
            return {}
        st = self.engine.stats()
        return {"refused": st.refused, "out_of_scope": st.out_of_scope}

    def trust(self, peer: str) -> None:
        self._trusted.add(peer)

    def connection(self, max_send_wr: int) -> Connection:
        return _TcpConnection(self, TcpConfig(max_send_wr=max_send_wr, **self._conn_config))

    def accept(self, peer: str, index: int, remote: bytes) -> bytes:
        tag = self._admissions.admit(peer, index)
        if self.engine.open:
            return self.address
        old = self._creds.pop((peer, index), None)
        if old is not None:
            self.engine.revoke(old)
        cred = self._creds[(peer, index)] = self.engine.admit(tag,
                                                              trusted=peer in self._trusted)
        return encode_address(*self._advertise, cred)

    def forget(self, peer: str) -> None:
        for key in [k for k in self._creds if k[0] == peer]:
            self.engine.revoke(self._creds.pop(key))
        self._admissions.forget(peer)

    def wait(self, timeout: float) -> list[WorkCompletion]:
        return self.cq.wait(timeout)

    def wake(self) -> None:
        self.cq.wake()

    def close(self) -> None:
        self.engine.close()


class _TcpConnection(Connection):
    def __init__(self, provider: TcpProvider, config: TcpConfig):
        self.conn = provider.engine.connection(provider.cq, config)
        self.conn_id = self.conn.conn_id
        self.max_send_wr = config.max_send_wr
        self.items = ffi.new("struct dp_item[]", config.max_send_wr)

    def endpoint(self) -> bytes:
        return b""

    def connect(self, remote: bytes, timeout: float) -> None:
        host, port, cred = decode_address(remote)
        self.conn.connect(host, port, timeout, credential=cred)

    def connect_self(self) -> None:
        self.conn.connect_self()

    def reset(self) -> None:
        self.conn.reset()

    def post(self, count: int, signal_every: int) -> int:
        return self.conn.post_raw(self.items, count, signal_every)

    def close(self) -> None:
        self.conn.close()
