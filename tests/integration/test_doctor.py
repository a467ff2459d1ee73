"""`dualpath doctor` on this host, for real: what it finds (the store and O_DIRECT, a
port that is taken, TLS files that match or do not), its JSON, and its exit status (the
worst result: 0 ok, 1 warn, 2 fail)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from dualpath import tls


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    return tls.make_cluster_pki(d, ["node/n0", "node/n1"])


def doctor(tmp_path, tls_section: dict, *, control_listen: str = "127.0.0.1:0"):
    cfg = tmp_path / "node.toml"
    cfg.write_text(f'[storage]\ndir = "{tmp_path / "kv"}"\n[buffers]\npe_buffer_mib = 2\n'
                   'huge_pages = "off"\n[engine]\nprefill_hbm_mib = 2\n'
                   f'control_listen = "{control_listen}"\n[transport]\nkind = "tcp"\n'
                   "[tls]\n" + "".join(f'{k} = "{v}"\n' for k, v in tls_section.items()))
    r = subprocess.run([sys.executable, "-m", "dualpath.cli", "doctor", "--config", str(cfg),
                        "--json"], capture_output=True, text=True, timeout=120, check=False)
    assert r.stdout, r.stderr
    out = json.loads(r.stdout)
    return r.returncode, out, {c["check"]: c for c in out["checks"]}


def test_a_good_host_config_passes_what_this_host_can(tmp_path, pki):
    rc, out, c = doctor(tmp_path, pki.section("node/n0"))
    assert c["store"]["status"] == "ok" and str(tmp_path / "kv") in c["store"]["detail"]
    # ext4/xfs take O_DIRECT; a tmpfs /tmp does not, and the doctor says so
    assert (c["o_direct"]["status"], c["store"]["detail"].endswith("tmpfs")) in (
        ("ok", False), ("warn", True))
    # the throw-away PKI lives a day: matching files, and a warning about the date
    assert c["tls"]["status"] == "warn" and "expires in 1.0 days" in c["tls"]["detail"]
    assert c["memlock"]["status"] in ("ok", "fail")   # the host's limit decides
    assert c["rdma devices"]["status"] == "ok"        # transport tcp: not needed
    assert c["kv lane"]["status"] == "ok"
    assert rc == {"ok": 0, "warn": 1, "fail": 2}[out["worst"]]


def test_a_taken_port_and_a_foreign_key_fail_naming_them(tmp_path, pki):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    port = s.getsockname()[1]
    try:
        other = pki.section("node/n1")
        sec = {**pki.section("node/n0"), "key_file": other["key_file"]}
        rc, out, c = doctor(tmp_path, sec, control_listen=f"127.0.0.1:{port}")
    finally:
        s.close()
    assert rc == 2 and out["worst"] == "fail"
    assert c["ports"]["status"] == "fail" and f"127.0.0.1:{port}" in c["ports"]["detail"]
    assert c["tls"]["status"] == "fail" and "does not go with" in c["tls"]["detail"]


def test_usage_errors_exit_2_and_the_text_form_prints_fixes(tmp_path):
    r = subprocess.run([sys.executable, "-m", "dualpath.cli", "doctor", "--role", "nope"],
                       capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 2 and "--role" in r.stderr
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[storage]\ndir = "{tmp_path / "kv"}"\n[tls]\nplaintext = true\n')
    r = subprocess.run([sys.executable, "-m", "dualpath.cli", "doctor", "--config", str(cfg)],
                       capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode in (1, 2), r.stderr
    assert "WARN  tls" in r.stdout and "fix: give [tls]" in r.stdout
