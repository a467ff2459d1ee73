"""CPU lists as taskset and VLLM_CPU_OMP_THREADS_BIND write them ("0-2,5"), and a
command prefix that starts a process on given cores."""

from __future__ import annotations

from collections.abc import Iterable


def parse_cpus(text: str) -> list[int]:
    """"0-2,5" -> [0, 1, 2, 5]."""
    out: list[int] = []
    for piece in text.split(","):
        lo, _, hi = piece.strip().partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return out


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

