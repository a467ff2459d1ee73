"""systemd's notification protocol for real: each daemon runs as a process with
NOTIFY_SOCKET (and WATCHDOG_USEC) pointing at a datagram socket of the test's, as
systemd would for a Type=notify unit, and says READY=1 once it serves, STATUS= lines,
WATCHDOG=1 pings, STOPPING=1 on SIGTERM (exit 0)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from dualpath import tls
from tests.integration.test_sched_cli import DaemonLog, tls_toml


class NotifySocket:
    """What systemd listens on: one datagram per notification."""

    def __init__(self, path):
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.got: list[dict[str, str]] = []

    def env(self, watchdog_usec: int = 0) -> dict[str, str]:
        e = {**os.environ, "NOTIFY_SOCKET": self.path}
        if watchdog_usec:
            e["WATCHDOG_USEC"] = str(watchdog_usec)
        return e

    def wait_for(self, key: str, value: str | None = None, limit_s: float = 60.0) -> dict:
        """The first notification to come with ``key`` (= ``value``); a liveness bound."""
        deadline = time.monotonic() + limit_s
        while True:
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                data = self.sock.recv(4096).decode()
            except TimeoutError:
                raise AssertionError(f"no {key} in {limit_s} s; got {self.got}") from None
            msg = dict(line.split("=", 1) for line in data.splitlines())
            self.got.append(msg)
            if key in msg and (value is None or msg[key] == value):
                return msg

    def close(self):
        self.sock.close()


@pytest.fixture
def notify(tmp_path):
    n = NotifySocket(tmp_path / "notify.sock")
    yield n
    n.close()


def _stop(proc, notify):
    proc.send_signal(signal.SIGTERM)
    stopping = notify.wait_for("STOPPING", "1")
    assert proc.wait(timeout=60) == 0
    return stopping


@contextlib.contextmanager
def daemon(args, notify):
    """``dualpath ARGS`` as systemd would run a Type=notify unit (a 0.2 s watchdog);
    killed if the test leaves it running."""
    proc = subprocess.Popen([sys.executable, "-m", "dualpath.cli", *args],
                            env=notify.env(watchdog_usec=200_000), stderr=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, text=True)
    try:
        yield proc, DaemonLog(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_node_says_ready_then_how_registration_goes_and_pings_the_watchdog(tmp_path,
                                                                              notify):
    cfg = tmp_path / "node.toml"
    cfg.write_text(f'[storage]\ndir = "{tmp_path / "kv"}"\n[transport]\nkind = "tcp"\n'
                   "[buffers]\npe_buffer_mib = 8\n[engine]\nprefill_hbm_mib = 16\n"
                   'metrics_listen = ""\n[tls]\nplaintext = true\n')
    with daemon(["node", "--role", "prefill", "--node-id", "p0", "--scheduler",
                 "127.0.0.1:1", "--config", str(cfg)], notify) as (proc, log):
        ready = notify.wait_for("READY", "1")
        address = log.wait_for(r"prefill node p0 up: control (\S+);").group(1)
        assert ready["STATUS"].startswith(f"serving on {address}; ")
        assert "registering with scheduler 127.0.0.1:1" in ready["STATUS"]
        # Nothing listens on port 1: up, not registered, and it says so.
        st = notify.wait_for("STATUS")
        while "UNAVAILABLE" not in st["STATUS"]:
            st = notify.wait_for("STATUS")
        assert "not registered yet" in st["STATUS"]
        notify.wait_for("WATCHDOG", "1")
        notify.wait_for("WATCHDOG", "1")
        assert "p0: stopping" in _stop(proc, notify)["STATUS"]


def test_the_scheduler_says_ready_with_its_address_and_stops(tmp_path, notify):
    pki = tls.make_cluster_pki(tmp_path / "pki", ("scheduler/scheduler",))
    cfg = tmp_path / "scheduler.toml"
    cfg.write_text('[scheduler]\nmetrics_listen = ""\n' + tls_toml(pki, "scheduler/scheduler"))
    with daemon(["scheduler", "--config", str(cfg), "--listen", "127.0.0.1:0"],
                notify) as (proc, log):
        port = log.wait_for(r"scheduler listening on 127\.0\.0\.1:(\d+)").group(1)
        ready = notify.wait_for("READY", "1")
        assert ready["STATUS"].startswith(f"serving on 127.0.0.1:{port}, mutual-tls; ")
        assert "journal" in ready["STATUS"]
        notify.wait_for("WATCHDOG", "1")
        assert "stopping" in _stop(proc, notify)["STATUS"]


def test_without_systemd_nothing_is_sent_and_a_dead_socket_is_not_fatal(tmp_path):
    from dualpath.sdnotify import Notifier

    assert not Notifier({}).send(READY="1")
    n = Notifier({"NOTIFY_SOCKET": str(tmp_path / "nobody-listens"),
                  "WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "1"})
    assert n.enabled and n.watchdog_s is None        # the watchdog is another process's
    assert not n.send(READY="1") and not n.send(STATUS="x")
    assert Notifier({"NOTIFY_SOCKET": "@x", "WATCHDOG_USEC": "4000000"}).watchdog_s == 2.0
