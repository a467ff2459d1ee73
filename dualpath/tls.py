"""gRPC transport security shared by the scheduler and the daemons.

* TLS: the server presents ``cert``/``key``; clients verify it against a CA bundle.
* Mutual TLS: when the server has a client CA, every client must present a certificate
  that CA signed, or the handshake fails (the connection is refused, no call runs).
* Admin token: calls to protected services carry ``authorization: Bearer <token>``;
  :class:`TokenAuthInterceptor` refuses them with UNAUTHENTICATED (no or malformed
  token) or PERMISSION_DENIED (wrong token) before the servicer runs.

:func:`make_dev_pki` writes a throw-away CA, server and client certificate with the
``openssl`` command, for tests and local clusters; keys are generated on the spot and
never committed.
"""

from __future__ import annotations

import hmac
import shutil
import subprocess
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc

from dualpath.errors import ConfigError, UsageError

BEARER = "bearer "


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ConfigError(f"{what} = {path!r}: cannot read ({e.strerror})") from None


def read_token(path: str, what: str = "admin_token_file") -> str:
    """The first line of ``path``, stripped; an empty token is a config error."""
    try:
        token = _read(path, what).decode().strip().splitlines()
    except UnicodeDecodeError:
        raise ConfigError(f"{what} = {path!r}: not a text file") from None
    if not token or not token[0].strip():
        raise ConfigError(f"{what} = {path!r}: the file holds no token")
    return token[0].strip()


def server_credentials(cert_file: str, key_file: str, client_ca_file: str = "", *,
                       section: str = "scheduler") -> grpc.ServerCredentials | None:
    """None for plaintext (no cert); TLS; or mutual TLS when ``client_ca_file`` is set.
    Errors name the keys as ``section.tls_*``."""
    if not cert_file:
        return None
    pair = [(_read(key_file, f"{section}.tls_key_file"),
             _read(cert_file, f"{section}.tls_cert_file"))]
    if client_ca_file:
        return grpc.ssl_server_credentials(
            pair, _read(client_ca_file, f"{section}.tls_client_ca_file"),
            require_client_auth=True)
    return grpc.ssl_server_credentials(pair)


def channel_credentials(ca_file: str, cert_file: str = "", key_file: str = "", *,
                        section: str = "scheduler_client") -> grpc.ChannelCredentials | None:
    """None for plaintext (no CA); else TLS, presenting a client cert when given.
    Errors name the keys as ``section.tls_*``."""
    if not ca_file:
        return None
    return grpc.ssl_channel_credentials(
        _read(ca_file, f"{section}.tls_ca_file"),
        _read(key_file, f"{section}.tls_key_file") if key_file else None,
        _read(cert_file, f"{section}.tls_cert_file") if cert_file else None)


def tls_mode(cert_file: str, client_ca_file: str) -> str:
    """'plaintext', 'tls' or 'mutual-tls', for start-up logs."""
    return "mutual-tls" if client_ca_file else "tls" if cert_file else "plaintext"


def _refuse(code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    async def abort(request, context: grpc.aio.ServicerContext):
        await context.abort(code, message)

    return grpc.unary_unary_rpc_method_handler(abort)


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Requires the bearer token on every method whose full name starts with one of
    ``prefixes`` (e.g. "/dualpath.v1.Admin/"). ``token`` None refuses them all.
    Protected methods must be unary-unary (the refusal handler is)."""

    def __init__(self, token: str | None, prefixes: tuple[str, ...]):
        self._token = token.encode() if token else None
        self._prefixes = prefixes

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        if not handler_call_details.method.startswith(self._prefixes):
            return await continuation(handler_call_details)
        given = None
        for k, v in handler_call_details.invocation_metadata or ():
            if k == "authorization":
                given = v if isinstance(v, str) else v.decode(errors="replace")
                break
        if self._token is None:
            return _refuse(grpc.StatusCode.UNAUTHENTICATED,
                           "admin calls are disabled: the scheduler has no admin token "
                           "(admin_token_file)")
        if given is None or not given.lower().startswith(BEARER):
            return _refuse(grpc.StatusCode.UNAUTHENTICATED,
                           "missing 'authorization: Bearer <token>' metadata")
        if not hmac.compare_digest(given[len(BEARER):].strip().encode(), self._token):
            return _refuse(grpc.StatusCode.PERMISSION_DENIED, "wrong admin token")
        return await continuation(handler_call_details)


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()


@dataclass(frozen=True)
class DevPki:
    """Paths of a throw-away PKI made by :func:`make_dev_pki`."""

    ca_cert: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str
    other_ca_cert: str      # a second CA that signed nothing we trust
    other_client_cert: str  # a client certificate signed by that other CA
    other_client_key: str


def make_dev_pki(directory: str | Path, hosts: tuple[str, ...] = ("localhost",),
                 ips: tuple[str, ...] = ("127.0.0.1", "::1")) -> DevPki:
    """A CA, a server certificate for ``hosts``/``ips`` and client certificates, made
    with the openssl command (EC P-256, valid one day). For tests and local clusters."""
    openssl = shutil.which("openssl")
    if openssl is None:
        raise UsageError("make_dev_pki needs the openssl command (apt install openssl)")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], check=True, capture_output=True, cwd=d)

    def ca(name: str) -> None:
        run("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.crt", "-days", "1",
            "-subj", f"/CN=dualpath {name}", "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign")

    def leaf(name: str, ca_name: str, ext: str) -> None:
        run("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN=dualpath {name}")
        (d / f"{name}.ext").write_text(ext)
        run("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca_name}.crt", "-CAkey",
            f"{ca_name}.key", "-CAcreateserial", "-out", f"{name}.crt", "-days", "1",
            "-extfile", f"{name}.ext")

    ca("ca")
    ca("other-ca")
    san = ",".join([f"DNS:{h}" for h in hosts] + [f"IP:{i}" for i in ips])
    leaf("server", "ca", f"subjectAltName={san}\nextendedKeyUsage=serverAuth\n")
    leaf("client", "ca", "extendedKeyUsage=clientAuth\n")
    leaf("other-client", "other-ca", "extendedKeyUsage=clientAuth\n")
    p = lambda n: str(d / n)
    return DevPki(p("ca.crt"), p("server.crt"), p("server.key"), p("client.crt"),
                  p("client.key"), p("other-ca.crt"), p("other-client.crt"),
                  p("other-client.key"))
