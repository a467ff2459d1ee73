"""CPU lists as taskset and VLLM_CPU_OMP_THREADS_BIND write them ("0-2,5"), and a
command prefix that starts a process on given cores."""

from __future__ import annotations

import os
from collections.abc import Iterable

from dualpath.errors import UsageError


def parse_cpus(text: str) -> list[int]:
    """"0-2,5" -> [0, 1, 2, 5]."""
    out: list[int] = []
    for piece in text.split(","):
        lo, dash, hi = piece.strip().partition("-")
        if dash and not hi:
            raise ValueError(f"{piece!r}: a range without its end")
        out += range(int(lo), int(hi or lo) + 1)
    return out


def allowed_cpus(text: str, what: str = "--cores") -> list[int]:
    """The cores ``text`` names ("0-7,12"), each one this process may run on (else a
    UsageError naming the ones it may not, or the syntax)."""
    try:
        cpus = sorted(set(parse_cpus(text)))      # "" and "-1" do not parse
    except ValueError:
        raise UsageError(f"{what} {text!r}: not a CPU list (e.g. 0-7,12)") from None
    mine = os.sched_getaffinity(0)
    outside = [c for c in cpus if c not in mine]
    if outside:
        raise UsageError(f"{what} {text!r}: cores {cpu_list(outside)} are not among those "
                         f"this process may run on ({cpu_list(mine)})")
    return cpus


def cpu_list(cpus: Iterable[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    runs: list[list[int]] = []
    for c in sorted(set(cpus)):
        if runs and runs[-1][1] == c - 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)


def on_cpus(cpus: Iterable[int]) -> list[str]:
    """The command prefix that runs a command on ``cpus`` (every thread it starts, and
    its children, inherit them); [] for no binding."""
    cpus = list(cpus)
    return ["taskset", "-c", cpu_list(cpus)] if cpus else []

