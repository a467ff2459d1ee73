"""`dualpath up` SIGKILLed: every process it started dies with it (PR_SET_PDEATHSIG in each
child, process groups swept by the janitor) and its work directory is removed. SIGKILL
leaves `up` no chance to clean up itself, which is the point. Waits poll for the end
state; only a generous deadline turns a hang into a failure (no timed assertions)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dualpath.cluster.local import write_toml

pytestmark = pytest.mark.slow
HANG_S = 90


def children(pid: int) -> set[int]:
    """Every live descendant of ``pid`` (from /proc)."""
    parent: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parent[int(d.name)] = int(fields[1])
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out.update(kids)
        todo += kids
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_for(cond, what):
    deadline = time.monotonic() + HANG_S
    while not cond():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.1)


def test_sigkill_of_dualpath_up_leaves_no_process_and_no_work_directory(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    cfg = tmp_path / "up.toml"
    write_toml(cfg, {"cluster": {"prefill_nodes": 1, "decode_nodes": 1},
                     "transport": {"kind": "tcp"},
                     "buffers": {"pe_buffer_mib": 32, "de_buffer_mib": 32},
                     "engine": {"prefill_hbm_mib": 32, "decode_hbm_mib": 32}})
    env = dict(os.environ, TMPDIR=str(tmp))
    up = subprocess.Popen([sys.executable, "-m", "dualpath.cli", "up", "--config", str(cfg)],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        lines = []
        for line in up.stdout:
            lines.append(line)
            if line.startswith("dualpath up: scheduler"):
                break
        assert up.poll() is None, "".join(lines)
        work = [d for d in tmp.iterdir() if d.name.startswith("dualpath-cluster-")]
        assert len(work) == 1 and (work[0] / "logs").is_dir()
        started = children(up.pid)
        # The scheduler, two nodes and the janitor at least.
        assert len(started) >= 4, started
        up.send_signal(signal.SIGKILL)
        up.wait()
        wait_for(lambda: not any(alive(p) for p in started), "its processes exit")
        wait_for(lambda: not work[0].exists(), "its work directory is removed")
    finally:
        if up.poll() is None:
            up.kill()
