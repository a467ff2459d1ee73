"""The paper's capacity arithmetic, as library code.

§4.2, bottleneck-free P/D range. P prefill and D decode nodes of g GPUs each, one
compute NIC of bandwidth B per GPU, s x B of storage bandwidth per node, M of memory
bandwidth per node. With every storage NIC reading flat out and requests spread evenly
over all (PE, DE) pairs, a PE-DE pair carries T_p = Bs/(Dg^2) on the PE read path and
T_c = Bs/(Pg^2) on the DE read path, and no compute NIC or DRAM becomes the bottleneck
while

    s/(g-s) <= P/D <= min{ (g-2s)/s, (g-s)/(2s), (M/(Bs) - 3)/2 }

(the lower bound from the PE compute NIC's writes; the upper ones from the DE compute
NIC's reads and writes and the DE's memory, whose pressure is (3 + 2P/D)Bs). The PE
compute NIC's reads need s <= g/2 (the same hit KV crosses it twice). For g = 8,
s = 1, M = 500 GB/s, Bs = 50 GB/s: 1/7 <= P/D <= 7/2.

§8.2, working set. With agents arriving at lambda per second, trajectories lasting T
seconds on average and a mean total context of L tokens, about lambda T trajectories
are live, each holding on average half its final context: the KV the store must hold
hot is lambda T L / 2 tokens' worth.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dualpath.errors import UsageError


@dataclass(frozen=True)
class Hardware:
    """One node type's figures (bandwidths in bytes/s)."""

    gpus_per_node: int                 # g
    cnic_bytes_per_s: float            # B: one GPU's compute NIC
    snic_bytes_per_s: float            # s x B: the node's storage bandwidth
    mem_bytes_per_s: float             # M: the node's memory bandwidth

    def __post_init__(self):
        if self.gpus_per_node < 1:
            raise UsageError(f"gpus_per_node must be >= 1, got {self.gpus_per_node}")
        for name in ("cnic_bytes_per_s", "snic_bytes_per_s", "mem_bytes_per_s"):
            if not getattr(self, name) > 0:
                raise UsageError(f"{name} must be > 0, got {getattr(self, name)}")

    @property
    def s(self) -> float:
        """Storage bandwidth per node in compute-NIC units."""
        return self.snic_bytes_per_s / self.cnic_bytes_per_s


@dataclass(frozen=True)
class PdRange:
    """The P/D ratios within which nothing but the storage NICs limits (§4.2). ``empty``
    when no ratio qualifies; ``bounds`` names each constraint's limit."""

    low: float
    high: float
    bounds: dict[str, float]
    pe_reads_ok: bool                  # s <= g/2: the PE compute NIC carries its reads

    @property
    def empty(self) -> bool:
        return self.low > self.high or not self.pe_reads_ok

    def contains(self, prefill_nodes: int, decode_nodes: int) -> bool:
        return not self.empty and self.low <= prefill_nodes / decode_nodes <= self.high

    def describe(self) -> str:
        if self.empty:
            why = ("the PE compute NIC cannot carry its reads (s > g/2)"
                   if not self.pe_reads_ok else f"{self.low:.3g} > {self.high:.3g}")
            return f"no bottleneck-free P/D ratio: {why}"
        limit = min((k for k in self.bounds if k != "pe_cnic_write"),
                    key=self.bounds.__getitem__)
        return (f"bottleneck-free for {_ratio(self.low)} <= P/D <= {_ratio(self.high)} "
                f"(upper bound set by the {limit.replace('_', ' ')})")


def bottleneck_free_range(hw: Hardware) -> PdRange:
    g, s = hw.gpus_per_node, hw.s
    mem = hw.mem_bytes_per_s / hw.snic_bytes_per_s          # M / (Bs)
    bounds = {
        "pe_cnic_write": s / (g - s) if g > s else math.inf,  # the lower bound
        "de_cnic_read": (g - 2 * s) / s,
        "de_cnic_write": (g - s) / (2 * s),
        "de_memory": (mem - 3) / 2,
    }
    high = min(bounds["de_cnic_read"], bounds["de_cnic_write"], bounds["de_memory"])
    return PdRange(bounds["pe_cnic_write"], high, bounds, s <= g / 2)


def working_set_bytes(agents_per_s: float, trajectory_s: float, mean_total_tokens: float,
                      kv_bytes_per_token: float) -> float:
    """§8.2: lambda T L / 2 tokens of KV, in bytes."""
    for name, v in (("agents_per_s", agents_per_s), ("trajectory_s", trajectory_s),
                    ("mean_total_tokens", mean_total_tokens),
                    ("kv_bytes_per_token", kv_bytes_per_token)):
        if v < 0 or not math.isfinite(v):
            raise UsageError(f"{name} must be finite and >= 0, got {v}")
    return agents_per_s * trajectory_s * mean_total_tokens / 2 * kv_bytes_per_token


def _ratio(x: float) -> str:
    """1/7, 7/2, 0.4 ... (a simple fraction when one is close)."""
    for den in range(1, 13):
        num = x * den
        if abs(num - round(num)) < 1e-9:
            return f"{round(num)}/{den}" if den > 1 else f"{round(num)}"
    return f"{x:.3g}"
