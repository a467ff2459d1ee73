"""Transport security, identities and admin auth on the scheduler: one [tls] section,
mutual TLS always (a plaintext client, a client without a certificate, or one from
another CA is refused at the handshake), groups bound to the node identity that
registered them, admin calls by token or admin certificate, certificates reloaded on
change, clear start-up errors. Attackers run in a network namespace of their own
(tests/netns.py). Certificates are made at test time with the openssl command
(dualpath.tls.make_cluster_pki); no key is committed."""

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from dualpath import cli, config, metrics, tls
from dualpath.errors import ConfigError
from dualpath.scheduler.client import SchedulerClient
from dualpath.scheduler.service import SchedulerService, create_server
from dualpath.v1 import admin_pb2
from dualpath.v1 import scheduler_pb2 as pb
from tests import netns
from tests.integration.test_sched_cli import DaemonLog

TOKEN = "tls-admin-token"
IDENTITIES = ("scheduler/sched", "node/d0", "node/d1", "admin/ops", "client/fe")

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None,
                                reason="the openssl command is needed to make test certs "
                                "(tools/install-system-packages.sh installs it)")


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return tls.make_cluster_pki(tmp_path_factory.mktemp("pki"), IDENTITIES,
                                foreign=("node/d0",))


@contextlib.asynccontextmanager
async def server(pki, token=TOKEN, identity="scheduler/sched"):
    svc = SchedulerService(registry=metrics.new_registry(process=False))
    srv, port = create_server("127.0.0.1:0", svc, admin_token=token,
                              credentials=tls.server_credentials(pki.config(identity)))
    await srv.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await srv.stop(None)


def client(addr, pki, identity, token=None):
    return SchedulerClient(addr, credentials=tls.channel_credentials(pki.config(identity)),
                           admin_token=token, timeout_s=10)


async def code(coro):
    try:
        await coro
    except grpc.aio.AioRpcError as e:
        return e.code().name
    return "OK"


def de(group, node=None):
    """One decode engine as node ``group`` names it (a node identity registers its own
    group, engines and node: issue 38)."""
    node = group if node is None else node
    return [pb.EngineInfo(engine_id=f"{node}/e0", rank=0, node_id=node, hbm_bytes=1 << 30)]


def test_handshake_refuses_plaintext_certless_and_foreign_clients(pki):
    async def body():
        async with server(pki) as addr:
            async with client(addr, pki, "client/fe") as c:
                assert await code(c.submit([pb.RequestSpec(prompt_tokens=10)])) == "OK"
            ca = Path(pki.ca_cert).read_bytes()
            for creds in (None,                                  # plaintext
                          grpc.ssl_channel_credentials(ca),      # no client certificate
                          tls.channel_credentials(pki.config("other:node/d0"))):  # other CA
                async with SchedulerClient(addr, credentials=creds, timeout_s=10) as c:
                    assert await code(c.submit([pb.RequestSpec(prompt_tokens=1)])) == \
                        "UNAVAILABLE"

    asyncio.run(body())


