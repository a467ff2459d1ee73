"""Transport security and admin auth on the scheduler: refused connections (plaintext
client to a TLS server, untrusted server, no or foreign client certificate under mutual
TLS) and refused calls (no or wrong admin token). Certificates are made at test time
with the openssl command (dualpath.tls.make_dev_pki); no key is committed."""

import asyncio
import contextlib
import shutil

import grpc
import pytest

from dualpath import metrics, tls
from dualpath.scheduler.client import SchedulerClient
from dualpath.scheduler.service import SchedulerService, create_server
from dualpath.v1 import admin_pb2
from dualpath.v1 import scheduler_pb2 as pb

TOKEN = "tls-admin-token"

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None,
                                reason="the openssl command is needed to make test certs "
                                "(tools/install-system-packages.sh installs it)")


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return tls.make_dev_pki(tmp_path_factory.mktemp("pki"))


@contextlib.asynccontextmanager
async def server(creds, token=TOKEN):
    svc = SchedulerService(registry=metrics.new_registry(process=False))
    srv, port = create_server("127.0.0.1:0", svc, credentials=creds, admin_token=token)
    await srv.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await srv.stop(None)


async def outcome(addr, creds=None, token=TOKEN, admin=True):
    """'ok' or the status code name of one call."""
    async with SchedulerClient(addr, credentials=creds, admin_token=token,
                               timeout_s=10) as c:
        try:
            if admin:
                await c.list_engines()
            else:
                await c.submit([pb.RequestSpec(prompt_tokens=10)])
        except grpc.aio.AioRpcError as e:
            return e.code().name
    return "ok"


def test_tls_server_refuses_plaintext_and_untrusting_clients(pki):
    async def body():
        creds = tls.server_credentials(pki.server_cert, pki.server_key)
        async with server(creds) as addr:
            good = tls.channel_credentials(pki.ca_cert)
            assert await outcome(addr, good) == "ok"
            assert await outcome(addr, good, admin=False) == "ok"
            # A plaintext client cannot talk to a TLS server.
            assert await outcome(addr, None) == "UNAVAILABLE"
            # A client that trusts another CA refuses the server's certificate.
            assert await outcome(addr, tls.channel_credentials(pki.other_ca_cert)) == \
                "UNAVAILABLE"

    asyncio.run(body())


def test_mutual_tls_requires_a_client_certificate_from_the_configured_ca(pki):
    async def body():
        creds = tls.server_credentials(pki.server_cert, pki.server_key, pki.ca_cert)
        async with server(creds) as addr:
            with_cert = tls.channel_credentials(pki.ca_cert, pki.client_cert, pki.client_key)
            assert await outcome(addr, with_cert) == "ok"
            # No client certificate: the handshake fails, the call never runs.
            assert await outcome(addr, tls.channel_credentials(pki.ca_cert)) == "UNAVAILABLE"
            assert await outcome(addr, tls.channel_credentials(pki.ca_cert),
                                 admin=False) == "UNAVAILABLE"
            # A certificate signed by a CA the server does not trust.
            foreign = tls.channel_credentials(pki.ca_cert, pki.other_client_cert,
                                              pki.other_client_key)
            assert await outcome(addr, foreign) == "UNAVAILABLE"

    asyncio.run(body())


def test_admin_calls_need_the_token_and_leader_calls_do_not(pki):
    async def body():
        creds = tls.server_credentials(pki.server_cert, pki.server_key)
        client_creds = tls.channel_credentials(pki.ca_cert)
        async with server(creds) as addr:
            assert await outcome(addr, client_creds, token=None) == "UNAUTHENTICATED"
            assert await outcome(addr, client_creds, token="wrong") == "PERMISSION_DENIED"
            assert await outcome(addr, client_creds, token=TOKEN + "x") == "PERMISSION_DENIED"
            assert await outcome(addr, client_creds, token=None, admin=False) == "ok"
            # A malformed header (not "Bearer ...") is treated as no token.
            async with SchedulerClient(addr, credentials=client_creds) as c:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await c.admin.Stats(admin_pb2.StatsRequest(),
                                        metadata=(("authorization", TOKEN),))
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # A scheduler without an admin token refuses every admin call.
        async with server(None, token=None) as addr:
            assert await outcome(addr, None, token=TOKEN) == "UNAUTHENTICATED"
            assert await outcome(addr, None, admin=False) == "ok"

    asyncio.run(body())


def test_token_and_cert_files_are_read_with_clear_errors(tmp_path):
    from dualpath.errors import ConfigError

    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="holds no token"):
        tls.read_token(str(tmp_path / "empty"))
    with pytest.raises(ConfigError, match="cannot read"):
        tls.server_credentials(str(tmp_path / "missing.crt"), str(tmp_path / "missing.key"))
    (tmp_path / "tok").write_text("  abc  \nignored\n")
    assert tls.read_token(str(tmp_path / "tok")) == "abc"


def test_tls_and_token_errors_name_the_dotted_config_key(tmp_path, capsys):
    # Said 'tls_key_file = ...' (which section?) and a binary token file was a
    # UnicodeDecodeError traceback.
    from dualpath import cli
    from dualpath.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^scheduler\.tls_key_file = "):
        tls.server_credentials(str(tmp_path / "a.crt"), str(tmp_path / "a.key"))
    with pytest.raises(ConfigError, match=r"^scheduler_client\.tls_ca_file = "):
        tls.channel_credentials(str(tmp_path / "ca.crt"))
    (tmp_path / "bin").write_bytes(b"\xff\xfe\x00token")
    with pytest.raises(ConfigError, match="not a text file"):
        tls.read_token(str(tmp_path / "bin"))
    cfg = tmp_path / "s.toml"
    cfg.write_text(f'[scheduler]\nadmin_token_file = "{tmp_path / "none"}"\n')
    assert cli.main(["scheduler", "--config", str(cfg), "--listen", "127.0.0.1:0"]) == 2
    assert "scheduler.admin_token_file = " in capsys.readouterr().err
