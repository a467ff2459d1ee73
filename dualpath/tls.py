"""gRPC transport security and identities, shared by the scheduler, the node daemons
and every client: one ``[tls]`` section (:class:`TlsConfig`) for all of them.

* **Mutual TLS, always.** A server presents ``cert_file``/``key_file`` and requires every
  client to present a certificate that ``ca_file`` signed; a client verifies the server
  against the same CA and presents its own certificate. A process without TLS material
  refuses to start unless ``tls.plaintext = true`` says otherwise, and then it logs a
  warning (:func:`log_mode`).
* **Identities.** A certificate names its holder with a URI subject alternative name
  ``spiffe://<trust_domain>/<role>/<name>`` (:data:`ROLES`: a ``node`` names its node
  id, ``scheduler``, ``admin`` for operators, ``client`` for front ends and the replay
  driver). :func:`peer_identity` reads it from a call's auth context; a peer without one
  in our trust domain has no identity (the servicers refuse it what needs one).
* **Reload.** A server's certificate, key and CA are re-read when any of the three files
  changes (checked at each new TLS handshake, by gRPC's certificate-config fetcher); a
  half-written update (a key that does not match its certificate) keeps the old ones and
  is logged once. A channel reads the files when it is made.
* **Admin calls.** :class:`AdminAuthInterceptor` lets a call to a protected service run
  when it carries ``authorization: Bearer <token>`` with the admin token, or comes over
  mutual TLS from an ``admin`` identity; otherwise UNAUTHENTICATED (nothing usable) or
  PERMISSION_DENIED (a wrong token, another identity).

Start-up errors (:func:`load_material`) name the key and the file: missing, unreadable,
a key readable by every user, a certificate and key that do not belong together, a file
that is not PEM.

:func:`make_cluster_pki` writes a throw-away CA and certificates for every identity of a
local cluster with the ``openssl`` command (tests, ``dualpath up``, ``make demo``); keys
are generated on the spot and never committed.

Threads: the functions are pure or do file I/O on the caller's thread; the reloader runs
on gRPC's threads and touches only its own state.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import shutil
import socket
import ssl
import stat
import subprocess
import threading
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from dualpath.config import key
from dualpath.errors import ConfigError, DualPathError, UsageError

log = logging.getLogger("dualpath.tls")

BEARER = "bearer "
ROLES = ("node", "scheduler", "admin", "client")
SCHEME = "spiffe://"


@dataclass(frozen=True)
class TlsConfig:
    """Transport security of every gRPC surface (scheduler, node services, node to node,
    clients): mutual TLS with certificate identities, or plaintext when explicitly asked."""

    ca_file: str = key("", "PEM CA bundle: verifies servers (as a client) and requires and "
                       "verifies client certificates (as a server).")
    cert_file: str = key("", "PEM certificate of this process; its URI SAN "
                         "spiffe://<trust_domain>/<role>/<name> is its identity (role node, "
                         "scheduler, admin or client).")
    key_file: str = key("", "PEM private key of cert_file; must not be readable by every "
                        "user.")
    trust_domain: str = key("dualpath", "The cluster's identity namespace: only URI SANs "
                            "spiffe://<trust_domain>/... name a peer.")
    scheduler_identity: str = key("scheduler/scheduler", "The identity (ROLE/NAME) the "
                                  "scheduler's certificate must name: every client of the "
                                  "scheduler checks it answers as this, not merely from a "
                                  "certificate of the cluster's CA (its certificate carries "
                                  "the DNS name <name>.<role>.<trust_domain> for it).")
    metrics_https: bool = key(False, "Serve this process's /metrics (metrics_listen) over "
                              "HTTPS with cert_file/key_file (Prometheus: scheme https, "
                              "its tls_config ca_file this CA).")
    plaintext: bool = key(False, "Run gRPC without TLS (no identities; loopback and tests "
                          "only). Logged as a warning at start-up. Must be set explicitly: "
                          "without it and without ca/cert/key files, daemons refuse to start.")

    def validate(self) -> None:
        files = {"ca_file": self.ca_file, "cert_file": self.cert_file,
                 "key_file": self.key_file}
        given = [k for k, v in files.items() if v]
        if self.plaintext and given:
            raise ConfigError(f"config key tls.plaintext = true conflicts with tls.{given[0]}: "
                              "choose mutual TLS (ca_file, cert_file, key_file) or plaintext")
        if given and len(given) != 3:
            missing = [k for k in files if k not in given]
            raise ConfigError(f"config key tls.{given[0]} needs tls.{missing[0]} too: mutual "
                              "TLS takes ca_file, cert_file and key_file together")
        try:
            ident = as_identity(self.scheduler_identity, "config key tls.scheduler_identity")
        except UsageError as e:
            raise ConfigError(str(e)) from None
        if ident.role != "scheduler":
            raise ConfigError(f"config key tls.scheduler_identity = "
                              f"{self.scheduler_identity!r}: the role must be scheduler")
        if self.metrics_https and not self.cert_file:
            raise ConfigError("config key tls.metrics_https = true needs tls.cert_file and "
                              "tls.key_file (the certificate /metrics is served with)")
        if not self.trust_domain or "/" in self.trust_domain or ":" in self.trust_domain:
            raise ConfigError(f"config key tls.trust_domain = {self.trust_domain!r}: expected "
                              "a non-empty name without '/' or ':' (e.g. 'dualpath')")

    @property
    def enabled(self) -> bool:
        return bool(self.cert_file)


PLAINTEXT = TlsConfig(plaintext=True)


# ---------------------------------------------------------------- identities


@dataclass(frozen=True, order=True)
class Identity:
    """Who a peer is: ``role`` (one of :data:`ROLES`) and ``name`` (a node id, ...)."""

    role: str
    name: str

    def __str__(self) -> str:
        return f"{self.role}/{self.name}"

    def uri(self, trust_domain: str) -> str:
        return f"{SCHEME}{trust_domain}/{self.role}/{self.name}"


def parse_identity(uri: str, trust_domain: str) -> Identity | None:
    """``spiffe://<trust_domain>/<role>/<name>`` -> Identity; None for anything else."""
    prefix = f"{SCHEME}{trust_domain}/"
    if not uri.startswith(prefix):
        return None
    role, sep, name = uri[len(prefix):].partition("/")
    if not sep or role not in ROLES or not name or "/" in name:
        return None
    return Identity(role, name)