def test_a_group_is_bound_to_the_identity_that_registered_it(pki):
    async def body():
        async with server(pki) as addr, client(addr, pki, "node/d0") as d0, \
                client(addr, pki, "node/d1") as d1, client(addr, pki, "client/fe") as fe:
            lease = (await d0.register_group("d0", pb.ENGINE_ROLE_DECODE, de("d0"))).lease_id
            # Another node cannot take over d0's lease, fetch or report for it.
            assert await code(d1.register_group("d0", pb.ENGINE_ROLE_DECODE,
                                                de("d0", "x"))) == "PERMISSION_DENIED"
            assert await code(d1.fetch("d0", lease, [])) == "PERMISSION_DENIED"
            assert await code(d1.report("d0", lease, [])) == "PERMISSION_DENIED"
            # ... nor release it (issue 12's graceful shutdown), and no identity but a
            # node's releases at all.
            assert await code(d1.release_group("d0", lease)) == "PERMISSION_DENIED"
            assert await code(fe.release_group("d0", lease)) == "PERMISSION_DENIED"
            # Submitters read results; ListRequests and Cancel are admin calls.
            assert await code(fe.get_results(["x"])) == "OK"
            assert await code(fe.list_requests()) == "PERMISSION_DENIED"
            assert await code(d1.cancel(["x"])) == "PERMISSION_DENIED"
            # Only node certificates register at all.
            assert await code(fe.register_group("fe", pb.ENGINE_ROLE_DECODE, de("fe"))) == \
                "PERMISSION_DENIED"
            # d0's lease is intact; d0 restarted (same identity) may register again.
            assert await code(d0.fetch("d0", lease, [])) == "OK"
            again = await d0.register_group("d0", pb.ENGINE_ROLE_DECODE, de("d0"))
            assert again.lease_id > lease
            # Its own release works (idempotent for the replaced lease).
            assert (await d0.release_group("d0", lease)).requeued_requests == 0
            assert await code(d0.release_group("d0", again.lease_id)) == "OK"

    asyncio.run(body())


def test_a_node_registers_only_its_own_group_engines_and_node(pki):
    # The audit (issue 38): a node registered a group naming another node's engine ids;
    # the real node, restarted, was refused (ALREADY_EXISTS) until the squatter let go.
    # On b658318 each of the three squats below registered.
    async def body():
        async with server(pki) as addr, client(addr, pki, "node/d0") as d0, \
                client(addr, pki, "node/d1") as d1:
            squats = [de("d0"),                                  # d0's engine on d0
                      [pb.EngineInfo(engine_id="d1/e0", rank=0, node_id="d0",
                                     hbm_bytes=1 << 30)],         # its own engine, on d0
                      [pb.EngineInfo(engine_id="e0", rank=0, node_id="d1",
                                     hbm_bytes=1 << 30)]]         # an unnamed engine id
            for engines in squats:
                with pytest.raises(grpc.aio.AioRpcError) as ei:
                    await d1.register_group("d1", pb.ENGINE_ROLE_DECODE, engines)
                assert ei.value.code() == grpc.StatusCode.PERMISSION_DENIED
                assert "node/d1 registers only group 'd1' with engines 'd1/...' on node " \
                       "'d1'" in ei.value.details()
            # The real d0 registers its own, and d1 its own.
            assert await code(d0.register_group("d0", pb.ENGINE_ROLE_DECODE, de("d0"))) == "OK"
            assert await code(d1.register_group("d1", pb.ENGINE_ROLE_DECODE, de("d1"))) == "OK"

    asyncio.run(body())


def test_a_submitter_withdraws_its_own_requests_and_no_others(pki):
    # Issue 38: a front end whose client hangs up must free what the request holds in
    # the cluster; only an admin could cancel before (b658318 has no such call).
    async def body():
        async with server(pki) as addr, client(addr, pki, "client/fe") as fe, \
                client(addr, pki, "node/d1") as other, \
                client(addr, pki, "admin/ops", TOKEN) as ops:
            await fe.submit([pb.RequestSpec(request_id=f"fe-{i}", prompt_tokens=10)
                             for i in range(2)])
            mine = pb.WithdrawRequestsRequest(request_ids=["fe-0", "nope"])
            theirs = await other.scheduler.WithdrawRequests(mine, timeout=10)
            assert list(theirs.withdrawn_request_ids) == []       # not its requests
            got = await fe.scheduler.WithdrawRequests(mine, timeout=10)
            assert list(got.withdrawn_request_ids) == ["fe-0"]
            again = await fe.scheduler.WithdrawRequests(mine, timeout=10)
            assert list(again.withdrawn_request_ids) == []        # ended already
            live = {r.request_id for r in (await ops.list_requests(all=True)).requests}
            assert live == {"fe-1"}

    asyncio.run(body())


