"""`dualpath plan`: choose a P/D split, DRAM buffer size and α/β for a trace and a
hardware description by simulating them (dualpath/sim), beside §4.2's analytic
bottleneck-free P/D range and §8.2's working set; write a ready deploy TOML for the
choice. Pure but for the caller's printing and file writing.

The sweep is coordinate-wise, three stages, each keeping the best of the one before:
(1) every split of the node budget into P prefill and D decode nodes, (2) the DRAM
buffer sizes, (3) the α x β grid (multiples of the values the scheduler derives). Best
= the lowest simulated JCT of the trace, offline (every agent at once); ties go to the
earlier candidate. The simulated bottleneck-free range is the P/D ratios of stage 1
whose JCT is within ``tolerance`` of the best.
"""

from __future__ import annotations

from dataclasses import dataclass

from dualpath.errors import UsageError
from dualpath.kv.profiles import get_profile
from dualpath.planning.capacity import Hardware, bottleneck_free_range, working_set_bytes
from dualpath.scheduler.core.policy import derive_alpha, derive_beta
from dualpath.sim.cluster import SimCluster
from dualpath.sim.hardware import Shape, SimHardware
from dualpath.trace.model import Trace, trace_stats

MiB = 1 << 20


@dataclass(frozen=True)
class Candidate:
    stage: str
    shape: Shape
    buffer_bytes: int
    alpha_x: float
    beta_x: float
    alpha_tokens: int
    beta_tokens: int
    jct_s: float
    tokens_per_s_per_gpu: float
    snic_util_mean: float
    pe_buffer_low_fraction: float

    def row(self) -> dict:
        return {"stage": self.stage, "shape": str(self.shape),
                "pd_ratio": self.shape.prefill_nodes / self.shape.decode_nodes,
                "buffer_gib": self.buffer_bytes / (1 << 30), "alpha_x": self.alpha_x,
                "beta_x": self.beta_x, "alpha_tokens": self.alpha_tokens,
                "beta_tokens": self.beta_tokens, "jct_s": self.jct_s,
                "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
                "snic_util_mean": self.snic_util_mean,
                "pe_buffer_low_fraction": self.pe_buffer_low_fraction}


def simulate(shape: Shape, hw: SimHardware, trace: Trace, alpha_x: float, beta_x: float,
             stage: str, seed: int = 0) -> Candidate:
    base = get_profile(hw.model)
    alpha = max(1, int(alpha_x * derive_alpha(hw.snic_rate,
                                              base.kv_bytes_per_token, hw.alpha_window_s)))
    beta = max(1, int(beta_x * derive_beta(base, hw.beta_window_s)))
    c = SimCluster(shape, hw, trace, "dualpath", seed=seed, alpha_tokens=alpha,
                   beta_tokens=beta, keep_records=False, window_s=10.0)
    r = c.run()
    st = r.extra["stats"]
    gpus = (shape.prefill_nodes + shape.decode_nodes) * hw.engines_per_node
    rate = hw.snic_bytes_per_s
    util = ([v / (rate * r.sim_s) for v in r.snic_read_bytes.values()] if rate else [0.0])
    low = min(n.buffer.low / n.buffer.capacity for n in c.pe_nodes)
    return Candidate(stage, shape, hw.pe_buffer_bytes, alpha_x, beta_x, alpha, beta,
                     r.sim_s, (st["prompt_tokens"] + st["gen_tokens"]) / r.sim_s / gpus,
                     sum(util) / len(util), low)


