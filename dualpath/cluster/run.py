"""Replaying one trace in several modes on one cluster and building the report: what
`dualpath replay`, `dualpath demo` and bench/e2e.py share."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence

from dualpath.cluster.replay import ReplayAborted, ReplayOptions, ReplayRun, replay
from dualpath.errors import UsageError
from dualpath.kv.profiles import get_profile
from dualpath.storage.ratelimit import UNLIMITED_BYTES_PER_S
from dualpath.tls import TlsConfig
from dualpath.trace.generator import extend, generate
from dualpath.trace.model import Trace, Trajectory, trace_stats
from dualpath.trace.report import build_report

WARMUP_ROUNDS = 2


def make_trace(agents: int, *, table: str = "32k", context_scale: float = 0.1,
               max_rounds: int = 0, seed: int = 0, path: str | None = None) -> Trace:
    """A generated trace (Table 2 row scaled by ``context_scale``) or a JSONL file's
    first ``agents`` trajectories, and when the file has fewer, extra agents by the
    paper's rule (A.3, trace/generator.extend: a sampled trajectory behind a new first
    round; recorded in the meta); ``max_rounds`` > 0 keeps each trajectory's first rounds
    (recorded in the meta)."""
    if path:
        from dualpath.trace.loader import read_jsonl

        trace = read_jsonl(path)
        if agents and agents > len(trace.trajectories):
            trace = Trace(tuple(extend(trace.trajectories, agents, seed=seed)),
                          {**trace.meta, "extended_from": len(trace.trajectories)})
        elif agents:
            trace = Trace(trace.trajectories[:agents], trace.meta)
    else:
        trace = generate(agents, table, seed=seed, context_scale=context_scale)
    if max_rounds > 0:
        trace = Trace(tuple(first_rounds(t, max_rounds) for t in trace.trajectories),
                      {**trace.meta, "max_rounds": max_rounds})
    return trace


def first_rounds(t: Trajectory, n: int) -> Trajectory:
    """A trajectory's first ``n`` rounds (and the token ids they use)."""
    return Trajectory(t.id, t.rounds[:n], None if t.token_ids is None else t.token_ids[
        :sum(r.append_tokens + r.gen_tokens for r in t.rounds[:n])])


def mode_order(modes: Sequence[str], repeats: int) -> list[str]:
    """The order ``repeats`` measured passes over ``modes`` run in: forward, then
    backward, alternately (basic, dualpath, oracle, oracle, dualpath, basic, ...), so
    over an even number of passes every mode sits at every position as often as the
    others and none is always the one that runs first (or last) on the cluster."""
    if repeats < 1:
        raise UsageError(f"repeats must be >= 1, got {repeats}")
    if len(set(modes)) != len(modes):
        raise UsageError(f"modes repeat: {', '.join(modes)}")
    return [m for r in range(repeats) for m in (modes if r % 2 == 0 else modes[::-1])]


def run_jct_s(run: ReplayRun) -> float:
    """A run's job completion time: first submission to last finish (inf when it
    finished no round)."""
    if not run.records:
        return float("inf")
    return max(r.finish_s for r in run.records) - min(r.submit_s for r in run.records)


