"""The shipped systemd units: `systemd-analyze verify` accepts each one with ExecStart
pointing at this test's install (no warning either), and each is a Type=notify unit
with a watchdog and the hardening the daemons can live with."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
UNITS = sorted(p.name for p in DEPLOY.glob("*.service"))
INSTALLED = "/opt/dualpath/.venv/bin/dualpath"


def _service(text: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    section = ""
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("["):
            section = line.strip("[]")
        elif line and not line.startswith("#") and section == "Service":
            k, v = line.split("=", 1)
            out.setdefault(k, []).append(v)
    return out


def test_every_unit_is_found():
    assert UNITS == ["dualpath-decode@.service", "dualpath-prefill@.service",
                     "dualpath-scheduler.service"]


@pytest.mark.parametrize("name", UNITS)
def test_systemd_analyze_verifies_the_unit(tmp_path, name):
    exe = Path(sys.executable).parent / "dualpath"
    assert exe.exists(), f"{exe}: the console script of this install"
    text = (DEPLOY / name).read_text()
    assert INSTALLED in text
    text = (text.replace(INSTALLED, str(exe)).replace("/mnt/kvstore", str(tmp_path))
            .replace("/etc/dualpath", str(tmp_path)))
    unit = tmp_path / name.replace("@.", "@n0.")      # an instance of a template
    unit.write_text(text)
    analyze = shutil.which("systemd-analyze")
    assert analyze, "systemd-analyze is missing: tools/install-system-packages.sh has it"
    r = subprocess.run([analyze, "verify", "--man=no", str(unit)], capture_output=True,
                       text=True, timeout=120, check=False)
    assert r.returncode == 0 and not r.stdout.strip() and not r.stderr.strip(), (
        r.returncode, r.stdout, r.stderr)


@pytest.mark.parametrize("name", UNITS)
def test_units_wait_for_ready_run_a_watchdog_and_are_hardened(name):
    svc = _service((DEPLOY / name).read_text())
    assert svc["Type"] == ["notify"] and svc["NotifyAccess"] == ["main"]
    assert int(svc["WatchdogSec"][0]) >= 10
    for key in ("NoNewPrivileges", "ProtectHome", "PrivateTmp", "ProtectKernelModules"):
        assert svc[key] == ["yes"], key
    assert svc["ProtectSystem"] == ["strict"] and svc["CapabilityBoundingSet"] == [""]
    if name.startswith("dualpath-scheduler"):
        assert svc["PrivateDevices"] == ["yes"]
    else:      # RDMA: the devices stay visible, memlock is raised, netlink is allowed
        assert "PrivateDevices" not in svc
        assert svc["LimitMEMLOCK"] == ["infinity"]
        assert "AF_NETLINK" in svc["RestrictAddressFamilies"][0].split()