def test_assignments_name_the_decode_node_and_the_submitter(pki):
    # Issue 38: the assignment names who the nodes must deal with: the owner of the DE's
    # group (the PE lets only it stop the prefill) and the submitter (the DE's sink).
    async def body():
        async with server(pki) as addr, client(addr, pki, "node/d0") as d0, \
                client(addr, pki, "node/d1") as d1, client(addr, pki, "client/fe") as fe:
            dl = (await d0.register_group("d0", pb.ENGINE_ROLE_DECODE, de("d0"))).lease_id
            pl = (await d1.register_group("d1", pb.ENGINE_ROLE_PREFILL, [pb.EngineInfo(
                engine_id="d1/e0", rank=0, node_id="d1")])).lease_id
            await fe.submit([pb.RequestSpec(prompt_tokens=10, max_new_tokens=1)])
            free = [pb.EngineStatus(engine_id="d0/e0", free_hbm_bytes=1 << 30)]
            (a,) = (await d0.fetch("d0", dl, free)).assignments
            assert a.decode_identity == "node/d0"
            assert a.submitter_identity == "client/fe"          # whom its tokens go to
            (a,) = (await d1.fetch("d1", pl, [pb.EngineStatus(engine_id="d1/e0")])
                    ).assignments
            assert a.decode_identity == "node/d0" and a.submitter_identity == "client/fe"

    asyncio.run(body())


def test_admin_calls_take_the_token_or_an_admin_certificate(pki):
    async def body():
        async with server(pki) as addr:
            async with client(addr, pki, "admin/ops") as c:   # no token: the cert suffices
                assert await code(c.stats()) == "OK"
            async with client(addr, pki, "node/d0") as c:
                assert await code(c.stats()) == "PERMISSION_DENIED"
            async with client(addr, pki, "node/d0", token="wrong") as c:
                assert await code(c.stats()) == "PERMISSION_DENIED"
            async with client(addr, pki, "node/d0", token=TOKEN) as c:
                assert await code(c.stats()) == "OK"
                # A malformed header (not "Bearer ...") counts as no token.
                assert await code(c.admin.Stats(admin_pb2.StatsRequest(), metadata=(
                    ("authorization", TOKEN),))) == "PERMISSION_DENIED"
        async with server(pki, token=None) as addr, client(addr, pki, "client/fe",
                                                           token=TOKEN) as c:
            assert await code(c.stats()) == "PERMISSION_DENIED"

    asyncio.run(body())


def test_server_certificates_are_reloaded_when_the_files_change(pki, tmp_path):
    # The scheduler's files are replaced by ones from a new CA: the next handshake uses
    # them (gRPC asks the fetcher at each handshake; no timing involved).
    new = tls.make_cluster_pki(tmp_path / "new", ("scheduler/sched", "client/fe"))
    live = tmp_path / "live"
    live.mkdir()
    for name, src in (("ca.crt", pki.ca_cert), ("s.crt", pki.certs["scheduler/sched"][0]),
                      ("s.key", pki.certs["scheduler/sched"][1])):
        shutil.copy(src, live / name)
    os.chmod(live / "s.key", 0o600)
    cfg = tls.TlsConfig(ca_file=str(live / "ca.crt"), cert_file=str(live / "s.crt"),
                        key_file=str(live / "s.key"))

    async def body():
        svc = SchedulerService(registry=metrics.new_registry(process=False))
        srv, port = create_server("127.0.0.1:0", svc, credentials=tls.server_credentials(cfg))
        await srv.start()
        addr = f"127.0.0.1:{port}"
        try:
            async with client(addr, pki, "client/fe") as c:
                assert await code(c.submit([pb.RequestSpec(prompt_tokens=1)])) == "OK"
            for name, src in (("ca.crt", new.ca_cert),
                              ("s.crt", new.certs["scheduler/sched"][0]),
                              ("s.key", new.certs["scheduler/sched"][1])):
                shutil.copy(src, live / f"{name}.tmp")
                os.replace(live / f"{name}.tmp", live / name)
            async with client(addr, new, "client/fe") as c:
                assert await code(c.submit([pb.RequestSpec(prompt_tokens=1)])) == "OK"
            async with client(addr, pki, "client/fe") as c:   # the old CA: refused now
                assert await code(c.submit([pb.RequestSpec(prompt_tokens=1)])) == \
                    "UNAVAILABLE"
        finally:
            await srv.stop(None)

    asyncio.run(body())