def median_run(runs: Sequence[ReplayRun]) -> ReplayRun:
    """The run a mode's report row comes from: its median by JCT (the faster of the
    middle two for an even count), so one lucky or one disturbed pass does not speak
    for the mode."""
    ranked = sorted(runs, key=run_jct_s)
    return ranked[(len(ranked) - 1) // 2]


def run_modes(scheduler: str, nodes: Sequence[str], prefill_nodes: int, trace: Trace,
              modes: Sequence[str], opts: ReplayOptions, *, snic_gbit_per_s: float,
              tls_config: TlsConfig, node_tls: TlsConfig, model_profile: str = "demo",
              node_addresses: dict[str, str] | None = None, warmup_agents: int = 0,
              repeats: int = 1) -> tuple[dict, dict[str, ReplayRun]]:
    """Replay ``trace`` once per mode (in order) and build the report dict; the scheduler
    is reached with ``tls_config``, the nodes with ``node_tls``. When a mode cannot
    finish, the report of what ran (that mode's partial run included, the report marked
    ``partial``) rides on the :class:`ReplayAborted` raised (``.report``).

    ``warmup_agents`` > 0: first, every mode replays that many trajectories' first
    :data:`WARMUP_ROUNDS` rounds, unreported (fresh names: no block of it is a hit
    later), so that no measured mode pays the cluster's start-up costs (first
    connections and handshakes, first reads, code paths run for the first time) for the
    modes after it.

    ``repeats`` > 1: the measured replays run that many passes over the modes in
    alternating order (:func:`mode_order`), each under fresh names; a mode's report row
    is its median pass by JCT (:func:`median_run`) and ``settings.repeats`` lists every
    pass's JCT in the order they ran."""
    if not modes:
        raise UsageError("no modes to run")
    if warmup_agents < 0:
        raise UsageError(f"warm-up agents must be >= 0, got {warmup_agents}")
    order = mode_order(list(modes), repeats)
    prof = get_profile(model_profile)

    def one(mode: str, tr: Trace, **over) -> ReplayRun:
        return asyncio.run(replay(
            scheduler, tr, nodes, block_tokens=prof.block_tokens,
            kv_bytes_per_token=prof.kv_bytes_per_token,
            opts=dataclasses.replace(opts, mode=mode, **over), tls_config=tls_config,
            node_tls=node_tls, node_addresses=node_addresses))

    if warmup_agents:
        warm = Trace(tuple(first_rounds(t, WARMUP_ROUNDS)
                           for t in trace.trajectories[:warmup_agents]),
                     {**trace.meta, "warmup": True})
        for mode in modes:
            one(mode, warm, progress=False, replay_mode="offline", aps=None)
    passes: dict[str, list[ReplayRun]] = {m: [] for m in modes}
    ran: list[tuple[str, ReplayRun]] = []
    for mode in order:
        try:
            run = one(mode, trace)
        except ReplayAborted as e:
            # A mode's finished passes speak for it; its partial one only when it has none.
            runs = {m: median_run(p) for m, p in passes.items() if p}
            runs.setdefault(mode, e.run)
            e.report = None
            if any(r.records for r in runs.values()):   # a report needs a finished round
                e.report = _report({m: r for m, r in runs.items() if r.records}, nodes,
                                   prefill_nodes, trace, opts, snic_gbit_per_s)
                e.report["partial"] = str(e)
            raise
        passes[mode].append(run)
        ran.append((mode, run))
    runs = {m: median_run(p) for m, p in passes.items()}
    report = _report(runs, nodes, prefill_nodes, trace, opts, snic_gbit_per_s)
    # Passes not reported still count for correctness: their failures and mismatched
    # bytes are totalled here, one pass or several (the CLIs and benches fail on them).
    every = {k: sum(getattr(r, k) for _, r in ran) for k in (
        "requests_failed", "requests_duplicated", "bytes_verified", "bytes_mismatched")}
    report["all_passes"] = every
    report["settings"]["repeats"] = (None if repeats == 1 else {
        "passes": repeats, "order": order, "reported": "each mode's median pass by JCT",
        "jct_s": [[m, run_jct_s(r)] for m, r in ran]})
    report["settings"]["warmup"] = ({"agents": min(warmup_agents, len(trace.trajectories)),
                                     "rounds": WARMUP_ROUNDS, "modes": list(modes)}
                                    if warmup_agents else None)
    return report, runs


def _report(runs: dict[str, ReplayRun], nodes: Sequence[str], prefill_nodes: int,
            trace: Trace, opts: ReplayOptions, snic_gbit_per_s: float) -> dict:
    rate = snic_gbit_per_s * 1e9 / 8
    results = []
    for mode, run in runs.items():
        usable = prefill_nodes if mode == "basic" or opts.read_policy == "prefill" \
            else len(nodes)
        results.append(run.mode_result(rate, usable))   # rate 0: no I/O lower bound
    report = build_report(results, replay_mode=opts.replay_mode,
                          # Unlimited storage NICs: utilisation against a nominal 100 GB/s.
                          rate_bytes_per_s=rate if rate > 0 else UNLIMITED_BYTES_PER_S,
                          context_scale=trace.context_scale,
                          trace=trace_stats(trace.trajectories).as_dict(),
                          start_s=None)
    report["settings"]["snic_gbit_per_s"] = snic_gbit_per_s or "unlimited"
    report["settings"]["layerwise"] = ("per mode (basic off)" if opts.layerwise is None
                                       else opts.layerwise)
    report["settings"]["read_policy"] = opts.read_policy or "per mode"
    report["settings"]["nodes"] = list(nodes)
    for key in ("max_rounds", "extended_from"):     # what make_trace did to the trace
        if trace.meta.get(key):
            report["settings"][key] = trace.meta[key]
    report["reliability"] = {mode: {
        "requests_submitted": r.requests_submitted, "requests_failed": r.requests_failed,
        "requests_duplicated": r.requests_duplicated, "requests_lost": r.requests_lost,
        "reexecutions": r.reexecutions, "results_without_timings": r.results_without_timings,
        "bytes_mismatched": r.bytes_mismatched} for mode, r in runs.items()}
    return report
