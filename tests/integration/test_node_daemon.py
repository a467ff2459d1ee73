"""`dualpath node` as a real process: the start-up line names the transport with what it
actually uses and the KV lane, /metrics labels the transport in use, and SIGTERM ends it cleanly (exit 0) even while its
scheduler is unreachable (127.0.0.1:1: nothing listens on port 1)."""

import re
import subprocess
import sys
import urllib.request

from tests.integration.test_sched_cli import DaemonLog, stops_cleanly


def test_node_startup_line_and_sigterm(tmp_path):
    cfg = tmp_path / "node.toml"
    cfg.write_text(f'[storage]\ndir = "{tmp_path / "kv"}"\n[transport]\nkind = "tcp"\n'
                   "[kv_lane]\nservice_level = 3\ntraffic_class = 96\n"
                   "[buffers]\npe_buffer_mib = 8\n[engine]\nprefill_hbm_mib = 16\n"
                   'metrics_listen = "127.0.0.1:0"\n[tls]\nplaintext = true\n')
    proc = subprocess.Popen([sys.executable, "-m", "dualpath.cli", "node", "--role",
                             "prefill", "--node-id", "p0", "--scheduler", "127.0.0.1:1",
                             "--config", str(cfg)],
                            stderr=subprocess.PIPE, text=True)
    try:
        log = DaemonLog(proc)
        # The metrics server starts (and says where) before the start-up line.
        url = log.wait_for(r"serving (http://127\.0\.0\.1:\d+/metrics)").group(1)
        line = log.wait_for(r"prefill node p0 up: .*").group(0)
        # The config's "auto" placeholders (device (auto), GID index -1) were printed
        # beside the provider's real description; now only what is in use.
        assert re.search(r"transport tcp \(tcp listening on 127\.0\.0\.1:\d+, admission by "
                         r"credential\)", line), line
        assert "lane SL 3 / TC 96" in line and "GID index -1" not in line
        assert "TLS plaintext" in line and "engine emulated (cost model of demo" in line
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        assert 'dualpath_node_transport_info{transport="tcp"} 1.0' in text, text[:2000]
        log.wait_for(r"scheduler 127\.0\.0\.1:1: UNAVAILABLE")
        stops_cleanly(proc, log, "p0")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_node_refuses_plaintext_on_a_non_loopback_address(tmp_path):
    cfg = tmp_path / "node.toml"
    cfg.write_text(f'[storage]\ndir = "{tmp_path / "kv"}"\n[transport]\nkind = "tcp"\n'
                   '[engine]\ncontrol_listen = "0.0.0.0:0"\nmetrics_listen = ""\n'
                   "[tls]\nplaintext = true\n")
    r = subprocess.run([sys.executable, "-m", "dualpath.cli", "node", "--role", "prefill",
                        "--node-id", "p0", "--scheduler", "127.0.0.1:1", "--config",
                        str(cfg)], check=False, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "engine.control_listen = '0.0.0.0:0': plaintext gRPC" in r.stderr, r.stderr[-2000:]
