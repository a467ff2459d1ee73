"""The front end's HTTP edge under attack (issue 38's audit), against a real FrontEnd on
loopback (no scheduler is needed: every request here is refused or cut before one would
be submitted). Each test failed on b658318:

- a 100,000-deep JSON body answered 500 (the parser's RecursionError): now 400;
- a body declared larger than ``max_body_bytes`` was waited for: now 413 at once;
- a connection that never finishes its request head was held for ever (aiohttp has no
  header timeout; 1,000 of them held the front end for 150 s): now closed after
  ``header_timeout_s``;
- a body that never finishes arriving held its handler: now 408 after ``body_timeout_s``;
- connections past ``max_connections`` were all accepted: now closed as they come.
Deadlines here are bounds on liveness (generous socket timeouts), not timings."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import pytest

from dualpath import tls
from dualpath.config import build_section
from dualpath.frontend.config import FrontendConfig
from dualpath.frontend.server import FrontEnd

WAIT_S = 20.0


def _front(**kw) -> FrontendConfig:
    return build_section(FrontendConfig, {"listen": "127.0.0.1:0", "max_body_bytes": 1 << 20,
                                          "header_timeout_s": 1.0, "body_timeout_s": 1.0,
                                          **kw}, "frontend")


def _run(cfg: FrontendConfig, client) -> object:
    """Start a front end, run ``client(host, port)`` in a thread, stop it."""
    async def main():
        fe = FrontEnd(cfg, "127.0.0.1:1", tls.PLAINTEXT)
        url = await fe.start()
        host, port = url.split("://", 1)[1].rsplit(":", 1)
        try:
            return await asyncio.to_thread(client, host, int(port))
        finally:
            await fe.close()
    return asyncio.run(main())


def _request(host: str, port: int, body: bytes, headers: str = "") -> tuple[int, dict]:
    with socket.create_connection((host, port), timeout=WAIT_S) as s:
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                  f"application/json\r\nContent-Length: {len(body)}\r\n{headers}"
                  "Connection: close\r\n\r\n".encode() + body)
        return _response(s)


def _response(s: socket.socket) -> tuple[int, dict]:
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body) if body else {}


def _closed(s: socket.socket) -> bool:
    """Whether the server closed ``s`` (an EOF) within WAIT_S; False on a timeout."""
    try:
        while s.recv(4096):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_a_body_nested_too_deep_is_a_400_not_a_500():
    body = b"[" * 100_000 + b"]" * 100_000
    status, answer = _run(_front(), lambda h, p: _request(h, p, body))
    assert status == 400, answer
    assert "nested too deeply" in answer["error"]["message"]


def test_a_body_declared_too_large_is_refused_before_it_is_sent():
    def client(host, port):
        with socket.create_connection((host, port), timeout=WAIT_S) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                      b"application/json\r\nContent-Length: 4000000\r\n"
                      b"Connection: close\r\n\r\n")
            return _response(s)         # not one byte of the body sent
    status, answer = _run(_front(), client)
    assert status == 413 and "4000000 bytes" in answer["error"]["message"], answer


def test_a_request_head_that_never_ends_is_closed():
    def client(host, port):
        with socket.create_connection((host, port), timeout=WAIT_S) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")   # and nothing more
            return _closed(s)
    assert _run(_front(), client) is True


def test_a_body_that_never_ends_is_a_408():
    def client(host, port):
        with socket.create_connection((host, port), timeout=WAIT_S) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                      b"application/json\r\nContent-Length: 100\r\nConnection: close\r\n"
                      b"\r\n{\"prompt\": ")
            return _response(s)
    status, answer = _run(_front(), client)
    assert status == 408 and "did not arrive within 1 s" in answer["error"]["message"]


def test_connections_past_the_cap_are_closed_and_the_rest_still_served():
    def client(host, port):
        held = [socket.create_connection((host, port), timeout=WAIT_S) for _ in range(20)]
        try:
            for s in held:
                s.settimeout(0.5)
            over = sum(_closed(s) for s in held)     # the first 8 are kept (for now)
        finally:
            for s in held:
                s.close()
        # The server learns the 8 went away as their closes arrive: ask until it did.
        for _ in range(100):
            try:
                with socket.create_connection((host, port), timeout=WAIT_S) as s:
                    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                    return over, _response(s)
            except ConnectionResetError:
                time.sleep(0.1)
        return over, (0, {})
    over, (status, answer) = _run(_front(max_connections=8, header_timeout_s=30.0), client)
    assert over == 12 and status == 200 and answer["status"] == "ok"


@pytest.mark.parametrize("field,value", [("max_connections", 2), ("header_timeout_s", 0.0),
                                         ("body_timeout_s", 0.1)])
def test_the_bounds_are_checked_config_keys(field, value):
    from dualpath.errors import ConfigError
    with pytest.raises(ConfigError, match=f"frontend.{field}"):
        _front(**{field: value})


def test_the_api_serves_https_with_its_certificate(tmp_path):
    import ssl
    import urllib.request
    pki = tls.make_cluster_pki(tmp_path / "pki", ["client/fe"])
    cert, key = pki.certs["client/fe"]

    def client(host, port):
        ctx = ssl.create_default_context(cafile=pki.ca_cert)
        with urllib.request.urlopen(f"https://127.0.0.1:{port}/health", context=ctx,
                                    timeout=WAIT_S) as r:
            https = json.loads(r.read())
        with socket.create_connection((host, port), timeout=WAIT_S) as s:   # plain HTTP
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            plain = s.recv(65536)
        return https, plain
    https, plain = _run(_front(cert_file=cert, key_file=key), client)
    assert https["status"] == "ok"
    assert b'"status": "ok"' not in plain          # no answer in the clear


def test_config_check_warns_about_an_open_front_end(tmp_path, capsys):
    from dualpath import cli
    path = tmp_path / "fe.toml"
    path.write_text('[frontend]\nlisten = "0.0.0.0:8000"\n')
    assert cli.main(["config", "check", str(path)]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == f"{path}: ok (2 warnings)"
    assert "without frontend.api_key_file: anyone who reaches it may submit" in err
    assert "in plain HTTP (no frontend.cert_file)" in err
    path.write_text('[frontend]\nlisten = "127.0.0.1:8000"\n')
    assert cli.main(["config", "check", str(path)]) == 0
    assert capsys.readouterr() == (f"{path}: ok\n", "")


def test_a_client_that_hangs_up_withdraws_its_request_from_the_cluster():
    # Issue 38's audit: a client that hung up left its request running in the cluster
    # and its in-flight slot held (no cancel reached the scheduler), on b658318.
    from dualpath import metrics
    from dualpath.scheduler.service import SchedulerService, create_server

    async def main():
        svc = SchedulerService(registry=metrics.new_registry(process=False))
        srv, sport = create_server("127.0.0.1:0", svc)
        await srv.start()
        fe = FrontEnd(_front(), f"127.0.0.1:{sport}", tls.PLAINTEXT)
        url = await fe.start()
        host, port = url.split("://", 1)[1].rsplit(":", 1)
        body = json.dumps({"model": fe.model, "prompt": list(range(1, 65)),
                           "max_tokens": 4}).encode()
        try:
            _reader, w = await asyncio.open_connection(host, int(port))
            w.write(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                    f"application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                    + body)
            await w.drain()
            for _ in range(400):                 # until the scheduler holds it
                if svc.core.requests:
                    break
                await asyncio.sleep(0.05)
            (rid,) = list(svc.core.requests)
            assert fe.in_flight == 1
            w.close()                            # the client hangs up
            for _ in range(400):
                if rid not in svc.core.requests and fe.in_flight == 0:
                    break
                await asyncio.sleep(0.05)
            return rid, svc.core.finished.get(rid), fe.in_flight
        finally:
            await fe.close()
            await srv.stop(None)

    rid, ended, in_flight = asyncio.run(main())
    assert in_flight == 0
    assert ended is not None and ended.outcome.name == "CANCELLED", (rid, ended)
    assert ended.error == "withdrawn by its submitter"


def test_each_api_key_names_its_tenant_and_a_salt_stays_below_it(tmp_path):
    # Issue 40: the front end had one key and took cache_salt as the tenant, so a key's
    # holder could name any tenant (and hit its stored KV) by its salt.
    from dualpath.frontend.tenants import ApiKeys
    from dualpath.kv.prefix import tenant_root
    from dualpath.scheduler.generate import Generated

    keys = tmp_path / "keys"
    keys.write_text("# tenant key\nacme  acme-key-0123456789\nglobex globex-key-0123456789\n")
    shared = tmp_path / "shared"
    shared.write_text("shared-key-0123456789\n")
    cfg = _front(api_keys_file=str(keys), api_key_file=str(shared), default_tenant="public")
    seen: list[tuple[str, str, int]] = []
    ids = list(range(1, 257))

    async def main():
        fe = FrontEnd(cfg, "127.0.0.1:1", tls.PLAINTEXT)

        async def generate(rid, prompt, max_tokens, *, hit_tokens, tenant, cache_salt, **_):
            seen.append((tenant, cache_salt, hit_tokens))
            return Generated(rid, [7] * max_tokens, [0.0] * max_tokens, 1, "p", "d",
                             0, 0, 0.0, 0.0, 0.0, 0.0, "length")
        fe.gen.generate = generate
        url = await fe.start()
        host, port = url.split("://", 1)[1].rsplit(":", 1)

        def client(key, salt=None):
            body = {"model": fe.model, "prompt": ids, "max_tokens": 2}
            if salt is not None:
                body["cache_salt"] = salt
            return _request(host, int(port), json.dumps(body).encode(),
                            f"Authorization: Bearer {key}\r\n" if key else "")
        try:
            return [await asyncio.to_thread(client, *a) for a in (
                ("acme-key-0123456789",), ("acme-key-0123456789",),
                ("globex-key-0123456789",), ("globex-key-0123456789", "acme"),
                ("shared-key-0123456789", "acme"), ("shared-key-0123456789",),
                ("wrong-key-0123456789",), (None,),
                ("acme-key-0123456789", "x" * 256))]
        finally:
            await fe.close()

    codes = [c for c, _ in asyncio.run(main())]
    assert codes == [200] * 6 + [401, 401, 400]
    # vLLM's own prefix cache is salted by the tenant too (a review found the raw salt
    # sent on: two keys' holders with no salt shared vLLM's cache).
    assert [(t, s) for t, s, _ in seen] == [
        ("acme", "acme"), ("acme", "acme"), ("globex", "globex"),
        ("globex/acme", "globex/acme"), ("public/acme", "public/acme"), ("public", "public")]
    # The same prompt: acme's second request hits what its first stored, nobody else's.
    assert [h for *_, h in seen] == [0, 256 - 128, 0, 0, 0, 0]
    assert len({tenant_root(t) for t, _, _ in seen}) == 5
    # A shared key beside tenants' keys needs the default tenant named.
    with pytest.raises(Exception, match="default_tenant"):
        _front(api_keys_file=str(keys), api_key_file=str(shared))
    bad = tmp_path / "bad"
    for text, why in (("acme short\n", "16 characters"), ("a/b key-0123456789abc\n", "name"),
                      ("acme k-0123456789abcdef\nbeta k-0123456789abcdef\n", "twice"),
                      ("acme\n", "<tenant> <key>")):
        bad.write_text(text)
        with pytest.raises(Exception, match=why):
            ApiKeys("", str(bad), "")