def identity_dns(ident: Identity, trust_domain: str) -> str:
    """The DNS name a certificate carries beside its URI SAN, ``<name>.<role>.<trust
    domain>``, so that a client checks *who* answers, not only where: its channel asks
    gRPC to verify the server's certificate against this name instead of the host's
    (``grpc.ssl_target_name_override``)."""
    return f"{ident.name}.{ident.role}.{trust_domain}"


def as_identity(value: Identity | str, what: str) -> Identity:
    """``"role/name"`` (or an Identity) -> Identity; UsageError naming ``what``."""
    if isinstance(value, Identity):
        return value
    role, sep, name = value.partition("/")
    if not sep or role not in ROLES or not name or "/" in name:
        raise UsageError(f"{what} = {value!r}: expected ROLE/NAME with ROLE one of "
                         + ", ".join(ROLES))
    return Identity(role, name)


async def require_role(context: grpc.aio.ServicerContext, cfg: TlsConfig, role: str,
                       what: str) -> None:
    """Over mutual TLS, abort the call PERMISSION_DENIED unless the caller's identity has
    ``role`` (plaintext: no identities, nothing checked)."""
    if cfg.plaintext or not is_secure(context):
        return
    ident = peer_identity(context, cfg.trust_domain)
    if ident is None or ident.role != role:
        await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                            f"{what} takes calls from {role} identities only, not "
                            f"{ident or 'a certificate without one'}")


