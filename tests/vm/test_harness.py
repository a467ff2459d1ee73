"""The SoftRoCE guest harness (tools/vm/run.sh), tested from the host by booting it.

One boot runs a probe script that prints `@`-prefixed markers; the tests below read them.
A second, cheap boot checks that a guest which dies without reporting is an error, and
two runs that never boot check argument and timeout handling.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUN_SH = ROOT / "tools" / "vm" / "run.sh"
# Every value here crosses two shells and a file on the 9p share: spaces, both quote
# kinds, `$`, a backslash and a newline.
PROBE = "a b 'c' \"d\" $HOME \\n\nsecond line"
# Out of the guest: run.sh ends with the command's status; 125 marks a guest that ended
# without reporting one, 124 the timeout (both from tools/vm/run.sh's header).
PROBE_EXIT = 7
# A small RDMA WRITE run across the veth: 200 iterations of 4 KiB (one packet each at
# the 4096-byte active MTU the guest sets up).
WRITE_ITERS = 200

PROBE_SCRIPT = r"""
echo "@cwd=$(pwd)"
printf '@probe<%s>\n' "$DUALPATH_HARNESS_PROBE"
echo "@not_passed=${HARNESS_NOT_PASSED-unset}"
for v in DUALPATH_IN_VM DUALPATH_RDMA_REQUIRED DUALPATH_RDMA_DEV_A DUALPATH_RDMA_DEV_B \
         DUALPATH_RDMA_IP_A DUALPATH_RDMA_IP_B; do echo "@env $v=${!v}"; done
rdma link show | sed 's/^/@link /'
echo "@waiting"
# Wait for the host to have seen "@waiting" (it creates ACK_DIR/ack): only possible if
# output streams while the command runs. readdir always asks the 9p server, a lookup of
# the missing name could be answered from the guest's cache.
for _ in $(seq 600); do ls ACK_DIR | grep -qx ack && break; sleep 0.2; done
ls ACK_DIR | grep -qx ack && echo "@acked" || echo "@never_acked"
# perftest's server exits with an error when a client reaches it too early, so the
# client starts only once the server listens (port 18515 = 0x4853 in LISTEN, 0A), and
# a failed pair is tried again, up to 3 times; the last pair's server rc is reported.
for _ in 1 2 3; do
  ib_write_bw -d rxe0 -x 1 -s 4096 -n ITERS >/dev/null 2>&1 &
  server=$!
  for _ in $(seq 100); do
    grep -q ':4853 00000000:0000 0A' /proc/net/tcp && break; sleep 0.1
  done
  for _ in $(seq 20); do
    ib_write_bw -d rxe1 -x 1 -s 4096 -n ITERS 10.99.0.1 >/dev/null 2>&1 && break
    sleep 0.5
  done
  wait $server; rc=$?
  [ $rc -eq 0 ] && break
