"""`dualpath doctor` on a host with RDMA (the SoftRoCE guest): the devices and their
ACTIVE ports, the RoCE v2 IPv4 GID, the MTU and NUMA checks, with transport verbs."""

from __future__ import annotations

import json
import subprocess
import sys


def test_doctor_sees_the_softroce_ports_and_their_gids(dev_names, tmp_path):
    dev = dev_names[0]
    cfg = tmp_path / "node.toml"
    cfg.write_text(f'[storage]\ndir = "{tmp_path / "kv"}"\n[transport]\nkind = "verbs"\n'
                   f'device = "{dev}"\n[buffers]\npe_buffer_mib = 2\nhuge_pages = "off"\n'
                   "[engine]\nprefill_hbm_mib = 2\n[tls]\nplaintext = true\n")
    r = subprocess.run([sys.executable, "-m", "dualpath.cli", "doctor", "--config", str(cfg),
                        "--json"], capture_output=True, text=True, timeout=120, check=False)
    out = json.loads(r.stdout)
    c = {x["check"]: x for x in out["checks"]}
    assert c["rdma devices"]["status"] == "ok", c["rdma devices"]
    assert f"{dev} port 1 ACTIVE (RoCE" in c["rdma devices"]["detail"]
    assert c[f"gid {dev}"]["status"] == "ok" and "RoCE v2 IPv4 GID at index" in c[
        f"gid {dev}"]["detail"]
    # rxe on a 1500-byte veth runs RoCE MTU 1024: the doctor says it and how to fix it
    mtu = c[f"mtu {dev}"]
    assert (mtu["status"] == "ok") == (" MTU 4096" in c["rdma devices"]["detail"])
    assert f"numa {dev}" in c
    assert r.returncode == {"ok": 0, "warn": 1, "fail": 2}[out["worst"]]
    print("\n".join(f"{x['status']:<4} {x['check']:<16} {x['detail']}" for x in out["checks"]))
