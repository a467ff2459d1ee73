"""A simulated run's report: the same record as `dualpath replay` (trace/report.py:
JCT, TTFT/TTST/TPOT, SLO, storage-NIC load and balance, the modes compared) plus what
only a simulator has cheaply — the scheduler core's CPU per decision and the attention
balance of every PE step — labelled simulated throughout. Pure but for
:func:`write_outputs`."""

from __future__ import annotations

from collections.abc import Sequence

from dualpath.sim.cluster import SimResult
from dualpath.sim.hardware import Shape, SimHardware
from dualpath.trace.model import Trace, trace_stats
from dualpath.trace.report import (
    ModeResult,
    attention_balance,
    build_report,
    format_table,
    io_lower_bound_s,
    to_json,
    write_plot,
)

SIMULATED = "simulated (discrete-event: dualpath/sim, the real scheduler core and cost model)"


def sim_report(results: Sequence[SimResult], shape: Shape, hw: SimHardware, trace: Trace,
               *, online_aps: float | None = None, slo_scale: float = 1.0) -> dict:
    rate = hw.snic_rate
    p = hw.profile
    mode_results = []
    for r in results:
        hit_bytes = sum(x.hit_tokens for x in r.records) * p.kv_bytes_per_token
        nodes = {"basic": shape.prefill_nodes,
                 "dualpath": shape.prefill_nodes + shape.decode_nodes}.get(r.mode)
        lb = io_lower_bound_s(hit_bytes, nodes, rate) if nodes and hw.snic_bytes_per_s \
            else None
        mode_results.append(ModeResult(
            r.mode, r.records, {k: int(v) for k, v in r.snic_read_bytes.items()},
            r.snic_windows, lb,
            {"sim": {"wall_s": r.wall_s, "sim_s": r.sim_s,
                     "speed_over_real_time": r.sim_s / r.wall_s if r.wall_s > 0 else None,
                     "cpu_s": r.extra["run_cpu_s"],
                     "events": r.events, **r.extra},
             "scheduler_cpu": r.scheduler_cpu,
             "attention_balance": attention_balance(r.attention_steps)}))
    rep = build_report(mode_results, replay_mode="online" if online_aps else "offline",
                       rate_bytes_per_s=rate, context_scale=trace.context_scale,
                       slo_scale=slo_scale, trace=trace_stats(trace.trajectories).as_dict())
    rep["settings"]["model_execution"] = SIMULATED
    rep["settings"]["shape"] = str(shape)
    rep["settings"]["hardware"] = {k: getattr(hw, k) for k in hw.__dataclass_fields__}
    if online_aps:
        rep["settings"]["aps"] = online_aps
    return rep


def format_sim_table(rep: dict) -> str:
    """The replay table, then the simulator's own lines (all simulated)."""
    lines = [format_table(rep), "",
             (f"simulated {rep['settings']['shape']}, scheduler core CPU (measured on the "
              "real core, this host)")]
    head = (f"{'mode':<9} {'fetches':>9} {'assigned':>9} {'fetch(us)':>10} "
            f"{'p99(us)':>9} {'us/request':>10} {'cores':>7} {'attn max/avg':>12} "
            f"{'sim(s)':>9} {'wall(s)':>8} {'sim/wall':>9}")
    lines += [head, "-" * len(head)]
    for mode, s in rep["modes"].items():
        c, sim = s["scheduler_cpu"], s["sim"]
        ab = s.get("attention_balance") or {}
        lines.append(
            f"{mode:<9} {c['fetches']:>9} {c['assignments']:>9} "
            f"{_n(c['fetch_us_mean'], '10.1f')} {_n(c['fetch_us_p99'], '9.1f')} "
            f"{_n(c['us_per_request'], '10.1f')} {_n(c['cores'], '7.4f')} "
            f"{_n(ab.get('max_avg_mean'), '12.3f')} {sim['sim_s']:9.2f} "
            f"{sim['wall_s']:8.2f} {_n(sim['speed_over_real_time'], '9.1f')}")
    return "\n".join(lines)


def _n(v, fmt: str) -> str:
    return "-".rjust(int(fmt.split(".")[0])) if v is None else format(v, fmt)


def write_outputs(rep: dict, json_path: str | None, plot_path: str | None) -> None:
    if json_path:
        with open(json_path, "w") as fh:
            fh.write(to_json(rep) + "\n")
    if plot_path:
        write_plot(rep, plot_path)
