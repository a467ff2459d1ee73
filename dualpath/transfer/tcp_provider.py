"""The TCP provider behind the TransferEngine: one :class:`~dualpath.tcp.TcpEngine`
(listener, regions, server thread) and one completion queue for every connection.

Endpoints: the passive side answers with its listen address (``host:port``); the active
side's connection needs nothing from us, so its endpoint is empty. ``accept`` makes
nothing: the peer's connection simply arrives at the listener.
"""

from __future__ import annotations

from dualpath._native import ffi
from dualpath.errors import UsageError
from dualpath.tcp import ACCESS_RW, TcpConfig, TcpEngine
from dualpath.transfer.provider import Connection, Provider
from dualpath.verbs import Completion


def encode_address(host: str, port: int) -> bytes:
    return (f"[{host}]:{port}" if ":" in host else f"{host}:{port}").encode()


def decode_address(data: bytes) -> tuple[str, int]:
    host, sep, port = data.decode().rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise UsageError(f"not a TCP provider endpoint (host:port): {data!r}")
    return host.strip("[]"), int(port)


class TcpProvider(Provider):
    """Listens on ``host:port`` (0 = any free port) and advertises ``advertise`` (default:
    ``host``) to peers."""

    kind = "tcp"
    poll_slice_s = 0.05     # wait() sleeps in epoll and wake() interrupts it

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, cq_depth: int = 4096,
                 sockbuf_bytes: int = 0, user_timeout_ms: int = 0, advertise: str = ""):
        self.engine = TcpEngine(host, port, sockbuf_bytes=sockbuf_bytes)
        try:
            self.cq = self.engine.cq(cq_depth)
        except BaseException:
            self.engine.close()
            raise
        self._conn_config = {"sockbuf_bytes": sockbuf_bytes, "user_timeout_ms": user_timeout_ms}
        self.address = encode_address(advertise or host, self.engine.port)
        self.description = f"tcp listening on {host}:{self.engine.port}"

    def register(self, buf=None, *, addr=None, length=None):
        return self.engine.register(buf, ACCESS_RW, addr=addr, length=length)

    def connection(self, max_send_wr: int) -> Connection:
        return _TcpConnection(self, TcpConfig(max_send_wr=max_send_wr, **self._conn_config))

    def accept(self, peer: str, index: int, remote: bytes) -> bytes:
        return self.address

    def forget(self, peer: str) -> None:
        pass

    def wait(self, timeout: float) -> list[Completion]:
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
        host, port = decode_address(remote)
        self.conn.connect(host, port, timeout)

    def reset(self) -> None:
        self.conn.reset()

    def post(self, count: int, signal_every: int) -> int:
        return self.conn.post_raw(self.items, count, signal_every)

    def close(self) -> None:
        self.conn.close()
