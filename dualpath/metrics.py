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
from dataclasses import dataclass
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
    start_http_server,
)

from dualpath.errors import UsageError
from dualpath.rpc import parse_listen

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

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def start_metrics_server(listen: str, registry: CollectorRegistry,
                         what: str = "metrics_listen") -> MetricsServer | None:
    """Serve ``registry`` at ``http://listen/metrics`` on a daemon thread; ``listen`` ""
    means off (returns None), port 0 picks a free port (see ``.port``). ``what`` names
    the setting in errors (e.g. ``scheduler.metrics_listen``)."""
    if not listen:
        return None
    host, port = parse_listen(listen, what)
    try:
        httpd, _thread = start_http_server(port, addr=host, registry=registry)
    except OSError as e:  # address in use, not ours: say which setting, no traceback
        raise UsageError(f"{what} = {listen!r}: cannot listen ({e.strerror})") from None
    srv = MetricsServer(host, httpd.server_port, httpd)
    log.info("metrics: serving %s", srv.url)
    return srv


def render(registry: CollectorRegistry) -> str:
    """The exposition text (what /metrics returns), for tests and `ctl`."""
    return generate_latest(registry).decode()