def is_secure(context: grpc.aio.ServicerContext) -> bool:
    """Whether the call came over TLS (a plaintext listener says 'insecure' or nothing)."""
    auth = context.auth_context() or {}
    return b"ssl" in auth.get("transport_security_type", ())


def peer_identity(context: grpc.aio.ServicerContext, trust_domain: str) -> Identity | None:
    """The caller's identity from its certificate's URI SANs (mutual TLS only); None over
    plaintext or when no SAN names a peer of ``trust_domain``."""
    auth = context.auth_context() or {}
    # gRPC lists URI SANs as peer_uri; older releases only in the SAN list of every type.
    sans = auth.get("peer_uri") or auth.get("x509_subject_alternative_name") or ()
    for raw in sans:
        ident = parse_identity(raw.decode(errors="replace"), trust_domain)
        if ident is not None:
            return ident
    return None


# ---------------------------------------------------------------- material


@dataclass(frozen=True)
class Material:
    """The PEM bytes of one process's TLS set-up, checked by :func:`load_material`."""

    ca: bytes
    cert: bytes
    key: bytes


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ConfigError(f"{what} = {path!r}: cannot read ({e.strerror})") from None


def _stamps(cfg: TlsConfig) -> tuple:
    out = []
    for p in (cfg.ca_file, cfg.cert_file, cfg.key_file):
        try:
            st = os.stat(p)
            out.append((st.st_ino, st.st_size, st.st_mtime_ns))
        except OSError:
            out.append(None)
    return tuple(out)


def load_material(cfg: TlsConfig) -> Material:
    """Read and check the three files; ConfigError naming the key and the file when one
    is missing, unreadable, not PEM, a key readable by every user, or a certificate and
    key that do not belong together."""
    if not cfg.enabled:
        raise ConfigError("no TLS configured: set tls.ca_file, tls.cert_file and "
                          "tls.key_file (mutual TLS), or tls.plaintext = true to run without "
                          "TLS (loopback and tests only)")
    ca = _read(cfg.ca_file, "tls.ca_file")
    cert = _read(cfg.cert_file, "tls.cert_file")
    key_pem = _read(cfg.key_file, "tls.key_file")
    mode = os.stat(cfg.key_file).st_mode
    if mode & stat.S_IROTH:
        raise ConfigError(f"tls.key_file = {cfg.key_file!r}: readable by every user (mode "
                          f"{stat.S_IMODE(mode):04o}); chmod 600 it")
    for what, path, data, marker in (("tls.ca_file", cfg.ca_file, ca, b"CERTIFICATE"),
                                     ("tls.cert_file", cfg.cert_file, cert, b"CERTIFICATE"),
                                     ("tls.key_file", cfg.key_file, key_pem, b"PRIVATE KEY")):
        if b"-----BEGIN " not in data or marker not in data:
            raise ConfigError(f"{what} = {path!r}: not a PEM file holding a {marker.decode().lower()}")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        ctx.load_verify_locations(cafile=cfg.ca_file)
    except ssl.SSLError as e:
        raise ConfigError(f"tls.ca_file = {cfg.ca_file!r}: not a usable CA bundle "
                          f"({e.reason or e})") from None
    try:
        ctx.load_cert_chain(cfg.cert_file, cfg.key_file)
    except ssl.SSLError as e:
        if "KEY_VALUES_MISMATCH" in str(e) or e.reason == "KEY_VALUES_MISMATCH":
            raise ConfigError(f"tls.key_file = {cfg.key_file!r} is not the key of tls.cert_file "
                              f"= {cfg.cert_file!r} (they do not match)") from None
        raise ConfigError(f"tls.cert_file = {cfg.cert_file!r} / tls.key_file = "
                          f"{cfg.key_file!r}: cannot load ({e.reason or e})") from None
    return Material(ca, cert, key_pem)