done
echo "@server_rc=$rc"
echo "@rxe0_rcvd=$(cat /sys/class/infiniband/rxe0/ports/1/hw_counters/rcvd_pkts)"
echo "@veth0_rx=$(cat /sys/class/net/veth0/statistics/rx_packets)"
exit EXIT
"""


def _run_sh(*args: str, env: dict[str, str] | None = None, timeout: float = 900):
    return subprocess.run(
        [str(RUN_SH), *args], check=False, cwd=ROOT, env={**os.environ, **(env or {})},
        capture_output=True, text=True, timeout=timeout,
    )


@pytest.fixture(scope="module")
def probe_run():
    """Boot once, run PROBE_SCRIPT from tests/ (not the repo root) and collect it all."""
    cache = ROOT / ".cache" / "vm"
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="harness-", dir=cache) as ack_dir:
        script = (PROBE_SCRIPT.replace("ACK_DIR", ack_dir)
                  .replace("ITERS", str(WRITE_ITERS)).replace("EXIT", str(PROBE_EXIT)))
        env = {**os.environ, "DUALPATH_HARNESS_PROBE": PROBE, "HARNESS_NOT_PASSED": "1",
               "DUALPATH_VM_TIMEOUT": "600"}
        proc = subprocess.Popen([str(RUN_SH), script], cwd=ROOT / "tests", env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        stderr: list[str] = []
        drain = threading.Thread(target=lambda: stderr.extend(proc.stderr), daemon=True)
        drain.start()
        lines = []
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if line.strip() == "@waiting":
                Path(ack_dir, "ack").touch()
        rc = proc.wait(timeout=60)
        drain.join(timeout=60)
    return {"rc": rc, "lines": lines, "stdout": "\n".join(lines), "stderr": "".join(stderr)}


def _marker(run, name):
    values = [ln.split("=", 1)[1] for ln in run["lines"] if ln.startswith(f"@{name}=")]
    assert len(values) == 1, f"expected one @{name}= line in:\n{run['stdout']}\n{run['stderr']}"
    return values[0]


@pytest.mark.slow
def test_exit_status_of_command_is_returned(probe_run):
    assert probe_run["rc"] == PROBE_EXIT, probe_run["stderr"]


@pytest.mark.slow
def test_output_streams_while_command_runs(probe_run):
    # "@acked" is printed only after the host reacted to "@waiting" mid-run.
    assert "@acked" in probe_run["lines"], probe_run["stdout"]
    assert "@never_acked" not in probe_run["lines"]


@pytest.mark.slow
def test_output_has_no_carriage_returns(probe_run):
    # The serial console's \n -> \r\n translation is switched off in tools/vm/init.
    assert "\r" not in probe_run["stdout"]


@pytest.mark.slow
def test_runs_in_same_working_directory(probe_run):
    assert _marker(probe_run, "cwd") == str(ROOT / "tests")


@pytest.mark.slow
def test_dualpath_environment_passes_through_verbatim(probe_run):
    assert f"@probe<{PROBE}>" in probe_run["stdout"]
    # Only DUALPATH_* (and a fixed few like PATH and HOME) cross over.
    assert _marker(probe_run, "not_passed") == "unset"


@pytest.mark.slow
def test_guest_exports_rdma_environment(probe_run):
    env = dict(ln.removeprefix("@env ").split("=", 1)
               for ln in probe_run["lines"] if ln.startswith("@env "))
    # Values fixed by tools/vm/guest.sh (the veth recipe of ../shared/softroce.md).
    assert env == {
        "DUALPATH_IN_VM": "1", "DUALPATH_RDMA_REQUIRED": "1",
        "DUALPATH_RDMA_DEV_A": "rxe0", "DUALPATH_RDMA_DEV_B": "rxe1",
        "DUALPATH_RDMA_IP_A": "10.99.0.1", "DUALPATH_RDMA_IP_B": "10.99.0.2",
    }


@pytest.mark.slow
def test_rxe_devices_active_on_the_veth_pair(probe_run):
    links = {}
    for ln in probe_run["lines"]:
        m = re.match(r"@link link (\w+)/1 state (\w+) .*netdev (\w+)", ln)
        if m:
            links[m[1]] = (m[2], m[3])
    assert links == {"rxe0": ("ACTIVE", "veth0"), "rxe1": ("ACTIVE", "veth1")}


@pytest.mark.slow
def test_rdma_write_between_rxe1_and_rxe0_crosses_the_veth(probe_run):
    assert _marker(probe_run, "server_rc") == "0"
    rcvd = int(_marker(probe_run, "rxe0_rcvd"))
    # Each 4 KiB WRITE is at least one packet; rxe loopback on one device would leave
    # veth0's counter at its few neighbour-discovery packets.
    assert rcvd >= WRITE_ITERS
    assert int(_marker(probe_run, "veth0_rx")) >= rcvd


@pytest.mark.slow
def test_boot_to_ready_time_is_reported(probe_run):
    stderr = probe_run["stderr"]
    assert re.search(r"^vm: ready in \d+\.\d s$", stderr, re.MULTILINE), stderr


@pytest.mark.slow
def test_guest_dying_without_status_is_an_error():
    # sysrq 'o' powers the guest off at once: the command never returns a status.
    run = _run_sh("echo o > /proc/sysrq-trigger; sleep 60")
    assert run.returncode == 125, run.stderr
    assert "without reporting an exit status" in run.stderr


def test_timeout_stops_the_guest():
    # One second is far less than a boot takes (several seconds under TCG).
    run = _run_sh("true", env={"DUALPATH_VM_TIMEOUT": "1"})
    assert run.returncode == 124, run.stderr
    assert "DUALPATH_VM_TIMEOUT=1" in run.stderr


@pytest.mark.parametrize("args, env, message", [
    ((), {}, "usage"),
    (("  ",), {}, "empty command"),
    (("true",), {"DUALPATH_VM_TIMEOUT": "soon"}, "DUALPATH_VM_TIMEOUT"),
])
def test_bad_invocation_is_refused(args, env, message):
    run = _run_sh(*args, env=env)
    assert run.returncode == 125
    assert message in run.stderr


@pytest.mark.slow
def test_a_working_directory_under_tmp_is_visible_in_the_guest(tmp_path):
    # CI and `git clone . $(mktemp -d)` put checkouts under /tmp, which the guest
    # otherwise replaces with its own tmpfs: run.sh binds that /tmp folder through.
    work = tmp_path / "checkout"
    work.mkdir()
    (work / "from-host").write_text("host\n")
    proc = subprocess.run(
        [str(RUN_SH), "pwd; cat from-host; echo guest > from-guest"], cwd=work,
        env={**os.environ, "DUALPATH_VM_TIMEOUT": "600"}, capture_output=True, text=True,
        timeout=900, check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[:2] == [str(work), "host"]
    assert (work / "from-guest").read_text() == "guest\n"
