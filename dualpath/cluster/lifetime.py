"""Clean ends for a local cluster: its processes die with the process that started them,
and its work directory goes with them, even when that process is SIGKILLed.

* Each child runs in its own session (so its process group is its own, and everything it
  starts is in that group) and, at start-up, asks the kernel for SIGKILL when its parent
  dies (``prctl(PR_SET_PDEATHSIG)``, :func:`die_with_parent`; the parent passes its pid in
  ``DUALPATH_PARENT_PID`` so a child whose parent died before the prctl exits at once).
  The kernel sends it when the *thread* that forked the child exits: start clusters from
  a thread that outlives them (the main thread in `dualpath up`).
* A janitor process (``python -m dualpath.cluster.lifetime DIR``, :class:`Janitor`) is
  told each child's pid on its stdin. When its stdin closes without "done" (the parent
  died, however) it SIGKILLs every child's process group, waits until each child has
  exited, and removes DIR, then exits itself; "keep" means leave DIR (logs worth reading),
  "done" means the parent cleaned up itself.

Threads: the janitor is single-threaded; :class:`Janitor` is used by the cluster's owner
thread.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from dualpath._libc import LIBC

PARENT_ENV = "DUALPATH_PARENT_PID"
PR_SET_PDEATHSIG = 1


def exec_argv(argv: list[str]) -> list[str]:
    """``argv`` (a program that is not ours, e.g. ``vllm serve``) run so that it dies
    with its parent: ``python -m dualpath.cluster.lifetime --exec ARGV`` asks for
    PR_SET_PDEATHSIG (:func:`die_with_parent`; the setting survives exec) and execs it.
    Start it with :func:`child_env`; its own children go with its process group."""
    return [sys.executable, "-m", "dualpath.cluster.lifetime", "--exec", *argv]


def die_with_parent() -> None:
    """In a child started with ``DUALPATH_PARENT_PID``: SIGKILL when the parent dies.
    The variable is removed so that what this child starts does not inherit it."""
    want = os.environ.pop(PARENT_ENV, "")
    if not want or not sys.platform.startswith("linux"):
        return
    if LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() != int(want):     # the parent died before the prctl took effect
        os._exit(1)


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a child that must die with this process."""
    out = dict(os.environ if env is None else env)
    out[PARENT_ENV] = str(os.getpid())
    return out


def kill_group(pid: int, sig: int = signal.SIGKILL) -> None:
    """Signal the process group of a child that leads its own session (ESRCH is fine)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def terminate_group(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM a child that leads its own session, wait up to ``grace_s`` for it, then
    SIGKILL its whole group (what it started too)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(grace_s)
    kill_group(proc.pid)


class Janitor:
    """The parent's side of the janitor process (see the module docstring)."""

    def __init__(self, work_dir: Path):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dualpath.cluster.lifetime", str(work_dir)],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True)

    def watch(self, pid: int) -> None:
        self._send(f"{pid}\n")

    def finish(self, keep: bool) -> None:
        """The parent has stopped its children: leave the directory ("keep") or say it
        removed it ("done"); the janitor exits."""
        if self.proc.stdin is None:
            return
        self._send("keep\n" if keep else "done\n")
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        self.proc.stdin = None
        self.proc.wait()

    def _send(self, line: str) -> None:
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.write(line.encode())
                self.proc.stdin.flush()


def _janitor(work_dir: str) -> int:
    pidfds: dict[int, int] = {}
    verdict = ""
    for line in sys.stdin:
        word = line.strip()
        if word in ("keep", "done"):
            verdict = word
            break
        pid = int(word)
        with contextlib.suppress(ProcessLookupError):
            pidfds[pid] = os.pidfd_open(pid)
    if verdict:
        return 0
    for pid, fd in pidfds.items():      # the parent is gone: its children go too
        if not select.select([fd], [], [], 0)[0]:   # still running (its pid not reused)
            kill_group(pid)
    for fd in pidfds.values():
        select.select([fd], [], [])     # readable once that process has exited
    shutil.rmtree(work_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--exec"]:
        die_with_parent()
        os.execvp(sys.argv[2], sys.argv[2:])
    sys.exit(_janitor(sys.argv[1]))