def _material(cfg: TlsConfig) -> Material | None:
    """None for explicit plaintext; else the checked material (ConfigError, including
    "no TLS configured" when nothing is set)."""
    return None if cfg.plaintext else load_material(cfg)


class _Reloader:
    """gRPC's certificate-config fetcher: called at each new handshake (on gRPC threads);
    returns new material when a file changed, None to keep what is in use."""

    def __init__(self, cfg: TlsConfig, stamps: tuple):
        self.cfg = cfg
        self._stamps = stamps
        self._bad: tuple | None = None
        self._lock = threading.Lock()

    def __call__(self):
        stamps = _stamps(self.cfg)
        with self._lock:
            if stamps == self._stamps or stamps == self._bad:
                return None
            try:
                m = load_material(self.cfg)
            except ConfigError as e:   # e.g. the cert is written, the key not yet
                self._bad = stamps
                log.error("TLS files changed but cannot be used (%s); keeping the ones "
                          "loaded before", e)
                return None
            self._stamps, self._bad = stamps, None
        log.info("TLS: reloaded %s and its key (CA %s)", self.cfg.cert_file, self.cfg.ca_file)
        return grpc.ssl_server_certificate_configuration([(m.key, m.cert)], m.ca)


def server_credentials(cfg: TlsConfig) -> grpc.ServerCredentials | None:
    """Mutual-TLS server credentials that reload on change; None for explicit plaintext.
    ConfigError (start-up) when the material is missing or unusable."""
    stamps = _stamps(cfg)
    m = _material(cfg)
    if m is None:
        return None
    initial = grpc.ssl_server_certificate_configuration([(m.key, m.cert)], m.ca)
    return grpc.dynamic_ssl_server_credentials(initial, _Reloader(cfg, stamps),
                                               require_client_authentication=True)


def channel_credentials(cfg: TlsConfig) -> grpc.ChannelCredentials | None:
    """Credentials presenting our certificate and verifying the server against the CA;
    None for explicit plaintext."""
    m = _material(cfg)
    return None if m is None else grpc.ssl_channel_credentials(m.ca, m.key, m.cert)


def metrics_context(cfg: TlsConfig) -> ssl.SSLContext | None:
    """The server context /metrics is served with (``tls.metrics_https``), or None for
    plain HTTP."""
    if not cfg.metrics_https:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cfg.cert_file, cfg.key_file)
    return ctx


def channel(address: str, cfg: TlsConfig, options: Iterable[tuple[str, object]] = (),
            expect: Identity | str | None = None, explain: bool = False
            ) -> grpc.aio.Channel:
    """A grpc.aio channel to ``address``: mutual TLS, or plaintext when configured. With
    ``expect`` ("role/name"), the server must be that identity (its certificate's
    :func:`identity_dns` name); a call to another fails UNAVAILABLE, in gRPC's words
    ("Hostname Verification Check failed"), which :func:`explained` turns into both
    identities. ``explain``: every unary call's failure explained so by an interceptor
    (CLIs; not on hot channels: an interceptor costs every call)."""
    creds = channel_credentials(cfg)
    opts = list(options)
    if creds is None:
        return grpc.aio.insecure_channel(address, opts)
    if not expect:
        return grpc.aio.secure_channel(address, creds, opts)
    want = as_identity(expect, "the expected server identity")
    opts.append(("grpc.ssl_target_name_override", identity_dns(want, cfg.trust_domain)))
    return grpc.aio.secure_channel(
        address, creds, opts,
        interceptors=[_WhoAnswered(address, cfg, want)] if explain else None)


def sync_channel(address: str, cfg: TlsConfig, options: Iterable[tuple[str, object]] = (),
                 expect: Identity | str | None = None) -> grpc.Channel:
    """:func:`channel` for blocking callers (supervisors' health checks, vLLM's
    scheduler); a wrong server fails UNAVAILABLE with gRPC's own words."""
    creds = channel_credentials(cfg)
    opts = list(options)
    if creds is not None and expect:
        want = as_identity(expect, "the expected server identity")
        opts.append(("grpc.ssl_target_name_override", identity_dns(want, cfg.trust_domain)))
    return (grpc.insecure_channel(address, opts) if creds is None
            else grpc.secure_channel(address, creds, opts))


