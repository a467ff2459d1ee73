"""Listen addresses: a bad one is a UsageError naming the setting and its value, before
anything binds. gRPC alone took 127.0.0.1:99999 and listened on 34463 (99999 - 65536)."""

import asyncio
import socket

import grpc
import pytest

from dualpath import metrics, rpc
from dualpath.errors import ConfigError, UsageError


@pytest.mark.parametrize("address", ["127.0.0.1:99999", "127.0.0.1:65536", "nohost",
                                     ":50051", "127.0.0.1:x"])
def test_bad_address_is_refused_naming_the_key(address):
    with pytest.raises(UsageError, match=r"scheduler\.listen = .*port 0\.\.65535"):
        rpc.parse_listen(address, "scheduler.listen")


def test_parse_listen_ipv6_and_port_zero():
    assert rpc.parse_listen("[::1]:0") == ("::1", 0)
    assert rpc.parse_listen("127.0.0.1:65535") == ("127.0.0.1", 65535)


def test_grpc_bind_refuses_an_out_of_range_port_instead_of_wrapping():
    async def go():
        server = grpc.aio.server()
        with pytest.raises(UsageError, match=r"engine\.control_listen = '127\.0\.0\.1:99999'"):
            rpc.bind(server, "127.0.0.1:99999", "engine.control_listen")
        assert rpc.bind(server, "127.0.0.1:0", "engine.control_listen") > 0
        await server.stop(None)

    asyncio.run(go())


def test_metrics_port_in_use_is_a_usage_error_naming_the_key():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        listen = f"127.0.0.1:{busy.getsockname()[1]}"
        with pytest.raises(UsageError, match=r"scheduler\.metrics_listen = .*cannot listen"):
            metrics.start_metrics_server(listen, metrics.new_registry(process=False),
                                         "scheduler.metrics_listen")


@pytest.mark.parametrize("host,loopback", [("127.0.0.1", True), ("127.1.2.3", True),
                                           ("::1", True), ("localhost", True),
                                           ("0.0.0.0", False), ("::", False),
                                           ("10.0.0.1", False), ("node7.example", False)])
def test_is_loopback(host, loopback):
    assert rpc.is_loopback(host) is loopback


def test_plaintext_grpc_listens_on_loopback_only():
    # Anyone who reaches a plaintext port may call everything on it (ExchangeEndpoint
    # hands out region addresses and data-plane credentials): loopback only.
    async def go():
        server = grpc.aio.server()
        for address in ("0.0.0.0:0", "[::]:0", "10.1.2.3:0"):
            with pytest.raises(ConfigError, match=r"engine\.control_listen = .*plaintext "
                                                  r"gRPC \(tls\.plaintext = true\) listens "
                                                  r"on loopback only"):
                rpc.bind(server, address, "engine.control_listen")
        assert rpc.bind(server, "127.0.0.1:0", "engine.control_listen") > 0
        # With TLS credentials any address is allowed (the check is plaintext's alone).
        assert rpc.bind(server, "0.0.0.0:0", "engine.control_listen",
                        grpc.local_server_credentials()) > 0
        await server.stop(None)

    asyncio.run(go())


def test_the_metrics_server_bounds_its_threads_and_lets_silent_clients_go():
    # The audit (issue 38): prometheus-client's server started a thread per connection
    # with no timeout; 50 silent connections here held 50 threads for ever on
    # b658318. Now at most MAX_SCRAPES are served (the rest closed at accept), each
    # silent one let go after SCRAPE_TIMEOUT_S, and a scrape after them is answered.
    import socket
    import threading
    import time
    import urllib.request

    from dualpath import metrics

    reg = metrics.new_registry(process=False)
    metrics.counter(reg, "dualpath_test_scrapes_total", "x").inc()
    srv = metrics.start_metrics_server("127.0.0.1:0", reg)
    before = threading.active_count()
    held = [socket.create_connection(("127.0.0.1", srv.port), timeout=30)
            for _ in range(50)]
    try:
        time.sleep(0.5)                      # the accepts happen (not a timing assertion)
        # (each served connection: its thread and its deadline's timer)
        assert threading.active_count() <= before + 2 * metrics.MAX_SCRAPES
        for s in held[metrics.MAX_SCRAPES:]:  # the ones past the cap: closed unanswered
            assert s.recv(1) == b""
    finally:
        for s in held:
            s.close()
    body = ""
    for _ in range(200):                     # until the held slots are let go
        try:
            with urllib.request.urlopen(srv.url, timeout=30) as r:
                body = r.read().decode()
                break
        except OSError:
            time.sleep(0.1)
    srv.close()
    assert "dualpath_test_scrapes_total 1.0" in body
