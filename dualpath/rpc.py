"""Listen addresses and gRPC server binding, shared by the scheduler and node daemons.

gRPC itself takes ``127.0.0.1:99999`` and quietly listens on port 34463 (the port wraps
modulo 65536), so every listen address is checked here first and a bad one is a
:class:`UsageError` naming the config key, its value and what is allowed.
"""

from __future__ import annotations

import ipaddress
from typing import TYPE_CHECKING

from dualpath.errors import ConfigError, UsageError

if TYPE_CHECKING:
    import grpc


def parse_listen(listen: str, what: str = "metrics_listen") -> tuple[str, int]:
    """``host:port`` (IPv6 as ``[::1]:port``, port 0..65535) -> (host, port)."""
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or not host or int(port) > 65535:
        raise ConfigError(f"{what} = {listen!r}: expected host:port with port 0..65535 "
                         "(0 = any free port), e.g. 127.0.0.1:9464")
    return host.strip("[]"), int(port)


def is_loopback(host: str) -> bool:
    """``host`` (a listen address's host part) is loopback: 127.0.0.0/8, ::1 or
    localhost; a wildcard (0.0.0.0, ::) is not."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_free(listen: str, what: str) -> None:
    """Refuse (UsageError, at once) a listen address another process holds, naming it:
    a daemon that finds its port taken only after minutes of start-up helps no one."""
    import errno
    import socket

    host, port = parse_listen(listen, what)
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            why = ("another process listens there (vLLM's own server defaults to 8000)"
                   if e.errno == errno.EADDRINUSE else e.strerror)
            raise UsageError(f"{what} = {listen}: cannot listen there: {why}; choose "
                             "another address or stop that process") from None


def check_listen(section: str, optional: tuple[str, ...] = (), **listens: str) -> None:
    """For a config section's validate(): each ``key=value`` is host:port; a key named
    in ``optional`` may also be empty (off)."""
    for name, value in listens.items():
        if value or name not in optional:
            parse_listen(value, f"config key {section}.{name}")


def bind(server: grpc.aio.Server, address: str, what: str,
         credentials: grpc.ServerCredentials | None = None) -> int:
    """Add ``address`` to ``server`` (TLS when ``credentials``); the bound port.
    ``what`` names the setting in errors (e.g. ``scheduler.listen``). Plaintext
    (``credentials`` None: ``tls.plaintext = true``) serves loopback only: anyone who
    reaches a plaintext port may call everything on it, keys and region addresses
    included, so a non-loopback or wildcard address is refused (ConfigError)."""
    host, _ = parse_listen(address, what)
    if credentials is None and not is_loopback(host):
        raise ConfigError(f"{what} = {address!r}: plaintext gRPC (tls.plaintext = true) "
                          "listens on loopback only (127.0.0.0/8, ::1, localhost); use "
                          "mutual TLS ([tls] ca_file, cert_file, key_file) for any other "
                          "address")
    try:
        return (server.add_secure_port(address, credentials) if credentials is not None
                else server.add_insecure_port(address))
    except RuntimeError as e:
        raise UsageError(f"{what} = {address!r}: cannot listen ({e})") from None


#: The connection bounds of a gRPC port when no ``[grpc]`` section says otherwise
#: (dualpath.config_sections.GrpcConfig takes its defaults from here).
MAX_CONNECTIONS = 1024
HANDSHAKE_TIMEOUT_S = 10.0
IDLE_TIMEOUT_S = 300.0


def server_options(limits=None) -> list[tuple[str, object]]:
    """The options every gRPC server of ours is made with: the keepalive its clients'
    pings need (:data:`SERVER_KEEPALIVE`), one port per process (no SO_REUSEPORT), and
    the connection bounds of ``limits`` (a ``[grpc]`` section; the defaults above when
    None): gRPC closes a connection past ``max_connections`` at once, one still in its
    handshake after ``handshake_timeout_s``, and one idle for ``idle_timeout_s``."""
    cap, hs, idle = ((MAX_CONNECTIONS, HANDSHAKE_TIMEOUT_S, IDLE_TIMEOUT_S) if limits is None
                     else (limits.max_connections, limits.handshake_timeout_s,
                           limits.idle_timeout_s))
    return [("grpc.so_reuseport", 0), *SERVER_KEEPALIVE,
            ("grpc.max_allowed_incoming_connections", int(cap)),
            ("grpc.server_handshake_timeout_ms", int(hs * 1000)),
            ("grpc.max_connection_idle_ms", int(idle * 1000))]


# Keepalive of long-lived channels (leaders, peer channels between nodes, submitters and
# replay clients): ping an idle connection every 10 s and drop it when a ping is not
# answered within 5 s, so a peer that vanished without a FIN (host down, a partition) is
# noticed and the channel reconnects once the network heals, instead of waiting for TCP's
# own timeouts (minutes). Every server such a channel reaches allows those pings
# (SERVER_KEEPALIVE); without it gRPC's default policy answers them with GOAWAY.
CLIENT_KEEPALIVE: tuple[tuple[str, int], ...] = (
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
)
SERVER_KEEPALIVE: tuple[tuple[str, int], ...] = (
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_ping_strikes", 0),
)
#: Options of long-lived channels between daemons: reconnect quickly after a peer
#: restarts (gRPC's default backoff grows to minutes), and the keepalive above. Not
#: ``grpc.min_reconnect_backoff_ms``: gRPC also takes it as the least time a connection
#: attempt gets (default 20 s), and a TLS handshake on a slow host (the SoftRoCE guest:
#: 0.3-0.5 s) then times out before the server's SETTINGS frame, every first time.
CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
    *CLIENT_KEEPALIVE,
)