def presented_identity(address: str, cfg: TlsConfig, timeout_s: float = 3.0) -> str:
    """Who the server at ``address`` says it is (its certificate's URI SANs), for an
    error message; a description of the failure when it cannot be read."""
    host, _, port = address.rpartition(":")
    try:
        ctx = ssl.create_default_context(cafile=cfg.ca_file)
        ctx.check_hostname = False
        ctx.load_cert_chain(cfg.cert_file, cfg.key_file)
        ctx.set_alpn_protocols(["h2"])
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s) \
                as raw, ctx.wrap_socket(raw) as conn:
            cert = conn.getpeercert() or {}
    except (OSError, ValueError) as e:
        return f"unknown (its certificate could not be read: {e})"
    uris = [v for k, v in cert.get("subjectAltName", ()) if k == "URI"]
    idents = [str(i) for i in (parse_identity(u, cfg.trust_domain) for u in uris) if i]
    return ", ".join(idents) or ("no identity of trust domain " + cfg.trust_domain
                                 + (f" (URI SANs: {', '.join(uris)})" if uris else ""))


def certificate_identities(path: str, trust_domain: str) -> list[Identity] | None:
    """The identities (URI SANs of ``trust_domain``) a PEM certificate file names; None
    where this Python cannot decode one (the check that needs it is skipped then)."""
    decode = getattr(getattr(ssl, "_ssl", None), "_test_decode_cert", None)
    if decode is None:
        return None
    try:
        cert = decode(path)
    except (OSError, ssl.SSLError, ValueError):
        return None
    uris = [v for k, v in cert.get("subjectAltName", ()) if k == "URI"]
    return [i for i in (parse_identity(u, trust_domain) for u in uris) if i]


def check_own_identity(cfg: TlsConfig, want: Identity | str, key: str) -> None:
    """ConfigError when this process's certificate does not name ``want`` (the config
    key ``key`` says it must): its clients would refuse every call, naming both."""
    if not cfg.enabled:
        return
    got = certificate_identities(cfg.cert_file, cfg.trust_domain)
    want = as_identity(want, f"config key {key}")
    if got is not None and want not in got:
        raise ConfigError(f"tls.cert_file = {cfg.cert_file!r} names "
                          f"{', '.join(map(str, got)) or 'no identity of trust domain ' + cfg.trust_domain}"
                          f", not {want} ({key}): its clients expect {want} and would refuse "
                          "every call")


async def explained(e: grpc.aio.AioRpcError, address: str, cfg: TlsConfig,
                    expect: Identity | str | None) -> str:
    """A failed call's details; when the server at ``address`` failed the check that it
    is ``expect``, who it is instead and what its certificate lacks (a TLS probe of the
    server, off the event loop: only on this failure)."""
    details = e.details() or ""
    if not expect or e.code() != grpc.StatusCode.UNAVAILABLE or \
            "Hostname Verification" not in details:
        return details
    want = as_identity(expect, "the expected server identity")
    got = await asyncio.to_thread(presented_identity, address, cfg)
    return (f"the server at {address} is {got}, not the expected {want} (its certificate "
            f"lacks the DNS name {identity_dns(want, cfg.trust_domain)})")


class _WhoAnswered(grpc.aio.UnaryUnaryClientInterceptor):
    """Every unary call's failure :func:`explained` (a stream keeps gRPC's words)."""

    def __init__(self, address: str, cfg: TlsConfig, want: Identity):
        self.address, self.cfg, self.want = address, cfg, want

    async def intercept_unary_unary(self, continuation, details, request):
        call = await continuation(details, request)
        try:
            await call
        except grpc.aio.AioRpcError as e:
            why = await explained(e, self.address, self.cfg, self.want)
            if why == e.details():
                raise
            raise grpc.aio.AioRpcError(e.code(), e.initial_metadata(),
                                       e.trailing_metadata(), details=why,
                                       debug_error_string=e.debug_error_string()) from None
        return call


