"""The paper's results as commands (`dualpath repro FIG`): each runs the local cluster —
real processes, real KV bytes moved and verified, model execution emulated by the cost
model — at a stated scale, and returns a record: the scale, the points measured, a
``summary`` of headline figures and the paper's own headline beside them.

The figures:

- ``fig7``: offline JCT of basic, dualpath and oracle as the agent count grows (1P2D).
- ``fig8``: P/D shapes 1P1D, 1P2D and 2P1D under basic and dualpath, the paper's
  equivalences (dualpath 1P1D ≈ basic 2P1D ...) as relative errors, and §4.2's
  bottleneck-free P/D range for the paper's hardware.
- ``fig9``: dualpath's speedup over basic with the mean append or generation length
  halved or doubled (1P2D).
- ``fig10``: online capacity: each mode's highest Poisson agent rate within the paper's
  SLO (bisection), with TTFT, TTST and TPOT at every rate probed (1P2D).
- ``fig11``: average trajectory completion time of basic and dualpath as agents arrive
  faster (online, Poisson arrivals).
- ``fig12``: the TTFT breakdown (its left half: scheduling, allocating, reading,
  prefill, online) and the ablation (its right half, on a cluster of its own where the
  PE's HBM limits its batches): basic without layerwise prefill, then with it, then both
  read paths with sides round-robin, then DualPath's scheduler.
- ``fig13``: storage-NIC balance (max/avg over the three nodes in small windows) of
  dualpath's scheduler against reading sides chosen round-robin.
- ``fig14``: attention balance across a PE node's engines, with the scheduler's compute
  quota and without.

Pure orchestration over :func:`dualpath.cluster.run.run_modes`; plotting is in
:mod:`dualpath.repro.plot`.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import asdict, dataclass, replace

from dualpath.buffers.pool import slot_stride
from dualpath.cluster.local import LocalCluster
from dualpath.cluster.replay import ReplayOptions, forward_steps
from dualpath.cluster.run import first_rounds, make_trace, run_modes
from dualpath.engines.emulated.forward import layer_slots
from dualpath.errors import UsageError
from dualpath.kv.layout import BlockLayout
from dualpath.kv.profiles import PROFILES, get_profile
from dualpath.planning.capacity import Hardware, bottleneck_free_range, working_set_bytes
from dualpath.trace.generator import PARAMS, generate
from dualpath.trace.model import Trace, plan_rounds, trace_stats
from dualpath.trace.report import TTFT_PARTS, attention_balance, summarize
from dualpath.v1 import admin_pb2

EMULATED = "model execution emulated (cost model); KV bytes moved and verified for real"


@dataclass(frozen=True)
class Scale:
    """How big a figure runs: agents (the largest count of a sweep), rounds kept per
    trajectory, the Table 2 row and its context scale, every node's storage-NIC limit."""

    agents: int
    rounds: int
    context_scale: float
    snic_gbit_per_s: float
    table: str = "32k"
    seed: int = 7
    # fig10: the rates searched (agents per second), the bisection's steps, and the SLO
    # as a multiple of the paper's: the paper's online TTFT (1.7-1.8 s, Table 3) is
    # ~0.45 of its 4 s limit; the emulated 1P2D's unloaded TTFT here is ~0.45 s.
    aps_range: tuple[float, float] = (0.5, 16.0)
    search_steps: int = 3
    slo_scale: float = 0.25
    # fig14: engines per node (the PE's expert-parallel group), the PE's emulated GPU
    # speed (slowed so that the PE is the bottleneck: the decode nodes run at full
    # speed, so agents come back to the PE at once), its own agents and rounds (oracle:
    # nothing is read or moved, so the host can offer the PE the queues of hundreds of
    # agents), and the quotas it runs, in ms of the slowed clock (the first is the
    # headline; None: no quota). A quota binds only if every engine's queue holds more
    # than it: at x0.1, 1,500 ms (150 ms at the emulated GPU's full speed) holds ~30
    # of these requests (~60 new tokens over ~1,700 of context), 3,000 ms ~75.
    engines: int = 4
    compute_speed: float = 0.1
    fig14_agents: int = 800
    fig14_rounds: int = 6
    fig14_quotas_ms: tuple[int | None, ...] = (1500, 3000, None)
    fig14_decode_hbm_mib: int = 1024      # per DE engine: room for most agents' KV
    # fig12's left half: the online rates its TTFT breakdown is measured at.
    breakdown_aps: tuple[float, ...] = (0.5, 2.0, 8.0)
    # fig12's ablation: the model profile (layerwise prefill holds DEPTH of a model's
    # layers in HBM, so its gain grows with the layer count: the demo profile's 8 cap it
    # at 8/3 more requests per batch, DS 27B's 30 at 10x), the PE's emulated GPU speed
    # (slowed until the PE's batches matter beside its storage NIC), the compute quota
    # in ms at the GPU's full speed (the paper's 300 ms; scaled by the slowdown), and
    # the PE's HBM per engine as a multiple of the largest prompt's KV (all layers):
    # without layerwise prefill it holds one or two prompts at once, as 64K contexts
    # fill a real PE's HBM.
    ablation_profile: str = "ds27b"
    ablation_speed: float = 0.02
    ablation_quota_ms: int = 300
    ablation_hbm_over_prompt: float = 1.15

    def describe(self) -> str:
        return (f"{self.agents} agents x {self.rounds} rounds, Table 2 '{self.table}' row "
                f"at context_scale {self.context_scale:g}, storage NIC "
                f"{self.snic_gbit_per_s:g} Gbit/s per node; {EMULATED}")


