"""Clients check who answers, not only that a certificate of the cluster's CA does
(issue 38): the audit served the scheduler's port with the front end's *client*
certificate and every node took its orders from it (over 1,100 Fetch calls each).

A certificate carries its identity twice: the URI SAN spiffe://<td>/<role>/<name> that
servers read, and the DNS name <name>.<role>.<td> that a client's channel verifies the
server against (tls.identity_dns). A wrong server fails the call UNAVAILABLE with a
message naming the identity expected and the one presented. Each test below passes the
impostor's call on the code before this change (no expectation existed)."""

from __future__ import annotations

import asyncio
import shutil

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from dualpath import metrics, tls
from dualpath.config import load
from dualpath.scheduler.client import SchedulerClient
from dualpath.transfer.oob_grpc import GrpcChannels
from dualpath.v1 import scheduler_pb2 as pb
from tests.integration.test_sched_tls import server as scheduler_as

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None,
                                reason="the openssl command is needed to make test certs "
                                "(tools/install-system-packages.sh installs it)")


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return tls.make_cluster_pki(tmp_path_factory.mktemp("pki"),
                                ["scheduler/scheduler", "client/fe", "node/d0", "node/d1"])


def test_a_node_refuses_a_scheduler_that_shows_another_identity(pki):
    cfg = load(None, {})

    async def register(server_identity):
        async with scheduler_as(pki, identity=server_identity) as addr, \
                SchedulerClient.from_config(cfg.scheduler_client, pki.config("node/d0"),
                                            address=addr) as c:
            try:
                r = await c.register_group("d0", pb.ENGINE_ROLE_DECODE, [pb.EngineInfo(
                    engine_id="d0/e0", rank=0, node_id="d0", hbm_bytes=1 << 30)])
                return "OK", r.lease_id
            except grpc.aio.AioRpcError as e:
                return e.code().name, e.details()

    code, lease = asyncio.run(register("scheduler/scheduler"))
    assert code == "OK" and lease > 0
    code, details = asyncio.run(register("client/fe"))      # the impostor
    assert code == "UNAVAILABLE", details
    assert "is client/fe, not the expected scheduler/scheduler" in details, details
    assert "scheduler.scheduler.dualpath" in details         # what its certificate lacks


def test_a_node_refuses_a_peer_other_than_the_one_the_scheduler_named(pki):
    # PE -> DE: the assignment names the DE's identity (the owner of its group); a
    # server at that address with another node's certificate is refused, and the node's
    # error names both (a health-only server: the right one answers UNIMPLEMENTED).
    from dualpath.paths.errors import PeerUnavailable
    from dualpath.paths.peers import PeerClient

    async def body():
        srv = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), srv)
        port = srv.add_secure_port("127.0.0.1:0",
                                   tls.server_credentials(pki.config("node/d1")))
        await srv.start()
        addr = f"127.0.0.1:{port}"
        out = []
        channels = GrpcChannels(pki.config("node/d0"))
        peers = PeerClient(channels)
        try:
            for expect in ("", "node/d1", "node/d0"):
                peers.expect(addr, expect)
                try:
                    await health_pb2_grpc.HealthStub(channels.channel(addr)).Check(
                        health_pb2.HealthCheckRequest(), timeout=10)
                    health_ok = "OK"
                except grpc.aio.AioRpcError as e:
                    health_ok = e.code().name
                try:
                    await peers.stop(addr, "r", 1, timeout_s=10)
                except PeerUnavailable as e:
                    out.append((health_ok, str(e)))
            # A call that names whom it is for (a fence asking the node that prepared
            # the request; a result for its submitter) checks that, whatever the
            # address's own expectation says.
            peers.expect(addr, "node/d1")
            for expect in ("node/d1", "node/d0"):
                try:
                    await peers.stop(addr, "r", 1, timeout_s=10, expect=expect)
                except PeerUnavailable as e:
                    out.append(str(e))
        finally:
            await channels.close()
            await srv.stop(None)
        return out

    unchecked, right, wrong = asyncio.run(body())[:3]
    assert unchecked[0] == right[0] == "OK" and "UNIMPLEMENTED" in right[1]
    assert wrong[0] == "UNAVAILABLE"
    assert "is node/d1, not the expected node/d0 (its certificate lacks the DNS name " \
           "d0.node.dualpath)" in wrong[1], wrong
    named_right, named_wrong = asyncio.run(body())[3:]
    assert "UNIMPLEMENTED" in named_right
    assert "is node/d1, not the expected node/d0" in named_wrong


def test_the_expected_scheduler_identity_is_a_checked_config_key():
    from dualpath.errors import ConfigError
    with pytest.raises(ConfigError, match="tls.scheduler_identity = 'node/x': the role "
                                          "must be scheduler"):
        load(None, {"tls.plaintext": True, "tls.scheduler_identity": "node/x"})
    with pytest.raises(ConfigError, match="tls.scheduler_identity = 'sched': expected ROLE/NAME"):
        load(None, {"tls.plaintext": True, "tls.scheduler_identity": "sched"})


def test_only_node_identities_put_tokens_into_a_live_request(pki):
    # The audit (issue 38): any cluster identity could call the front end's result sink
    # and put tokens into another user's live request (the user received them). On
    # b658318 the client's Partial below reached the request.
    from dualpath.scheduler.generate import Generator
    from dualpath.v1 import node_pb2, node_pb2_grpc

    async def body():
        gen = await Generator("127.0.0.1:1", pki.config("client/fe"),
                              pki.config("client/fe")).start()
        got = []
        gen._partials["r-live"] = lambda *a: got.append(a)
        out = {}
        try:
            for who in ("client/fe", "node/d0"):
                async with tls.channel(gen.sink, pki.config(who)) as ch:
                    try:
                        await node_pb2_grpc.ReplaySinkStub(ch).Partial(node_pb2.PartialTokens(
                            request_id="r-live", attempt=1, offset=0, token_ids=[666]),
                            timeout=10)
                        out[who] = "OK"
                    except grpc.aio.AioRpcError as e:
                        out[who] = f"{e.code().name}: {e.details()}"
        finally:
            await gen.close()
        return out, got

    out, got = asyncio.run(body())
    assert out["client/fe"].startswith("PERMISSION_DENIED: the generation sink takes calls "
                                       "from node identities only, not client/fe"), out
    assert out["node/d0"] == "OK" and len(got) == 1 and got[0][2] == [666]


def test_metrics_are_served_over_https_when_asked(pki):
    # Issue 38: /metrics was plain HTTP only. With tls.metrics_https the scrape needs
    # TLS (verified against the cluster CA); a plain-HTTP scrape gets no figures.
    import dataclasses
    import ssl
    import urllib.request

    from dualpath.errors import ConfigError

    reg = metrics.new_registry(process=False)
    metrics.counter(reg, "dualpath_test_https_total", "x").inc()
    cfg = dataclasses.replace(pki.config("node/d0"), metrics_https=True)
    srv = metrics.start_metrics_server("127.0.0.1:0", reg, ssl_context=tls.metrics_context(cfg))
    try:
        assert srv.url.startswith("https://")
        ctx = ssl.create_default_context(cafile=pki.ca_cert)
        with urllib.request.urlopen(srv.url, context=ctx, timeout=20) as r:
            assert "dualpath_test_https_total 1.0" in r.read().decode()
        with pytest.raises(OSError):
            urllib.request.urlopen(srv.url.replace("https://", "http://"), timeout=20).read()
    finally:
        srv.close()
    with pytest.raises(ConfigError, match="tls.metrics_https = true needs tls.cert_file"):
        load(None, {"tls.plaintext": True, "tls.metrics_https": True})