def test_start_up_errors_name_the_key_and_the_file(pki, tmp_path):
    cert, key_path = pki.certs["node/d0"]
    ok = {"ca_file": pki.ca_cert, "cert_file": cert, "key_file": key_path}
    with pytest.raises(ConfigError, match="no TLS configured: set tls.ca_file"):
        tls.server_credentials(tls.TlsConfig())
    with pytest.raises(ConfigError, match=r"tls.ca_file = .*missing.crt.*cannot read"):
        tls.server_credentials(tls.TlsConfig(**{**ok, "ca_file": str(tmp_path / "missing.crt")}))
    loose = tmp_path / "loose.key"
    shutil.copy(key_path, loose)
    os.chmod(loose, 0o644)
    with pytest.raises(ConfigError, match=r"readable by every user \(mode 0644\); chmod 600"):
        tls.channel_credentials(tls.TlsConfig(**{**ok, "key_file": str(loose)}))
    with pytest.raises(ConfigError, match="is not the key of tls.cert_file"):
        tls.server_credentials(tls.TlsConfig(**{**ok, "key_file": pki.certs["node/d1"][1]}))
    junk = tmp_path / "junk.crt"
    junk.write_bytes(b"\x00\x01 not pem")
    with pytest.raises(ConfigError, match="tls.cert_file = .*not a PEM file"):
        tls.server_credentials(tls.TlsConfig(**{**ok, "cert_file": str(junk)}))
    with pytest.raises(ConfigError, match="tls.ca_file needs tls.key_file too"):
        config.from_dict({"tls": {"ca_file": "a", "cert_file": "b"}})
    with pytest.raises(ConfigError, match="tls.plaintext = true conflicts with tls.ca_file"):
        config.from_dict({"tls": {"ca_file": "a", "plaintext": True}})
    (tmp_path / "bin").write_bytes(b"\xff\xfe\x00token")
    with pytest.raises(ConfigError, match="not a text file"):
        tls.read_token(str(tmp_path / "bin"))


@pytest.mark.parametrize("section, old, new", [
    ("scheduler", "tls_cert_file", "tls.cert_file"),
    ("scheduler", "tls_client_ca_file", "tls.ca_file"),
    ("scheduler_client", "tls_ca_file", "tls.ca_file"),
    ("scheduler_client", "tls_key_file", "tls.key_file"),
])
def test_the_old_tls_keys_are_refused_naming_the_new_ones(tmp_path, capsys, section, old, new):
    path = tmp_path / "c.toml"
    path.write_text(f'[{section}]\n{old} = "/x"\n')
    assert cli.main(["config", "check", str(path)]) == cli.EXIT_USAGE
    assert f"config key {section}.{old} is gone: use {new}" in capsys.readouterr().err


def test_daemons_refuse_to_start_without_tls_unless_plaintext_is_explicit(tmp_path, capsys):
    cfg = tmp_path / "s.toml"
    cfg.write_text("[scheduler]\n")
    assert cli.main(["scheduler", "--config", str(cfg), "--listen", "127.0.0.1:0"]) == 2
    assert "no TLS configured: set tls.ca_file, tls.cert_file and tls.key_file" in \
        capsys.readouterr().err
    assert cli.main(["ctl", "stats", "--config", str(cfg), "--scheduler", "127.0.0.1:1"]) == 2
    cfg.write_text('[scheduler]\nadmin_token_file = "/nonexistent/t"\n[tls]\nplaintext = true\n')
    assert cli.main(["scheduler", "--config", str(cfg), "--listen", "127.0.0.1:0"]) == 2
    assert "scheduler.admin_token_file = " in capsys.readouterr().err


