"""Transport choice: ``[transport] kind = "auto" | "verbs" | "tcp"``.

``auto`` uses verbs when a device has an ACTIVE port and TCP otherwise, and logs which
and why; ``verbs`` refuses to start without a usable device. The choice is kept for the
metrics module (:func:`selected_transport`, a label value) and for start-up logs.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable
from dataclasses import dataclass

from dualpath.config_sections import KvLaneConfig, TransportConfig
from dualpath.errors import DualPathError, RdmaError
from dualpath.transfer.config import TransferConfig
from dualpath.transfer.provider import Provider

log = logging.getLogger("dualpath.transfer")


@dataclass(frozen=True)
class TransportChoice:
    kind: str       # "verbs" | "tcp"
    reason: str     # one line for the log: why this one


@dataclass(frozen=True)
class VerbsProbe:
    usable: bool
    reason: str     # "rxe0 port 1 is ACTIVE" / "no RDMA device (dp_device_list found none)"


def probe_verbs(cfg: TransportConfig) -> VerbsProbe:
    """Is there a device (cfg.device, or any) whose port cfg.port is ACTIVE?"""
    try:
        from dualpath import verbs
    except ImportError as e:    # an extension built without verbs
        return VerbsProbe(False, f"verbs support is not available ({e})")
    try:
        names = verbs.list_devices()
        if not names:
            return VerbsProbe(False, "no RDMA device (dp_device_list found none)")
        if cfg.device and cfg.device not in names:
            return VerbsProbe(False, f"no RDMA device named {cfg.device!r} "
                              f"(present: {', '.join(names)})")
        with verbs.Device(cfg.device or None, cfg.port) as dev:
            attrs = dev.port_attrs()
            if not attrs.active:
                return VerbsProbe(False, f"{dev.name} port {cfg.port} is not ACTIVE "
                                  f"(state {attrs.state})")
            return VerbsProbe(True, f"{dev.name} port {cfg.port} is ACTIVE")
    except DualPathError as e:
        return VerbsProbe(False, f"cannot use {cfg.device or 'any RDMA device'}: {e}")


_selected: str | None = None


def select_transport(cfg: TransportConfig,
                     probe: Callable[[TransportConfig], VerbsProbe] = probe_verbs
                     ) -> TransportChoice:
    """Choose per ``cfg.kind`` and log the choice; RdmaError(ENODEV) when ``verbs`` is
    required and no device is usable."""
    global _selected
    if cfg.kind == "tcp":
        choice = TransportChoice("tcp", "transport.kind = 'tcp'")
    else:
        p = probe(cfg)
        if cfg.kind == "verbs":
            if not p.usable:
                raise RdmaError(errno.ENODEV, f"transport.kind = 'verbs' but no RDMA device "
                                f"is usable: {p.reason}; set transport.kind = 'tcp' (or "
                                "'auto') to use the TCP provider on this host")
            choice = TransportChoice("verbs", f"transport.kind = 'verbs': {p.reason}")
        elif p.usable:
            choice = TransportChoice("verbs", f"auto chose verbs: {p.reason}")
        else:
            choice = TransportChoice("tcp", f"auto chose tcp: {p.reason}")
    log.info("transport: %s (%s)", choice.kind, choice.reason)
    _selected = choice.kind
    return choice


def selected_transport() -> str:
    """The last transport chosen in this process ("verbs" | "tcp"), "none" before any:
    the value of the transport label on metrics."""
    return _selected or "none"


def open_provider(choice: TransportChoice, transport: TransportConfig,
                  transfer: TransferConfig, lane: KvLaneConfig | None = None) -> Provider:
    """The provider for a choice, configured from the three sections; logs what it opened."""
    if choice.kind == "verbs":
        from dualpath.transfer.verbs_provider import VerbsProvider

        lane = lane or KvLaneConfig()
        provider: Provider = VerbsProvider(
            transport.device, transport.port, transport.gid_index, cq_depth=transfer.cq_depth,
            service_level=lane.service_level, traffic_class=lane.traffic_class)
    else:
        from dualpath.transfer.tcp_provider import TcpProvider

        provider = TcpProvider(
            transfer.tcp_listen, transfer.tcp_port, cq_depth=transfer.cq_depth,
            sockbuf_bytes=transfer.tcp_sockbuf_bytes,
            user_timeout_ms=transfer.tcp_user_timeout_ms, advertise=transfer.tcp_advertise)
    log.info("transport: %s", provider.description)
    return provider
