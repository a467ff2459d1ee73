"""Transport choice (`[transport] kind`) against probe fakes, and the [transfer] section."""

from __future__ import annotations

import errno
import logging

import pytest

from dualpath import config
from dualpath.config_sections import TransportConfig
from dualpath.errors import ConfigError, RdmaError
from dualpath.transfer.config import TransferConfig
from dualpath.transfer.transport import (
    VerbsProbe,
    probe_verbs,
    select_transport,
    selected_transport,
)
from dualpath.verbs import list_devices

USABLE = VerbsProbe(True, "rxe0 port 1 is ACTIVE")
NONE = VerbsProbe(False, "no RDMA device (dp_device_list found none)")


def probe_returning(result):
    calls = []

    def probe(cfg):
        calls.append(cfg)
        return result
    probe.calls = calls
    return probe


def test_auto_prefers_a_usable_device_and_logs_why(caplog):
    caplog.set_level(logging.INFO, logger="dualpath.transfer")
    choice = select_transport(TransportConfig(kind="auto"), probe_returning(USABLE))
    assert choice.kind == "verbs"
    assert "transport: verbs (auto chose verbs: rxe0 port 1 is ACTIVE)" in caplog.text
    assert selected_transport() == "verbs"


def test_auto_falls_back_to_tcp_and_logs_why(caplog):
    caplog.set_level(logging.INFO, logger="dualpath.transfer")
    choice = select_transport(TransportConfig(kind="auto"), probe_returning(NONE))
    assert choice.kind == "tcp"
    assert "auto chose tcp: no RDMA device" in caplog.text
    assert selected_transport() == "tcp"


def test_tcp_never_probes():
    probe = probe_returning(USABLE)
    assert select_transport(TransportConfig(kind="tcp"), probe).kind == "tcp"
    assert probe.calls == []


def test_verbs_without_a_device_is_enodev_with_the_reason():
    with pytest.raises(RdmaError) as ei:
        select_transport(TransportConfig(kind="verbs"), probe_returning(NONE))
    assert ei.value.errno == errno.ENODEV
    assert "no RDMA device is usable: no RDMA device (dp_device_list found none)" in str(ei.value)


def test_the_real_probe_reports_instead_of_raising():
    # No host has a device by this name: the probe says why it is unusable.
    p = probe_verbs(TransportConfig(device="no-such-rdma-device"))
    assert not p.usable
    if list_devices():
        assert "no RDMA device named 'no-such-rdma-device'" in p.reason
    else:
        assert p.reason == "no RDMA device (dp_device_list found none)"


def test_transfer_section_is_registered_and_validated(tmp_path):
    assert config.SECTIONS["transfer"] == "dualpath.transfer.config:TransferConfig"
    path = tmp_path / "c.toml"
    path.write_text("[transfer]\nconnections_per_peer = 4\nslice_bytes = 65536\n")
    cfg = config.load(path)
    assert cfg.transfer == TransferConfig(connections_per_peer=4, slice_bytes=65536)
    path.write_text("[transfer]\nconnections_per_peer = 0\n")
    with pytest.raises(ConfigError, match="transfer.connections_per_peer"):
        config.load(path)