def plan(trace: Trace, hw: SimHardware, nodes: int, *, buffers_bytes: list[int],
         alpha_xs: list[float], beta_xs: list[float], tolerance: float = 0.05,
         seed: int = 0, progress=None) -> dict:
    if nodes < 2:
        raise UsageError(f"--nodes must be >= 2 (one prefill and one decode), got {nodes}")
    if not buffers_bytes or not alpha_xs or not beta_xs:
        raise UsageError("plan: give at least one buffer size, alpha and beta multiple")
    if any(b < 1 for b in buffers_bytes) or any(x <= 0 for x in [*alpha_xs, *beta_xs]):
        raise UsageError("plan: buffer sizes and alpha/beta multiples must be > 0")
    say = progress or (lambda c: None)

    def best(cs: list[Candidate]) -> Candidate:
        return min(cs, key=lambda c: c.jct_s)

    stage1 = []
    for p in range(1, nodes):
        c = simulate(Shape(p, nodes - p), hw, trace, 1.0, 1.0, "P/D", seed)
        say(c)
        stage1.append(c)
    b1 = best(stage1)
    stage2 = []
    for b in buffers_bytes:
        if b == hw.pe_buffer_bytes:
            continue
        c = simulate(b1.shape, hw.with_(pe_buffer_bytes=b, de_buffer_bytes=b), trace, 1.0,
                     1.0, "buffer", seed)
        say(c)
        stage2.append(c)
    b2 = best([b1, *stage2])
    hw2 = hw.with_(pe_buffer_bytes=b2.buffer_bytes, de_buffer_bytes=b2.buffer_bytes)
    stage3 = []
    for ax in alpha_xs:
        for bx in beta_xs:
            if (ax, bx) == (1.0, 1.0):
                continue
            c = simulate(b2.shape, hw2, trace, ax, bx, "alpha/beta", seed)
            say(c)
            stage3.append(c)
    chosen = best([b2, *stage3])
    top = b1.jct_s
    within = sorted(c.shape.prefill_nodes / c.shape.decode_nodes for c in stage1
                    if c.jct_s <= top * (1 + tolerance))
    analytic = bottleneck_free_range(Hardware(hw.engines_per_node, hw.cnic_bytes_per_s,
                                              hw.snic_rate,
                                              hw.mem_bytes_per_s))
    st = trace_stats(trace.trajectories)
    agents = len(trace.trajectories)
    ws = working_set_bytes(agents / top, top, st.total, get_profile(hw.model).kv_bytes_per_token)
    return {
        "candidates": [c.row() for c in (*stage1, *stage2, *stage3)],
        "chosen": chosen.row(),
        "analytic_pd_range": {"low": analytic.low, "high": analytic.high,
                              "described": analytic.describe(), "empty": analytic.empty},
        "simulated_pd_range": {"low": within[0], "high": within[-1],
                               "tolerance": tolerance,
                               "described": f"{within[0]:.3g} <= P/D <= {within[-1]:.3g} "
                                            f"(JCT within {tolerance:.0%} of the best "
                                            f"split of {nodes} nodes; simulated)"},
        "working_set": {"agents": agents, "mean_total_tokens": st.total,
                        "bytes": ws, "described": f"{ws / 1e9:.3g} GB (§8.2: lambda T L / 2"
                                                  f" tokens of KV, every agent live)"},
        "trace": st.as_dict(), "nodes": nodes,
    }


def deploy_toml(result: dict, hw: SimHardware) -> str:
    """A deploy TOML (deploy/cluster-multinode.toml's keys) for the chosen configuration.
    Only keys `dualpath config docs` lists."""
    c = result["chosen"]
    p, d = (int(x) for x in c["shape"].rstrip("D").split("P"))
    buf_mib = max(1, int(c["buffer_gib"] * 1024))
    lines = [
        (f"# Written by `dualpath plan`: {c['shape']} ({p} prefill and {d} decode nodes of "
        f"{hw.engines_per_node} GPUs),"),
        (f"# simulated JCT {c['jct_s']:.1f} s, {c['tokens_per_s_per_gpu']:.1f} tokens/s per "
        "GPU (simulated, dualpath/sim)."),
        ("# Merge with deploy/cluster-multinode.toml (TLS, storage dir, transport); run the "
        "prefill role on"),
        f"# {p} hosts and the decode role on {d}. `dualpath config check` validates it.",
        "",
        "[scheduler]",
        f'model_profile = "{hw.model}"',
        f"storage_read_bytes_per_s = {float(hw.snic_rate):.6g}",
        f"alpha_tokens = {c['alpha_tokens']}",
        f"beta_tokens = {c['beta_tokens']}",
        f"compute_quota_ms = {hw.compute_quota_ms}",
        f"fetch_interval_ms = {max(1, round(hw.fetch_interval_s * 1000))}",
        "",
        "[engine]",
        f'model_profile = "{hw.model}"',
        f"engines_per_node = {hw.engines_per_node}",
        f"prefill_hbm_mib = {max(1, hw.prefill_hbm_bytes // MiB)}",
        f"decode_hbm_mib = {max(1, hw.decode_hbm_bytes // MiB)}",
        f"max_prefills_per_engine = {hw.max_prefills_per_engine}",
        "# The GPU speed the plan assumed, as a multiple of the profile's (1: as profiled).",
        f"speed_scale = {hw.speed_scale:.6g}",
        "",
        "[storage]",
        "# The storage NIC the plan assumed, each direction (the node's limiter: an",
        "# emulated cluster's NIC; on real NICs it caps reads at the rate planned for;",
        "# 0: none, the plan assumed an unlimited NIC).",
        f"snic_gbit_per_s = {hw.snic_bytes_per_s * 8 / 1e9:.6g}",
        "",
        "[buffers]",
        f"pe_buffer_mib = {buf_mib}",
        f"de_buffer_mib = {buf_mib}",
    ]
    if p <= 64 and d <= 64:
        lines += ["", "# `dualpath up` on one host runs the same shape:", "[cluster]",
                  f"prefill_nodes = {p}", f"decode_nodes = {d}"]
    return "\n".join(lines) + "\n"
