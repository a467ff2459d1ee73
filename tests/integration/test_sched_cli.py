"""`dualpath scheduler` as a real daemon (subprocess on 127.0.0.1, port 0) and the
`dualpath ctl` / `dualpath submit` commands against it: tables, --json, exit codes, and
graceful shutdown on SIGTERM."""

import asyncio
import contextlib
import json
import queue
import re
import signal
import subprocess
import sys
import threading

import pytest

from dualpath import cli
from dualpath.scheduler.client import SchedulerClient
from dualpath.v1 import scheduler_pb2 as pb

TOKEN = "cli-test-token"


class DaemonLog:
    """The daemon's stderr, read line by line on a thread (a select() on the pipe would
    miss lines already sitting in the reader's buffer)."""

    def __init__(self, proc):
        self.lines: queue.Queue = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._pump, args=(proc.stderr,), daemon=True).start()

    def _pump(self, stream):
        for line in stream:
            self.lines.put(line)
        self.lines.put(None)

    def wait_for(self, pattern, limit_s=60.0):
        """The first match of ``pattern`` in the lines to come (bounded wait, not a test
        of speed: a daemon silent for a minute is broken)."""
        while True:
            try:
                line = self.lines.get(timeout=limit_s)
            except queue.Empty:
                raise AssertionError("daemon said nothing for a minute:\n"
                                     + "".join(self.seen)) from None
            if line is None:
                raise AssertionError("daemon exited:\n" + "".join(self.seen))
            self.seen.append(line)
            m = re.search(pattern, line)
            if m:
                return m


def stops_cleanly(proc, log: DaemonLog, node_id: str) -> None:
    """SIGTERM a node daemon: it says it is shutting down and exits 0 (bounded wait)."""
    proc.send_signal(signal.SIGTERM)
    log.wait_for(rf"{node_id}: shutting down")
    assert proc.wait(timeout=60) == 0


def tls_toml(pki, identity) -> str:
    return "[tls]\n" + "".join(f'{k} = "{v}"\n' for k, v in pki.section(identity).items())