def mode(cfg: TlsConfig) -> str:
    """'mutual-tls' or 'plaintext', for start-up logs."""
    return "plaintext" if cfg.plaintext else "mutual-tls"


def log_mode(cfg: TlsConfig, what: str, logger: logging.Logger = log) -> None:
    """The start-up line every daemon writes about its transport security; plaintext is
    a warning."""
    if cfg.plaintext:
        logger.warning("%s: gRPC in PLAINTEXT (tls.plaintext = true): no encryption, no "
                       "peer identities; any local or network peer can call it", what)
    else:
        logger.info("%s: mutual TLS, certificate %s, CA %s, trust domain %s", what,
                    cfg.cert_file, cfg.ca_file, cfg.trust_domain)


# ---------------------------------------------------------------- admin calls


def read_token(path: str, what: str = "admin_token_file") -> str:
    """The first line of ``path``, stripped; an empty token is a config error."""
    try:
        token = _read(path, what).decode().strip().splitlines()
    except UnicodeDecodeError:
        raise ConfigError(f"{what} = {path!r}: not a text file") from None
    if not token or not token[0].strip():
        raise ConfigError(f"{what} = {path!r}: the file holds no token")
    return token[0].strip()


def _wrap(handler: grpc.RpcMethodHandler,
          check: Callable[[grpc.aio.ServicerContext], Awaitable[None]]
          ) -> grpc.RpcMethodHandler:
    inner = handler.unary_unary

    async def guarded(request, context):
        await check(context)
        return await inner(request, context)

    return grpc.unary_unary_rpc_method_handler(
        guarded, request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer)


class AdminAuthInterceptor(grpc.aio.ServerInterceptor):
    """Guards every method whose full name starts with one of ``prefixes`` (e.g.
    "/dualpath.v1.Admin/"): the call runs with the bearer ``token`` or from an ``admin``
    certificate identity of ``trust_domain``. ``token`` None: only admin certificates.
    Protected methods must be unary-unary (the guard wraps that handler)."""

    def __init__(self, token: str | None, prefixes: tuple[str, ...],
                 trust_domain: str = "dualpath"):
        self._token = token.encode() if token else None
        self._prefixes = prefixes
        self._trust_domain = trust_domain

    async def _check(self, context: grpc.aio.ServicerContext) -> None:
        ident = peer_identity(context, self._trust_domain)
        if ident is not None and ident.role == "admin":
            return
        given = None
        for k, v in context.invocation_metadata() or ():
            if k == "authorization":
                given = v if isinstance(v, str) else v.decode(errors="replace")
                break
        if given is not None and given.lower().startswith(BEARER):
            if self._token is not None and hmac.compare_digest(
                    given[len(BEARER):].strip().encode(), self._token):
                return
            if self._token is not None:
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, "wrong admin token")
        if ident is not None:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                f"admin calls need an admin certificate or the admin token; "
                                f"the caller is {ident}")
        if self._token is None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "admin calls need an admin certificate: the scheduler has no "
                                "admin token (admin_token_file)")
        await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                            "missing 'authorization: Bearer <token>' metadata (or an admin "
                            "certificate)")

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(self._prefixes):
            return handler
        return _wrap(handler, self._check)


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()


# ---------------------------------------------------------------- throw-away PKI