# FULL is bench/e2e.py's I/O-bound case (its storage NICs are the bottleneck).
QUICK = Scale(agents=8, rounds=3, context_scale=0.1, snic_gbit_per_s=0.25,
              fig14_agents=160, fig14_rounds=3, fig14_quotas_ms=(1500, None),
              fig14_decode_hbm_mib=256)
FULL = Scale(agents=24, rounds=4, context_scale=0.1, snic_gbit_per_s=0.25)


def scale_trace(scale: Scale, agents: int | None = None) -> Trace:
    """The scale's trace (``agents`` of its trajectories when given)."""
    return make_trace(agents or scale.agents, table=scale.table,
                      context_scale=scale.context_scale, max_rounds=scale.rounds,
                      seed=scale.seed)


def cluster(scale: Scale, prefill: int = 1, decode: int = 2) -> LocalCluster:
    """A P x D local cluster with the scale's storage-NIC limit (a context manager)."""
    return LocalCluster(prefill, decode,
                        settings={"storage": {"snic_gbit_per_s": scale.snic_gbit_per_s}})


def replay_on(c: LocalCluster, scale: Scale, trace: Trace, modes: Sequence[str],
              opts: ReplayOptions, *, warmup: bool = False, model_profile: str = "demo"):
    """:func:`run_modes` on ``c`` (a warm-up first, unreported, with ``warmup``)."""
    return run_modes(c.scheduler_address, c.node_ids(), c.prefill_nodes, trace, modes, opts,
                     snic_gbit_per_s=scale.snic_gbit_per_s, tls_config=c.client_tls,
                     node_tls=c.node_tls, node_addresses=c.addresses(),
                     warmup_agents=int(warmup), model_profile=model_profile)


def run_shape(prefill: int, decode: int, scale: Scale, modes: Sequence[str], *,
              agents: int | None = None, read_policy: str = "",
              trace: Trace | None = None) -> dict[str, dict]:
    """One P x D local cluster replaying the scale's trace (or ``trace``) in ``modes`` (a
    warm-up first, unreported): the report's per-mode summaries."""
    with cluster(scale, prefill, decode) as c:
        report, _ = replay_on(c, scale, trace or scale_trace(scale, agents), modes,
                              ReplayOptions(read_policy=read_policy), warmup=True)
    return report["modes"]


def _record(name: str, title: str, scale: Scale, points: list[dict], summary: dict,
            paper: dict, described: str | None = None) -> dict:
    return {"figure": name, "title": title,
            "scale": {**asdict(scale), "described": described or scale.describe()},
            "model_execution": "emulated (cost model)", "points": points,
            "summary": summary, "paper": paper}