@contextlib.contextmanager
def tls_scheduler(d, scheduler_toml: str):
    """A mutual-TLS scheduler subprocess in ``d`` with the admin TOKEN (``scheduler_toml``:
    more [scheduler] lines); yields (address, pki, client config path, process, log)."""
    from dualpath import tls

    pki = tls.make_cluster_pki(d / "pki", ("scheduler/scheduler", "node/node-1", "node/node-7",
                                           "client/ctl"))
    (d / "token").write_text(TOKEN + "\n")
    cfg = d / "scheduler.toml"
    cfg.write_text(f'[scheduler]\nadmin_token_file = "{d / "token"}"\n'
                   'model_profile = "ds27b"\n' + scheduler_toml
                   + tls_toml(pki, "scheduler/scheduler"))
    client_cfg = d / "client.toml"
    client_cfg.write_text(tls_toml(pki, "client/ctl"))
    proc = subprocess.Popen([sys.executable, "-m", "dualpath.cli", "scheduler", "--config",
                             str(cfg), "--listen", "127.0.0.1:0"],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    try:
        log = DaemonLog(proc)
        m = log.wait_for(r"listening on 127\.0\.0\.1:(\d+)")
        yield f"127.0.0.1:{m.group(1)}", pki, client_cfg, proc, log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    from dualpath import tls

    d = tmp_path_factory.mktemp("sched")
    with tls_scheduler(d, 'metrics_listen = "127.0.0.1:0"\n') as (addr, pki, client_cfg,
                                                                   proc, log):
        async def register():
            async with SchedulerClient(addr, credentials=tls.channel_credentials(
                    pki.config("node/node-7"))) as c:
                info = [pb.EngineInfo(engine_id=f"node-7/e{k}", rank=k, node_id="node-7",
                                      hbm_bytes=1 << 30) for k in range(2)]
                await c.register_group("node-7", pb.ENGINE_ROLE_DECODE, info)

        asyncio.run(register())
        yield {"addr": addr, "token_file": str(d / "token"), "proc": proc, "log": log,
               "startup": "".join(log.seen), "config": str(client_cfg)}


def ctl(capsys, *argv):
    rc = cli.main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_startup_log_names_address_tls_mode_and_config(daemon):
    line = daemon["startup"]
    assert "mutual-tls" in line and "admin token set" in line
    assert "scheduler.toml" in line and "model ds27b" in line
    assert re.search(r"metrics http://127\.0\.0\.1:\d+/metrics", line)


def test_ctl_engines_in_a_real_subprocess(daemon):
    # The command an operator types, as its own process.
    out = subprocess.run([sys.executable, "-m", "dualpath.cli", "ctl", "engines",
                          "--scheduler", daemon["addr"], "--token-file", daemon["token_file"],
                          "--config", daemon["config"]],
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split()[:4] == ["ENGINE", "GROUP", "NODE", "ROLE"]
    assert [ln.split()[0] for ln in lines[1:]] == ["node-7/e0", "node-7/e1"]
    assert all(" decode " in ln and " up " in ln for ln in lines[1:])


def test_ctl_json_groups_stats_drain_set_and_submit(daemon, capsys):
    a = ["--scheduler", daemon["addr"], "--token-file", daemon["token_file"],
         "--config", daemon["config"]]
    rc, out, _ = ctl(capsys, "ctl", "engines", "--json", *a)
    assert rc == 0
    engines = json.loads(out)["engines"]
    assert [e["engine_id"] for e in engines] == ["node-7/e0", "node-7/e1"]
    assert engines[0]["role"] == "ENGINE_ROLE_DECODE" and engines[0]["drained"] is False
    assert engines[0]["free_hbm_bytes"] > 0  # a number, not protobuf's JSON string

    rc, out, _ = ctl(capsys, "ctl", "groups", *a)
    assert rc == 0 and "node-7" in out and "decode" in out

    rc, out, _ = ctl(capsys, "submit", "--prompt-tokens", "4000", "--hit-tokens", "3500",
                     "--count", "3", "--json", "--scheduler", daemon["addr"], "--config",
                     daemon["config"])
    assert rc == 0 and len(json.loads(out)["request_ids"]) == 3

    rc, out, _ = ctl(capsys, "ctl", "stats", "--json", *a)
    st = json.loads(out)
    assert rc == 0 and st["submitted_requests_total"] == 3
    assert st["model_profile"] == "ds27b"

    rc, out, _ = ctl(capsys, "ctl", "drain", "node-7/e1", *a)
    assert rc == 0 and out.strip() == "engine node-7/e1 drained"
    rc, out, _ = ctl(capsys, "ctl", "engines", "--json", *a)
    assert [e["drained"] for e in json.loads(out)["engines"]] == [False, True]

    rc, out, _ = ctl(capsys, "ctl", "set", "alpha=1234", "quota=250", "split_read=true",
                     "--json", *a)
    p = json.loads(out)["params"]
    assert rc == 0 and (p["alpha_tokens"], p["compute_quota_ms"], p["split_read"]) == \
        (1234, 250, True)


def test_exit_codes(daemon, capsys, monkeypatch):
    a = ["--scheduler", daemon["addr"], "--config", daemon["config"]]
    # 3: refused for lack of a token (a client certificate is not an admin's), or for a
    # wrong token (from the environment).
    monkeypatch.delenv("DUALPATH_ADMIN_TOKEN", raising=False)
    rc, _, err = ctl(capsys, "ctl", "engines", *a)
    assert rc == 3 and "PERMISSION_DENIED" in err and "the caller is client/ctl" in err
    monkeypatch.setenv("DUALPATH_ADMIN_TOKEN", "wrong")
    rc, _, err = ctl(capsys, "ctl", "stats", *a)
    assert rc == 3 and "PERMISSION_DENIED" in err
    monkeypatch.setenv("DUALPATH_ADMIN_TOKEN", TOKEN)
    # 1: the scheduler refused the operation.
    rc, _, err = ctl(capsys, "ctl", "drain", "no-such-engine", *a)
    assert rc == 1 and "NOT_FOUND" in err
    # 2: bad usage, caught before or by the scheduler.
    rc, _, err = ctl(capsys, "ctl", "set", "gamma=1", *a)
    assert rc == 2 and "gamma=1" in err
    rc, _, err = ctl(capsys, "ctl", "set", "quota=0", *a)
    assert rc == 2 and "INVALID_ARGUMENT" in err
    rc, out, err = ctl(capsys, "submit", "--prompt-tokens", "0", *a)
    assert rc == 2 and "--prompt-tokens must be >= 1" in err      # before sending
    rc, out, err = ctl(capsys, "submit", "--prompt-tokens", "100000000", *a)
    assert rc == 2 and "rejected: #0: too large: request (unnamed): 100000128 tokens" in out
    # 0: the same request again (same id, same trajectory) is a retry, accepted.
    rc, out, _ = ctl(capsys, "submit", "--prompt-tokens", "5", "--id", "dup",
                     "--trajectory", "t-dup", *a)
    assert rc == 0
    rc, out, _ = ctl(capsys, "submit", "--prompt-tokens", "5", "--id", "dup",
                     "--trajectory", "t-dup", *a)
    assert rc == 0 and "already submitted (not queued again): dup" in out
    # 1: a request refused for a reason that is not the input's (its id is taken by a
    # request with other content: another trajectory).
    rc, out, _ = ctl(capsys, "submit", "--prompt-tokens", "5", "--id", "dup", *a)
    assert rc == 1 and "rejected: dup: duplicate" in out
    with pytest.raises(SystemExit) as e:
        cli.main(["ctl", "--no-such-flag"])
    assert e.value.code == 2
    # 3: nothing listens there (port 1 on loopback is closed).
    rc, _, err = ctl(capsys, "ctl", "engines", "--scheduler", "127.0.0.1:1", "--config",
                     daemon["config"])
    assert rc == 3 and "UNAVAILABLE" in err


def test_sigterm_shuts_down_gracefully(daemon):
    # Runs last in this module (pytest keeps file order): it stops the shared daemon.
    proc = daemon["proc"]
    proc.send_signal(signal.SIGTERM)
    daemon["log"].wait_for(r"shutting down")
    assert proc.wait(timeout=60) == 0


@pytest.mark.parametrize("flag, value", [("--prompt-tokens", "-5"), ("--hit-tokens", "-1"),
                                         ("--max-new-tokens", str(2**64)),
                                         ("--count", "0"), ("--prompt-tokens", "ten")])
def test_submit_bad_numbers_are_usage_errors_before_connecting(capsys, flag, value):
    # A negative count reached protobuf's uint64 field: ValueError traceback, exit 1.
    # Port 1 is closed, so reaching the network would give exit 3, not 2.
    argv = ["submit", "--prompt-tokens", "10", flag, value, "--scheduler", "127.0.0.1:1"]
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and flag in err and "Traceback" not in err
