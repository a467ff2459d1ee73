"""`dualpath ctl top` against a real scheduler daemon (mutual TLS, admin token): one
prefill and one decode group registered, node read queues reported by a fetch, requests
submitted; `--once` and `--once --json` screens, rates that follow submissions made
between the two polls, live mode ended by SIGTERM, and a bad --interval."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys

import pytest

from dualpath import cli
from dualpath.scheduler import top
from dualpath.scheduler.client import SchedulerClient
from dualpath.v1 import scheduler_pb2 as pb
from tests.integration.test_sched_cli import tls_scheduler

ANSI = re.compile(r"\x1b\[")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    from dualpath import tls

    d = tmp_path_factory.mktemp("top")
    # A long lease: the groups never fetch again and must stay up for the whole module.
    with tls_scheduler(d, 'metrics_listen = ""\nlease_ms = 600000\n') as (addr, pki,
                                                                          client_cfg, _, _):
        node_creds = tls.channel_credentials(pki.config("node/node-7"))

        async def register():
            # Each node registers its own group, named as it is (issue 38).
            for node, role, n, read_q in (("node-1", pb.ENGINE_ROLE_PREFILL, 1, 777),
                                          ("node-7", pb.ENGINE_ROLE_DECODE, 2, 12345)):
                async with SchedulerClient(addr, credentials=tls.channel_credentials(
                        pki.config(f"node/{node}"))) as c:
                    gid = node
                    info = [pb.EngineInfo(engine_id=f"{node}/e{k}", rank=k, node_id=node,
                                          hbm_bytes=1 << 30) for k in range(n)]
                    lease = (await c.register_group(gid, role, info)).lease_id
                    # One fetch with nothing queued: the node's read queue as its leader
                    # reports it, assigning nothing.
                    await c.fetch(gid, lease, [pb.EngineStatus(
                        engine_id=e.engine_id, read_queue_tokens=read_q,
                        free_hbm_bytes=1 << 30) for e in info])

        asyncio.run(register())
        yield {"addr": addr, "token_file": str(d / "token"), "config": str(client_cfg),
               "node_creds": node_creds}


def _args(daemon):
    return ["--scheduler", daemon["addr"], "--token-file", daemon["token_file"],
            "--config", daemon["config"]]


def _specs(n: int, prefix: str) -> list[pb.RequestSpec]:
    return [pb.RequestSpec(request_id=f"{prefix}-{k}", prompt_tokens=1000, max_new_tokens=8)
            for k in range(n)]


@pytest.fixture
def submit_between_polls(monkeypatch):
    """Make `ctl top --once` submit ``n`` requests over its own connection right after
    its first poll, so the second poll sees them."""

    def arm(n: int, prefix: str) -> None:
        real = top.poll
        calls = []

        async def poll(client):
            got = await real(client)
            calls.append(got)
            if len(calls) == 1 and n:
                r = await client.submit(_specs(n, prefix))
                assert len(r.request_ids) == n, r
            return got

        monkeypatch.setattr(top, "poll", poll)

    return arm


def test_once_screen_names_groups_queue_nodes_and_a_rate_that_follows_submissions(
        daemon, capsys, submit_between_polls):
    # Nothing submitted between the polls: a zero rate, an empty queue.
    rc = cli.main(["ctl", "top", "--once", "--interval", "0.2", *_args(daemon)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert not ANSI.search(out)
    assert daemon["addr"] in out.splitlines()[0]
    assert re.search(r"^requests  queued 0 \(global 0,", out, re.MULTILINE), out
    assert re.search(r"^per s .*submitted 0\.0 ", out, re.MULTILINE), out
    # Groups and nodes share their names (a node registers its own group): a group's
    # row says its lease state where a node's names its group.
    lines = [ln.split() for ln in out.splitlines() if ln.startswith("node-")]
    rows = {w[0]: w for w in lines if w[2] in ("up", "down")}
    assert rows["node-1"][1:3] == ["prefill", "up"] and rows["node-7"][1:3] == ["decode", "up"]
    nodes = {w[0]: w for w in lines if w[2] not in ("up", "down")}
    assert nodes["node-1"][4:6] == ["0.0", "777"]        # READ_MB/S, READ_Q_TOK
    assert nodes["node-7"][4:6] == ["0.0", "12345"]
    assert "write-back is in the node's /metrics" in out

    # Six submitted between the polls: the queue holds them and the rate is 6 / interval.
    submit_between_polls(6, "between")
    rc = cli.main(["ctl", "top", "--once", "--interval", "0.5", *_args(daemon)])
    out = capsys.readouterr().out
    assert rc == 0
    assert re.search(r"^requests  queued 6 \(global 6,", out, re.MULTILINE), out
    over = float(re.search(r"\(over ([\d.]+) s\)", out).group(1))
    rate = float(re.search(r"submitted ([\d.]+)", out).group(1))
    assert over >= 0.5 and rate > 0 and abs(rate * over - 6) < 0.2, out


def test_once_json_holds_the_same_figures(daemon, capsys, submit_between_polls):
    submit_between_polls(4, "json")
    rc = cli.main(["ctl", "top", "--once", "--json", "--interval", "0.2", *_args(daemon)])
    out = capsys.readouterr().out
    assert rc == 0
    f = json.loads(out)   # one object
    assert f["scheduler"] == daemon["addr"] and f["groups_up"] == 2
    assert [(g["group_id"], g["role"], g["state"], g["engines"]) for g in f["groups"]] == \
        [("node-1", "prefill", "up", 1), ("node-7", "decode", "up", 2)]
    assert {n["node_id"]: n["read_queue_tokens"] for n in f["nodes"]} == \
        {"node-1": 777, "node-7": 12345}
    assert f["totals"]["submitted"] >= 4 and f["queued_requests"] == f["queue"]["global"]
    assert f["queued_requests"] >= 4
    assert f["rates"]["submitted_per_s"] * f["rates_over_s"] == pytest.approx(4, abs=0.1)
    assert all(v is not None and v >= 0 for v in f["rates"].values())
    assert f["rates"]["completed_per_s"] == 0


def test_live_mode_appends_plain_screens_and_exits_0_on_sigterm(daemon):
    proc = subprocess.Popen([sys.executable, "-m", "dualpath.cli", "ctl", "top",
                             "--interval", "0.1", *_args(daemon)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        heads = 0
        seen = []
        for line in proc.stdout:   # a pipe, not a terminal: screens appended, no ANSI
            seen.append(line)
            if line.startswith("dualpath top"):
                heads += 1
                if heads == 3:
                    break
        assert heads == 3, "".join(seen) + proc.stderr.read()
        proc.send_signal(signal.SIGTERM)
        rest, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    text = "".join(seen) + rest
    assert not ANSI.search(text) and "Traceback" not in err
    # The first screen has no rates yet (one poll), later ones do.
    per_s = re.findall(r"^per s .*$", text, re.MULTILINE)
    assert "submitted -" in per_s[0] and re.search(r"submitted \d+\.\d", per_s[1])


@pytest.mark.parametrize("value", ["0", "0.05", "61", "nan", "inf", "soon"])
def test_bad_interval_is_a_usage_error_naming_the_flag(capsys, value):
    # Port 1 is closed: reaching the network would give exit 3, not 2.
    with pytest.raises(SystemExit) as e:
        cli.main(["ctl", "top", "--once", "--interval", value, "--scheduler", "127.0.0.1:1"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--interval" in err and "Traceback" not in err


def test_unreachable_scheduler_exits_3(daemon, capsys):
    rc = cli.main(["ctl", "top", "--once", "--interval", "0.1", "--scheduler", "127.0.0.1:1",
                   "--config", daemon["config"]])
    assert rc == 3 and "UNAVAILABLE" in capsys.readouterr().err