def fig7(scale: Scale) -> dict:
    """Offline JCT vs agents, basic / dualpath / oracle, 1P2D."""
    counts = sorted({max(1, scale.agents // 2), scale.agents})
    points = []
    for n in counts:
        modes = run_shape(1, 2, scale, ("basic", "dualpath", "oracle"), agents=n)
        points += [{"agents": n, "mode": m, "jct_s": s["jct_s"]} for m, s in modes.items()]
    jct = {(p["agents"], p["mode"]): p["jct_s"] for p in points}
    speedups = [jct[n, "basic"] / jct[n, "dualpath"] for n in counts]
    top = counts[-1]
    return _record("fig7", "Offline JCT vs agents (1P2D)", scale, points, {
        "speedup_vs_basic_max": max(speedups),
        "speedup_vs_basic_by_agents": dict(zip(map(str, counts), speedups)),
        "dualpath_over_oracle_jct": jct[top, "dualpath"] / jct[top, "oracle"],
    }, {"speedup_vs_basic_max": "1.87 (DS 660B, 2P4D); 1.78 (DS 27B, 1P1D)",
        "dualpath_over_oracle_jct": "close to 1 (DS 660B); 1.09-1.85 (DS 27B)"})


def fig9(scale: Scale) -> dict:
    """Dualpath's speedup over basic as appends and generations grow or shrink (1P2D):
    the generator's mean append or generation length scaled, the rest as Table 2."""
    base = PARAMS[scale.table]
    points = []
    for what, factor in (("append", 0.5), ("append", 1.0), ("append", 2.0), ("gen", 0.5),
                         ("gen", 2.0)):
        params = replace(base, **{what: getattr(base, what) * factor})
        t = generate(scale.agents, scale.table, seed=scale.seed,
                     context_scale=scale.context_scale, params=params)
        t = Trace(tuple(first_rounds(x, scale.rounds) for x in t.trajectories), t.meta)
        st = trace_stats(t.trajectories).as_dict()
        modes = run_shape(1, 2, scale, ("basic", "dualpath"), trace=t)
        points.append({"scaled": f"{what} x{factor:g}",
                       "mean_append": st["append_tokens"], "mean_gen": st["gen_tokens"],
                       "basic_jct_s": modes["basic"]["jct_s"],
                       "dualpath_jct_s": modes["dualpath"]["jct_s"],
                       "speedup": modes["basic"]["jct_s"] / modes["dualpath"]["jct_s"]})
    sp = [p["speedup"] for p in points]
    return _record("fig9", "Speedup vs append and generation lengths (1P2D)", scale, points,
                   {"speedup_min": min(sp), "speedup_max": max(sp)},
                   {"speedup_min": 1.82, "speedup_max": 1.99})


#: The paper's hardware for §4.2 (per node: 8 GPUs, a 400 Gbps compute NIC per GPU, one
#: 400 Gbps storage NIC, ~500 GB/s of memory bandwidth).
PAPER_HARDWARE = Hardware(gpus_per_node=8, cnic_bytes_per_s=50e9, snic_bytes_per_s=50e9,
                          mem_bytes_per_s=500e9)
#: §8.2's working set for Table 3's largest offline run: 48K agents of the 64K trace
#: (mean total 55,958 tokens, Table 2) all live: lambda = 48,000 / 3,201 s, T = its JCT.
PAPER_OFFLINE_AT_SCALE = (48_000 / 3_201, 3_201.0, 55_958)


def fig8(scale: Scale) -> dict:
    """P/D shapes under basic and dualpath, the paper's equivalences, §4.2's
    bottleneck-free range on the paper's hardware and §8.2's working set (of this trace,
    and of Table 3's largest offline run on DS 660B)."""
    shapes = ((1, 1), (1, 2), (2, 1))
    points = []
    for p, d in shapes:
        for m, s in run_shape(p, d, scale, ("basic", "dualpath")).items():
            points.append({"shape": f"{p}P{d}D", "mode": m, "jct_s": s["jct_s"]})
    jct = {(x["shape"], x["mode"]): x["jct_s"] for x in points}

    def rel(a: tuple[str, str], b: tuple[str, str]) -> float:
        return abs(jct[a] - jct[b]) / jct[b]

    rng = bottleneck_free_range(PAPER_HARDWARE)
    # §8.2's working set, offline: every agent live at once (lambda T = the agents).
    total = trace_stats(scale_trace(scale).trajectories).total
    ours = working_set_bytes(float(scale.agents), 1.0, total,
                             PROFILES["demo"].kv_bytes_per_token)
    paper = working_set_bytes(*PAPER_OFFLINE_AT_SCALE, PROFILES["ds660b"].kv_bytes_per_token)
    return _record("fig8", "P/D ratios (offline JCT)", scale, points, {
        "equivalence_rel_error_1p1d_vs_basic_2p1d": rel(("1P1D", "dualpath"),
                                                        ("2P1D", "basic")),
        "equivalence_rel_error_basic_1p1d_vs_1p2d": rel(("1P1D", "basic"), ("1P2D", "basic")),
        "equivalence_rel_error_dualpath_2p1d_vs_1p2d": rel(("2P1D", "dualpath"),
                                                           ("1P2D", "dualpath")),
        "speedup_vs_basic": {f"{p}P{d}D": jct[f"{p}P{d}D", "basic"] / jct[f"{p}P{d}D",
                                                                           "dualpath"]
                             for p, d in shapes},
        "bottleneck_free_pd_range_paper_hardware": rng.describe(),
        "working_set_gb_this_trace": ours / 1e9,
        "working_set_tb_paper_48p96d": paper / 1e12,
    }, {"equivalence_rel_error_1p1d_vs_basic_2p1d": "~0: dualpath 1P1D = basic 2P1D",
        "equivalence_rel_error_basic_1p1d_vs_1p2d": "~0: basic 1P1D = basic 1P2D",
        "equivalence_rel_error_dualpath_2p1d_vs_1p2d": "~0: dualpath 2P1D = dualpath 1P2D",
        "speedup_vs_basic": "1.64 on average, up to 2.46 (DS 27B)",
        "bottleneck_free_pd_range_paper_hardware": "1/7 <= P/D <= 7/2 (§4.2)",
        "working_set_gb_this_trace": "-",
        "working_set_tb_paper_48p96d": "not given (§8.2 gives the formula)"})


#: Fig. 10: a rate is within the SLO when this fraction of its requests met the paper's
#: SLO (TTFT <= 4 s and TPOT <= 50 ms, trace/report.py) times the scale's ``slo_scale``.
CAPACITY_ATTAINMENT = 0.9


def capacity_search(lo: float, hi: float, steps: int
                    ) -> Generator[float, bool, float | None]:
    """The highest rate in ``[lo, hi]`` found within the SLO, as a generator: it yields
    a rate to probe and is sent whether that rate was within; it returns ``hi`` if that
    was, None if ``lo`` was not, else the end of a bisection on a log scale of
    ``steps`` steps (within assumed to hold below some rate and fail above it). Pure:
    the probes are the caller's (so several searches can take turns)."""
    if not 0 < lo < hi or steps < 0:
        raise UsageError(f"capacity_search: need 0 < lo < hi and steps >= 0, got "
                         f"{lo}, {hi}, {steps}")
    if (yield hi):
        return hi
    if not (yield lo):
        return None
    for _ in range(steps):
        mid = (lo * hi) ** 0.5
        if (yield mid):
            lo = mid
        else:
            hi = mid
    return lo


def fig10(scale: Scale) -> dict:
    """Online capacity (Fig. 10): each mode's highest agent arrival rate (Poisson APS)
    at which at least CAPACITY_ATTAINMENT of the requests meet the paper's SLO, found by
    bisection between the scale's rates; TTFT, TTST and TPOT at every rate probed. One
    1P2D cluster, the same trajectories at every rate, the two searches taking turns
    (a warm-up replay before the first probe)."""
    trace = scale_trace(scale)
    lo, hi = scale.aps_range
    points: list[dict] = []
    searches = {m: capacity_search(lo, hi, scale.search_steps) for m in ("basic", "dualpath")}
    cap: dict[str, float | None] = {}
    with cluster(scale) as c:
        rates = {m: next(g) for m, g in searches.items()}
        while rates:
            for mode in list(rates):
                aps = rates[mode]
                _, runs = replay_on(c, scale, trace, (mode,), ReplayOptions(
                    replay_mode="online", aps=aps, seed=scale.seed), warmup=not points)
                s = summarize(runs[mode].records, slo_scale=scale.slo_scale)
                points.append({"mode": mode, "aps": aps,
                               "slo_attainment": s["slo"]["attainment"],
                               "ttft_p50_s": s["ttft_s"]["p50"],
                               "ttft_p99_s": s["ttft_s"]["p99"],
                               "ttst_p50_s": s["ttst_s"]["p50"],
                               "tpot_p50_s": s["tpot_s"]["p50"],
                               "tpot_p99_s": s["tpot_s"]["p99"]})
                try:
                    rates[mode] = searches[mode].send(
                        s["slo"]["attainment"] >= CAPACITY_ATTAINMENT)
                except StopIteration as done:
                    cap[mode] = done.value
                    del rates[mode]
    ratio = (cap["dualpath"] / cap["basic"]) if cap["basic"] and cap["dualpath"] else None
    # A mode within the SLO at the top of the range has a capacity of at least that (its
    # agents all arrive at once there: the finite trace's offline burst).
    open_ended = [m for m, c in cap.items() if c == hi]
    return _record("fig10", "Online capacity within the SLO (1P2D)", scale, points, {
        "capacity_aps_basic": cap["basic"], "capacity_aps_dualpath": cap["dualpath"],
        "capacity_ratio_dualpath_vs_basic": ratio,
        "capacity_at_least_range_top": open_ended,
        "slo": f"TTFT <= {4 * scale.slo_scale:g} s and TPOT <= "
               f"{50 * scale.slo_scale:g} ms (the paper's x {scale.slo_scale:g}) for >= "
               f"{CAPACITY_ATTAINMENT:.0%} of requests; rates searched {lo:g}..{hi:g} APS "
               f"({scale.search_steps} bisection steps)",
    }, {"capacity_ratio_dualpath_vs_basic": "1.67 (DS 27B), 2.25 (DS 660B)",
        "slo": "TTFT <= 4 s, TPOT <= 50 ms"})


def fig11(scale: Scale) -> dict:
    """Online (Fig. 11): the average trajectory completion time of basic and dualpath as
    agents arrive faster (Poisson at 0.5 to 8 agents/s; one 1P2D cluster, the same
    trajectories at every rate). With a finite agent count the fastest rates approach
    the offline case (every agent at once)."""
    trace = scale_trace(scale)
    points = []
    with cluster(scale) as c:
        for i, aps in enumerate((0.5, 1.0, 2.0, 4.0, 8.0)):
            for mode in ("basic", "dualpath"):        # alternated at every rate
                report, runs = replay_on(
                    c, scale, trace, (mode,),
                    ReplayOptions(replay_mode="online", aps=aps, seed=scale.seed),
                    warmup=i == 0)
                spans: dict[int, list[float]] = {}
                for r in runs[mode].records:
                    spans.setdefault(r.agent, []).extend((r.submit_s, r.finish_s))
                s = report["modes"][mode]
                points.append({"aps": aps, "mode": mode,
                               "trajectory_s": sum(max(v) - min(v) for v in spans.values())
                               / len(spans),
                               "ttft_mean_s": s["ttft_s"]["mean"]})
    t = {(p["aps"], p["mode"]): p["trajectory_s"] for p in points}
    ratios = {str(a): t[a, "basic"] / t[a, "dualpath"] for a in dict.fromkeys(
        p["aps"] for p in points)}
    return _record("fig11", "Average trajectory completion time vs agents per second "
                   "(online, 1P2D)", scale, points, {
                       "trajectory_time_basic_over_dualpath_by_aps": ratios,
                       "trajectory_time_basic_over_dualpath_max": max(ratios.values()),
                   }, {"trajectory_time_basic_over_dualpath_by_aps":
                       "dualpath's stays lower as APS grows; basic's climbs as its PE's "
                       "storage NIC saturates"})


#: fig12's ablation, the paper's order: (label, mode, read policy, layerwise prefill).
ABLATION = (("basic", "basic", "", False),
            ("+ layerwise prefill", "basic", "", True),
            ("+ dual-path loading", "dualpath", "round_robin", True),
            ("+ scheduling", "dualpath", "", True))


def ablation_settings(scale: Scale, trace: Trace) -> tuple[dict, dict, int]:
    """fig12's ablation cluster: its settings, the PE node's own, and the compute quota
    in ms of the slowed clock (see :class:`Scale`). The PE's HBM is
    ``ablation_hbm_over_prompt`` times the KV (all layers, whole blocks) of the trace's
    largest prompt, so that every prompt fits without layerwise prefill."""
    prof = get_profile(scale.ablation_profile)
    largest = max(p.prompt_tokens for t in trace.trajectories
                  for p in plan_rounds(t, prof.block_tokens))
    # The PE's HBM is Layer Block slots (node/daemon.py): every layer of the largest
    # prompt's blocks, in slots as the pool lays them out.
    slots = layer_slots(largest, prof.block_tokens, prof.layers, layerwise=False)
    kv = slots * slot_stride(BlockLayout.of(prof).one_layer())
    hbm_mib = math.ceil(kv * scale.ablation_hbm_over_prompt / 2**20)
    settings = {"storage": {"snic_gbit_per_s": scale.snic_gbit_per_s},
                "engine": {"model_profile": scale.ablation_profile}}
    pe = {"engine": {"speed_scale": scale.ablation_speed, "prefill_hbm_mib": hbm_mib}}
    return settings, pe, round(scale.ablation_quota_ms / scale.ablation_speed)


def fig12_ablation(scale: Scale) -> tuple[list[dict], tuple[int, dict]]:
    """Fig. 12 right: one 1P2D cluster of the ``ablation_profile`` model whose PE is
    slowed and its HBM tight (:func:`ablation_settings`) runs basic (no layerwise
    prefill), then layerwise prefill, then both read paths (sides round-robin), then
    DualPath's scheduler choosing the sides. Returns the steps' points (JCT, storage-NIC
    balance) and (the quota in ms, the PE's engine settings)."""
    trace = scale_trace(scale)
    settings, pe, quota_ms = ablation_settings(scale, trace)
    points = []
    with LocalCluster(1, 2, settings=settings, node_settings={"p0": pe}) as c:
        stub, ch = c.admin()
        try:
            stub.SetParams(admin_pb2.SetParamsRequest(compute_quota_ms=quota_ms), timeout=10)
        finally:
            ch.close()
        for i, (label, mode, policy, layerwise) in enumerate(ABLATION):
            report, _ = replay_on(c, scale, trace, (mode,),
                                  ReplayOptions(read_policy=policy, layerwise=layerwise),
                                  warmup=i == 0, model_profile=scale.ablation_profile)
            m = report["modes"][mode]
            points.append({"half": "right", "step": label, "jct_s": m["jct_s"],
                           "snic_window_max_avg":
                               m["snic"]["window_max_avg_bytes_weighted"]})
    return points, (quota_ms, pe["engine"])


def fig12(scale: Scale) -> dict:
    """Both halves of Fig. 12. Right, the ablation (:func:`fig12_ablation`); left,
    the TTFT breakdown (:func:`fig12_breakdown`, the demo profile as every other
    figure)."""
    points, settings = fig12_ablation(scale)
    quota_ms, eng = settings
    jct = [p["jct_s"] for p in points]
    for p in points:
        p["jct_vs_basic"] = p["jct_s"] / jct[0] - 1.0
    gains = [jct[i - 1] / jct[i] - 1.0 for i in range(1, len(jct))]
    left = fig12_breakdown(scale)
    return _record("fig12", "TTFT breakdown vs APS (left) and the ablation (right), 1P2D",
                   scale, left + points, {
                       "ablation_gain_layerwise": gains[0],
                       "ablation_gain_dualpath": gains[1],
                       "ablation_gain_sched": gains[2],
                       "jct_vs_basic_by_step": {p["step"]: p["jct_vs_basic"] for p in points},
                       "ablation_cluster": {"model_profile": scale.ablation_profile,
                                            "pe_speed_scale": eng["speed_scale"],
                                            "pe_hbm_mib": eng["prefill_hbm_mib"],
                                            "compute_quota_ms": quota_ms},
                       "ttft_breakdown_s": {f"{p['mode']} @ {p['aps']:g} APS":
                                            {k: p[f"{k}_s"] for k in TTFT_PARTS}
                                            for p in left},
                   }, {"ablation_gain_layerwise": 0.208, "ablation_gain_dualpath": 0.339,
                       "ablation_gain_sched": 0.137,   # from its JCTs below, step on step
                       "jct_vs_basic_by_step": "layerwise -17.21%, + dual-path -38.19%, "
                       "+ scheduling -45.62% (DS 660B, 64K)",
                       "ttft_breakdown_s": "basic's queueing grows with APS; dualpath's "
                       "parts stay stable"},
                   f"{scale.describe()}; the ablation (right): the "
                   f"{scale.ablation_profile} profile, the PE's emulated GPU at "
                   f"x{scale.ablation_speed:g} with {eng['prefill_hbm_mib']} MiB of HBM and "
                   f"a {quota_ms} ms quota")


def fig12_breakdown(scale: Scale) -> list[dict]:
    """Fig. 12 left: TTFT's parts (scheduling, allocating, reading KV, prefill) of
    basic and dualpath as agents arrive faster (online, Poisson; one 1P2D cluster, the
    same trajectories at every rate, the modes alternated)."""
    trace = scale_trace(scale)
    points = []
    with cluster(scale) as c:
        for i, aps in enumerate(scale.breakdown_aps):
            for mode in ("basic", "dualpath"):
                report, _ = replay_on(c, scale, trace, (mode,), ReplayOptions(
                    replay_mode="online", aps=aps, seed=scale.seed), warmup=i == 0)
                m = report["modes"][mode]
                parts = m.get("ttft_breakdown_s") or dict.fromkeys(TTFT_PARTS, 0.0)
                points.append({"half": "left", "aps": aps, "mode": mode,
                               "ttft_mean_s": m["ttft_s"]["mean"],
                               **{f"{k}_s": parts[k] for k in TTFT_PARTS}})
    return points


def fig14(scale: Scale) -> dict:
    """Attention balance across the engines of a PE node (Fig. 14): one 1P2D cluster
    whose nodes have ``scale.engines`` engines each, the PE compute-bound (its emulated
    GPU at ``scale.compute_speed``, the decode nodes at full speed), replaying
    ``scale.fig14_agents`` agents offline in oracle mode (the PE's forward and its
    batches as in dualpath; no KV read or moved, so that this host can keep hundreds of
    agents queued at the PE), at each of ``scale.fig14_quotas_ms`` (None: no quota, an
    hour: every queued request joins a batch). Per forward step, the slowest engine's
    attention time over the engines' mean (an idle engine counts 0), time-weighted: over
    all steps (the headline), and over the full ones (every engine's batch left work
    queued: the load the quota is for)."""
    trace = scale_trace(replace(scale, rounds=scale.fig14_rounds), scale.fig14_agents)
    points = []
    pe = {"engine": {"speed_scale": scale.compute_speed,
                     # Above an engine's share of the agents: the queue is the trace's.
                     "max_prefills_per_engine": max(16, 2 * scale.fig14_agents
                                                    // scale.engines)}}
    de = {"engine": {"decode_hbm_mib": scale.fig14_decode_hbm_mib}}
    with LocalCluster(1, 2, engines_per_node=scale.engines,
                      node_settings={"p0": pe, "d0": de, "d1": de}) as c:
        stub, ch = c.admin()
        try:
            for i, quota_ms in enumerate(scale.fig14_quotas_ms):
                stub.SetParams(admin_pb2.SetParamsRequest(
                    compute_quota_ms=quota_ms or NO_QUOTA_MS), timeout=10)
                t0 = time.time()
                report, _ = run_modes(
                    c.scheduler_address, c.node_ids(), c.prefill_nodes, trace,
                    ("oracle",), ReplayOptions(), snic_gbit_per_s=0.0,
                    tls_config=c.client_tls, node_tls=c.node_tls,
                    node_addresses=c.addresses(), warmup_agents=int(i == 0))
                pes = {n: a for n, a in c.addresses().items() if n.startswith("p")}
                got = asyncio.run(forward_steps(pes, t0, time.time(), c.node_tls))
                points.append({"quota": f"{quota_ms} ms" if quota_ms else "no quota",
                               "quota_ms": quota_ms or NO_QUOTA_MS,
                               "jct_s": report["modes"]["oracle"]["jct_s"],
                               **step_balance([s for v in got.values() for s in v])})
        finally:
            ch.close()
    head = points[0]
    none = next((p for p in points if p["quota"] == "no quota"), {})
    return _record("fig14", f"Attention balance across {scale.engines} PE engines "
                   f"(max/avg per forward step, 1P2D, {scale.fig14_agents} agents x "
                   f"{scale.fig14_rounds} rounds offline, oracle, PE at "
                   f"x{scale.compute_speed:g})", scale, points, {
                       "attention_max_avg_with_quota": head["attention_max_avg_mean"],
                       "attention_max_avg_without_quota":
                           none.get("attention_max_avg_mean"),
                       "attention_max_avg_with_quota_full_steps":
                           head["attention_max_avg_full_steps"],
                       "full_step_time_fraction_with_quota": head["full_step_time_fraction"],
                       "quota_ms": head["quota_ms"],
                       "quota_ms_at_full_speed": head["quota_ms"] * scale.compute_speed,
                       "agents": scale.fig14_agents,
                       "rounds": scale.fig14_rounds,
                       "engines_per_node": scale.engines,
                       "compute_speed": scale.compute_speed,
                   }, {"attention_max_avg_with_quota": 1.06,
                       "attention_max_avg_without_quota": "not given"},
                   f"{scale.fig14_agents} agents x {scale.fig14_rounds} rounds, Table 2 "
                   f"'{scale.table}' row at context_scale {scale.context_scale:g}, oracle "
                   "(no KV read or moved), the PE's emulated GPU at "
                   f"x{scale.compute_speed:g}; model execution emulated (cost model)")


#: fig14's "no quota": an hour (every queued request that fits the HBM joins a batch).
NO_QUOTA_MS = 3_600_000


def step_balance(steps: Sequence) -> dict:
    """fig14's figures over one run's forward steps (Node.ForwardSteps records)."""
    bal = attention_balance((s.duration_s, list(s.attention_s)) for s in steps) or {}
    full = [s for s in steps if all(s.left_tokens)]
    fbal = attention_balance((s.duration_s, list(s.attention_s)) for s in full) or {}
    reqs = [r for s in steps for r in s.requests if r]
    return {"steps": bal.get("steps", 0),
            "attention_max_avg_mean": bal.get("max_avg_mean"),
            "attention_max_avg_p90": bal.get("max_avg_p90"),
            "full_steps": fbal.get("steps", 0),
            "full_step_time_fraction": sum(s.duration_s for s in full)
            / max(sum(s.duration_s for s in steps), 1e-9),
            "attention_max_avg_full_steps": fbal.get("max_avg_mean"),
            "batch_requests_mean": sum(reqs) / len(reqs) if reqs else 0.0}


def fig13(scale: Scale) -> dict:
    """Storage-NIC balance over the three nodes of 1P2D: the scheduler's read sides
    against round-robin ones."""
    points = []
    for policy, label in (("round_robin", "round-robin"), ("", "dualpath scheduler")):
        s = run_shape(1, 2, scale, ("dualpath",), read_policy=policy)["dualpath"]
        points.append({"policy": label, "jct_s": s["jct_s"],
                       "window_max_avg": s["snic"]["window_max_avg"],
                       "window_max_avg_bytes_weighted":
                           s["snic"]["window_max_avg_bytes_weighted"],
                       "max_avg": s["snic"]["max_avg"]})
    by = {p["policy"]: p for p in points}
    return _record("fig13", "Storage-NIC balance (max/avg over nodes, small windows)",
                   scale, points, {
                       "snic_max_avg_dualpath":
                           by["dualpath scheduler"]["window_max_avg_bytes_weighted"],
                       "snic_max_avg_round_robin":
                           by["round-robin"]["window_max_avg_bytes_weighted"],
                   }, {"snic_max_avg_round_robin": 1.53, "snic_max_avg_dualpath": 1.18})


FIGURES: dict[str, Callable[[Scale], dict]] = {"fig7": fig7, "fig8": fig8, "fig9": fig9,
                                               "fig10": fig10, "fig11": fig11,
                                               "fig12": fig12, "fig13": fig13,
                                               "fig14": fig14}