def test_a_scheduler_refuses_to_start_with_a_certificate_its_clients_would_refuse(
        pki, tmp_path, capsys):
    # Every client expects tls.scheduler_identity (issue 38); a scheduler started with
    # another certificate would be refused by each of them, naming both. It says so at
    # start-up instead, and exits 2.
    cfg = tmp_path / "s.toml"
    sec = pki.section("node/d0") | {"scheduler_identity": "scheduler/sched"}
    cfg.write_text("[tls]\n" + "".join(f'{k} = "{v}"\n' for k, v in sec.items()))
    assert cli.main(["scheduler", "--config", str(cfg), "--listen", "127.0.0.1:0"]) == 2
    err = capsys.readouterr().err
    assert "names node/d0, not scheduler/sched (tls.scheduler_identity)" in err, err


def test_plaintext_is_logged_as_a_warning(tmp_path):
    cfg = tmp_path / "s.toml"
    cfg.write_text("[tls]\nplaintext = true\n")
    proc = subprocess.Popen([sys.executable, "-m", "dualpath.cli", "scheduler", "--config",
                             str(cfg), "--listen", "127.0.0.1:0"],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    try:
        log = DaemonLog(proc)
        log.wait_for(r"WARNING dualpath.scheduler\[\d+\]: scheduler: gRPC in PLAINTEXT")
        log.wait_for(r"listening on 127\.0\.0\.1:\d+, plaintext")
    finally:
        proc.kill()
        proc.wait()


# ---------------------------------------------------------------- from another namespace


@pytest.fixture(scope="module")
def ns(pki):
    yield from netns.netns_fixture("tls")


def test_attacker_namespace_cannot_register_or_hijack_a_group(ns, tmp_path_factory):
    # The scheduler runs in the victim namespace on its veth address; the legitimate node
    # d0 registers from there, attackers call from their own namespace over the veth.
    d = tmp_path_factory.mktemp("nspki")
    pki = tls.make_cluster_pki(d, IDENTITIES, ips=("127.0.0.1", ns.victim_ip),
                               foreign=("node/d0",))
    cfg = d / "sched.toml"
    sched = pki.section("scheduler/sched") | {"scheduler_identity": "scheduler/sched"}
    cfg.write_text("[scheduler]\nlease_ms = 600000\n[tls]\n" + "".join(
        f'{k} = "{v}"\n' for k, v in sched.items()))
    proc = ns.popen(ns.victim, [sys.executable, "-m", "dualpath.cli", "scheduler",
                                "--config", str(cfg), "--listen", f"{ns.victim_ip}:0"],
                    stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    try:
        log = DaemonLog(proc)
        port = log.wait_for(r"listening on [\d.]+:(\d+)").group(1)
        addr = f"{ns.victim_ip}:{port}"

        def calls(where, identity, ops):
            if isinstance(identity, str) and "/" in identity:   # one of the PKI's
                identity = [pki.ca_cert, *pki.certs[identity]]
            spec = {"address": addr, "calls": ops, "tls": identity}
            return json.loads(ns.python(where, "import runpy; runpy.run_module("
                                        "'tests.sched_calls', run_name='__main__')",
                                        json.dumps(spec)))

        legit = calls(ns.victim, "node/d0", [["register", "d0", "d0"]])
        assert legit[0].startswith("OK:")
        lease = int(legit[0][3:])
        hijack = [["register", "d0", "evil"], ["fetch", "d0", lease], ["report", "d0", lease]]
        # Without a cluster certificate: refused at the handshake (no call runs).
        assert calls(ns.attacker, "plaintext", hijack) == ["UNAVAILABLE"] * 3
        assert calls(ns.attacker, ["ca-only", pki.ca_cert], hijack) == ["UNAVAILABLE"] * 3
        assert calls(ns.attacker, "other:node/d0", hijack) == ["UNAVAILABLE"] * 3
        # With another node's certificate: the lease stays d0's.
        assert calls(ns.attacker, "node/d1", hijack + [["stats"]]) == \
            ["PERMISSION_DENIED"] * 4
        assert calls(ns.victim, "node/d0", [["fetch", "d0", lease]]) == ["OK:0"]
    finally:
        proc.kill()
        proc.wait()