@dataclass(frozen=True)
class ClusterPki:
    """A throw-away PKI made by :func:`make_cluster_pki`: ``certs`` maps an identity
    ("node/p0", "admin/admin", ...) to its (certificate, key) paths."""

    dir: str
    ca_cert: str
    trust_domain: str
    certs: dict[str, tuple[str, str]] = field(default_factory=dict)
    other_ca_cert: str = ""     # a second CA that signed nothing we trust

    def config(self, identity: str) -> TlsConfig:
        """The [tls] section of the process holding ``identity``."""
        cert, key_path = self.certs[identity]
        return TlsConfig(ca_file=self.ca_cert, cert_file=cert, key_file=key_path,
                         trust_domain=self.trust_domain)

    def section(self, identity: str) -> dict[str, str]:
        """The same as a TOML table (for generated config files)."""
        c = self.config(identity)
        return {"ca_file": c.ca_file, "cert_file": c.cert_file, "key_file": c.key_file,
                "trust_domain": c.trust_domain}


def make_cluster_pki(directory: str | Path, identities: Iterable[str], *,
                     trust_domain: str = "dualpath", hosts: tuple[str, ...] = ("localhost",),
                     ips: tuple[str, ...] = ("127.0.0.1", "::1"),
                     foreign: Iterable[str] = ()) -> ClusterPki:
    """A CA and one certificate per ``identities`` entry ("role/name"), each naming
    itself with the URI SAN spiffe://<trust_domain>/<role>/<name>, valid for TLS server
    and client use at ``hosts``/``ips`` (EC P-256, one day). ``foreign`` identities are
    signed by a second CA nobody trusts (tests), listed as "other:role/name". Keys are written mode 0600. Needs the
    openssl command."""
    openssl = shutil.which("openssl")
    if openssl is None:
        raise UsageError("making a cluster PKI needs the openssl command (apt install openssl)")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)

    def run(*args: str) -> None:
        r = subprocess.run([openssl, *args], capture_output=True, cwd=d, check=False)
        if r.returncode:
            raise DualPathError(f"openssl {args[0]} failed in {d}: "
                                f"{r.stderr.decode(errors='replace').strip()}")

    def ca(name: str) -> None:
        run("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.crt", "-days", "1",
            "-subj", f"/CN=dualpath {name}", "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign")
        os.chmod(d / f"{name}.key", 0o600)

    san_hosts = [f"DNS:{h}" for h in hosts] + [f"IP:{i}" for i in ips]
    certs: dict[str, tuple[str, str]] = {}

    def leaf(identity: str, ca_name: str, label: str = "") -> None:
        role, _, name = identity.partition("/")
        if role not in ROLES or not name or "/" in name:
            raise UsageError(f"identity {identity!r}: expected ROLE/NAME with ROLE one of "
                             + ", ".join(ROLES))
        base = label + identity.replace("/", "-")
        run("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", f"{base}.key", "-out", f"{base}.csr", "-subj", f"/CN=dualpath {role} {name}")
        os.chmod(d / f"{base}.key", 0o600)
        ident = Identity(role, name)
        san = ",".join([f"URI:{ident.uri(trust_domain)}",
                        f"DNS:{identity_dns(ident, trust_domain)}", *san_hosts])
        (d / f"{base}.ext").write_text(f"subjectAltName={san}\n"
                                       "extendedKeyUsage=serverAuth,clientAuth\n")
        run("x509", "-req", "-in", f"{base}.csr", "-CA", f"{ca_name}.crt", "-CAkey",
            f"{ca_name}.key", "-CAcreateserial", "-out", f"{base}.crt", "-days", "1",
            "-extfile", f"{base}.ext")
        certs[label.replace("-", ":") + identity] = (str(d / f"{base}.crt"),
                                                      str(d / f"{base}.key"))

    ca("ca")
    for ident in identities:
        leaf(ident, "ca")
    foreign = list(foreign)
    if foreign:
        ca("other-ca")
        for ident in foreign:
            leaf(ident, "other-ca", "other-")
    return ClusterPki(str(d), str(d / "ca.crt"), trust_domain, certs,
                      str(d / "other-ca.crt") if foreign else "")
