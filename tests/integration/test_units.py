"""The shipped systemd units: `systemd-analyze verify` accepts each one with ExecStart
pointing at this test's install (no warning either); each DualPath daemon is a
Type=notify unit with a watchdog and the hardening the daemons can live with, and each
vLLM instance's unit starts after its node daemon and stops with it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
UNITS = sorted(p.name for p in DEPLOY.glob("*.service"))
INSTALLED = "/opt/dualpath/.venv/bin/dualpath"
PYTHON = "/opt/dualpath/.venv/bin/python"


def _service(text: str, part: str = "Service") -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    section = ""
    lines = text.replace("\\\n", " ").splitlines()       # continued lines joined
    for line in lines:
        line = line.strip()
        if line.startswith("["):
            section = line.strip("[]")
        elif line and not line.startswith("#") and section == part:
            k, v = line.split("=", 1)
            out.setdefault(k, []).append(v)
    return out


def test_every_unit_is_found():
    assert UNITS == ["dualpath-decode@.service", "dualpath-frontend.service",
                     "dualpath-prefill@.service", "dualpath-scheduler.service",
                     "dualpath-vllm-decode@.service", "dualpath-vllm-prefill@.service"]


@pytest.mark.parametrize("name", UNITS)
def test_systemd_analyze_verifies_the_unit(tmp_path, name):
    exe = Path(sys.executable).parent / "dualpath"
    assert exe.exists(), f"{exe}: the console script of this install"
    (tmp_path / "vllm.env").write_text((DEPLOY / "vllm.env").read_text())

    def instance(name: str) -> Path:
        text = (DEPLOY / name).read_text()
        assert INSTALLED in text or PYTHON in text
        text = (text.replace(INSTALLED, str(exe)).replace(PYTHON, sys.executable)
                .replace("/mnt/kvstore", str(tmp_path))
                .replace("/etc/dualpath", str(tmp_path)))
        unit = tmp_path / name.replace("@.", "@n0.")      # an instance of a template
        unit.write_text(text)
        return unit
    units = [instance(name)]
    if name.startswith("dualpath-vllm-"):             # bound to its node's unit
        units.append(instance(name.replace("dualpath-vllm-", "dualpath-")))
    analyze = shutil.which("systemd-analyze")
    assert analyze, "systemd-analyze is missing: tools/install-system-packages.sh has it"
    r = subprocess.run([analyze, "verify", "--man=no", *map(str, units)],
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0 and not r.stdout.strip() and not r.stderr.strip(), (
        r.returncode, r.stdout, r.stderr)


DAEMONS = [u for u in UNITS if not u.startswith("dualpath-vllm-")]


@pytest.mark.parametrize("name", DAEMONS)
def test_units_wait_for_ready_run_a_watchdog_and_are_hardened(name):
    svc = _service((DEPLOY / name).read_text())
    assert svc["Type"] == ["notify"] and svc["NotifyAccess"] == ["main"]
    assert int(svc["WatchdogSec"][0]) >= 10
    for key in ("NoNewPrivileges", "ProtectHome", "PrivateTmp", "ProtectKernelModules"):
        assert svc[key] == ["yes"], key
    assert svc["ProtectSystem"] == ["strict"] and svc["CapabilityBoundingSet"] == [""]
    if name.startswith(("dualpath-scheduler", "dualpath-frontend")):
        assert svc["PrivateDevices"] == ["yes"]
    else:      # RDMA: the devices stay visible, memlock is raised, netlink is allowed
        assert "PrivateDevices" not in svc
        assert svc["LimitMEMLOCK"] == ["infinity"]
        assert "AF_NETLINK" in svc["RestrictAddressFamilies"][0].split()


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_vllm_instance_starts_after_its_node_and_stops_with_it(role):
    """Item 6 of issue 39: the instance beside node %i runs the module form (the CPU
    build has no `vllm serve`), after its node serves, bound to it, with the connector of
    its role pointing at the node's control address and config."""
    text = (DEPLOY / f"dualpath-vllm-{role}@.service").read_text()
    unit, svc = _service(text, "Unit"), _service(text)
    assert unit["After"] == unit["BindsTo"] == [f"dualpath-{role}@%i.service"]
    assert svc["EnvironmentFile"] == ["/etc/dualpath/vllm.env"]
    start = svc["ExecStart"][0]
    assert start.startswith(f"{PYTHON} -m vllm.entrypoints.openai.api_server ")
    kvt = json.loads(start.split("--kv-transfer-config ", 1)[1].strip("'"))
    assert kvt["kv_connector"] == "DualPathConnector"
    assert kvt["kv_role"] == {"prefill": "kv_producer", "decode": "kv_consumer"}[role]
    assert kvt["kv_load_failure_policy"] == "recompute"
    assert kvt["kv_connector_extra_config"] == {
        "node_address": "${DUALPATH_NODE_ADDRESS}", "config": "/etc/dualpath/cluster.toml"}
    assert svc["LimitMEMLOCK"] == ["infinity"] and "PrivateDevices" not in svc
    env = dict(line.split("=", 1) for line in (DEPLOY / "vllm.env").read_text().splitlines()
               if line and not line.startswith("#"))
    assert {"VLLM_MODEL", "VLLM_PORT", "VLLM_ARGS", "DUALPATH_NODE_ADDRESS"} <= set(env)


def test_the_multinode_config_serves_vllm_and_points_the_units_at_each_other():
    from dualpath import config

    cfg = config.load(DEPLOY / "cluster-multinode.toml")
    assert cfg.engine.kind == "vllm"
    env = dict(line.split("=", 1) for line in (DEPLOY / "vllm.env").read_text().splitlines()
               if line and not line.startswith("#"))
    assert cfg.engine.vllm_url == f"http://127.0.0.1:{env['VLLM_PORT']}"
    port = cfg.engine.control_listen.rpartition(":")[2]
    assert env["DUALPATH_NODE_ADDRESS"] == f"127.0.0.1:{port}"
    assert cfg.frontend.api_key_file and cfg.frontend.cert_file
