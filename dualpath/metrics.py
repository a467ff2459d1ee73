"""Prometheus metrics shared by every daemon.

Conventions (style.md §14): names start with ``dualpath_``, values are in base units
(seconds, bytes, tokens), counters end in ``_total``, latencies are histograms, and no
label ever carries a request id (labels are small closed sets: role, path, queue).

Each daemon makes one registry (:func:`new_registry`, with the process collectors), builds
its metrics on it and serves it with :func:`start_metrics_server`. Tests make a registry
per server so that two daemons in one process do not collide.

Thread safety: prometheus-client metrics are safe to update from any thread; the HTTP
server runs on its own daemon thread.
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from dualpath.errors import UsageError
from dualpath.rpc import is_loopback, parse_listen

PREFIX = "dualpath_"

# Latency buckets in seconds, from 50 µs (an in-process fetch) to 10 s.
LATENCY_BUCKETS_S = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2,
                     0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

log = logging.getLogger("dualpath.metrics")

# No `*_created` series: they double the exposition and no dashboard of ours reads them.
disable_created_metrics()


def new_registry(process: bool = True) -> CollectorRegistry:
    """A fresh registry; with ``process`` it also exports CPU, memory and fds."""
    reg = CollectorRegistry(auto_describe=True)
    if process:
        ProcessCollector(namespace="dualpath", registry=reg)
        PlatformCollector(registry=reg)
    return reg


def _name(name: str) -> str:
    if not name.startswith(PREFIX):
        raise UsageError(f"metric {name!r} must start with {PREFIX!r}")
    return name


def counter(reg: CollectorRegistry, name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
    """A counter; ``name`` must end in ``_total`` (prometheus-client adds it to the
    exposition itself, so it is given here without the suffix and checked)."""
    if not name.endswith("_total"):
        raise UsageError(f"counter {name!r} must end in _total")
    return Counter(_name(name)[: -len("_total")], doc, labels, registry=reg)


def gauge(reg: CollectorRegistry, name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
    return Gauge(_name(name), doc, labels, registry=reg)


#: What a histogram's name may end in: its base unit.
HISTOGRAM_UNITS = ("_seconds", "_ratio", "_tokens", "_requests")


def histogram(reg: CollectorRegistry, name: str, doc: str, labels: tuple[str, ...] = (),
              buckets: tuple[float, ...] = LATENCY_BUCKETS_S) -> Histogram:
    """A histogram (latencies by default); ``name`` ends in its base unit
    (:data:`HISTOGRAM_UNITS`)."""
    if not name.endswith(HISTOGRAM_UNITS):
        raise UsageError(f"histogram {name!r} must end in one of {', '.join(HISTOGRAM_UNITS)}")
    return Histogram(_name(name), doc, labels, registry=reg, buckets=buckets)


@dataclass
class MetricsServer:
    """A running /metrics endpoint; ``close()`` is idempotent."""

    host: str
    port: int
    _httpd: Any = None
    https: bool = False

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.https else 'http'}://{host}:{self.port}/metrics"

    def close(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


#: Scrapes served at once (a thread each); a connection past it is closed unanswered
#: (prometheus-client's own server started a thread per connection, unbounded).
MAX_SCRAPES = 4
#: A scrape connection that sends or takes nothing this long is closed.
SCRAPE_TIMEOUT_S = 5.0


class _Scrape(BaseHTTPRequestHandler):
    timeout = SCRAPE_TIMEOUT_S          # the socket's: a silent client is let go

    def do_GET(self) -> None:
        if self.path.partition("?")[0] not in ("/metrics", "/"):
            self.send_error(404)
            return
        body = generate_latest(self.server.registry)
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE_LATEST)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        return


class _ScrapeServer(ThreadingHTTPServer):
    """At most :data:`MAX_SCRAPES` connections served at once, each on its own daemon
    thread with :data:`SCRAPE_TIMEOUT_S` on its socket; more are closed at accept."""

    daemon_threads = True
    request_queue_size = 128            # the listen backlog (socketserver's default: 5)

    def __init__(self, host: str, port: int, registry: CollectorRegistry,
                 ssl_context: ssl.SSLContext | None = None):
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.registry = registry
        self.ssl_context = ssl_context
        self.slots = threading.BoundedSemaphore(MAX_SCRAPES)
        super().__init__((host, port), _Scrape)

    def process_request(self, request, client_address) -> None:
        if not self.slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        # The socket timeout bounds each read; this bounds the whole connection (a
        # client trickling a byte a few seconds would hold its slot for ever).
        deadline = threading.Timer(2 * SCRAPE_TIMEOUT_S, _cut, (request,))
        deadline.daemon = True
        deadline.start()
        try:
            if self.ssl_context is not None:     # the handshake on this thread, bounded
                request.settimeout(SCRAPE_TIMEOUT_S)
                try:
                    request = self.ssl_context.wrap_socket(request, server_side=True)
                except (OSError, ssl.SSLError):
                    self.shutdown_request(request)
                    return
            super().process_request_thread(request, client_address)
        finally:
            deadline.cancel()
            self.slots.release()


def _cut(sock: socket.socket) -> None:
    """End a scrape connection past its deadline (its thread then ends)."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def start_metrics_server(listen: str, registry: CollectorRegistry,
                         what: str = "metrics_listen",
                         ssl_context: ssl.SSLContext | None = None) -> MetricsServer | None:
    """Serve ``registry`` at ``http://listen/metrics`` on a daemon thread, bounded
    (:class:`_ScrapeServer`); ``listen`` "" means off (returns None), port 0 picks a free
    port (see ``.port``). ``what`` names the setting in errors (e.g.
    ``scheduler.metrics_listen``); over HTTPS with ``ssl_context`` (tls.metrics_https).
    A plain-HTTP listen address that is not loopback is logged as a warning: the figures
    name nodes, engines and queue depths to whoever reaches it."""
    if not listen:
        return None
    host, port = parse_listen(listen, what)
    try:
        httpd = _ScrapeServer(host, port, registry, ssl_context)
    except OSError as e:  # address in use, not ours: say which setting, no traceback
        raise UsageError(f"{what} = {listen!r}: cannot listen ({e.strerror})") from None
    threading.Thread(target=httpd.serve_forever, name="metrics", daemon=True).start()
    srv = MetricsServer(host, httpd.server_port, httpd, https=ssl_context is not None)
    if is_loopback(host) or srv.https:
        log.info("metrics: serving %s", srv.url)
    else:
        log.warning("metrics: serving %s beyond loopback, in plain HTTP: anyone who "
                    "reaches it reads the figures (bind %s to 127.0.0.1 and scrape "
                    "through the host, or firewall the port)", srv.url, what)
    return srv


def render(registry: CollectorRegistry) -> str:
    """The exposition text (what /metrics returns), for tests and `ctl`."""
    return generate_latest(registry).decode()


def scrape(url: str, timeout_s: float = 5.0) -> dict[str, float]:
    """A /metrics page as sample name (labels dropped, summed) -> value (tests, benches)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            out[smp.name] = out.get(smp.name, 0.0) + smp.value
    return out
