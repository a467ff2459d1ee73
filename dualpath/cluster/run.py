"""Replaying one trace in several modes on one cluster and building the report: what
`dualpath replay`, `dualpath demo` and bench/e2e.py share."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence

from dualpath.cluster.replay import ReplayAborted, ReplayOptions, ReplayRun, replay
from dualpath.errors import UsageError
from dualpath.kv.profiles import get_profile
from dualpath.tls import TlsConfig
from dualpath.trace.generator import generate
from dualpath.trace.model import Trace, Trajectory, trace_stats
from dualpath.trace.report import build_report

UNLIMITED_BYTES_PER_S = 100e9


def make_trace(agents: int, *, table: str = "32k", context_scale: float = 0.1,
               max_rounds: int = 0, seed: int = 0, path: str | None = None) -> Trace:
    """A generated trace (Table 2 row scaled by ``context_scale``) or a JSONL file;
    ``max_rounds`` > 0 keeps each trajectory's first rounds (recorded in the meta)."""
    if path:
        from dualpath.trace.loader import read_jsonl

        trace = read_jsonl(path)
        if agents:
            trace = Trace(trace.trajectories[:agents], trace.meta)
    else:
        trace = generate(agents, table, seed=seed, context_scale=context_scale)
    if max_rounds > 0:
        trajs = tuple(Trajectory(t.id, t.rounds[:max_rounds],
                                 None if t.token_ids is None else t.token_ids[
                                     :sum(r.append_tokens + r.gen_tokens
                                          for r in t.rounds[:max_rounds])])
                      for t in trace.trajectories)
        trace = Trace(trajs, {**trace.meta, "max_rounds": max_rounds})
    return trace


def run_modes(scheduler: str, nodes: Sequence[str], prefill_nodes: int, trace: Trace,
              modes: Sequence[str], opts: ReplayOptions, *, snic_gbit_per_s: float,
              tls_config: TlsConfig, node_tls: TlsConfig, model_profile: str = "demo",
              node_addresses: dict[str, str] | None = None
              ) -> tuple[dict, dict[str, ReplayRun]]:
    """Replay ``trace`` once per mode (in order) and build the report dict; the scheduler
    is reached with ``tls_config``, the nodes with ``node_tls``. When a mode cannot
    finish, the report of what ran (that mode's partial run included, the report marked
    ``partial``) rides on the :class:`ReplayAborted` raised (``.report``)."""
    if not modes:
        raise UsageError("no modes to run")
    prof = get_profile(model_profile)
    runs: dict[str, ReplayRun] = {}
    for mode in modes:
        o = dataclasses.replace(opts, mode=mode)
        try:
            runs[mode] = asyncio.run(replay(
                scheduler, trace, nodes, block_tokens=prof.block_tokens,
                kv_bytes_per_token=prof.kv_bytes_per_token, opts=o, tls_config=tls_config,
                node_tls=node_tls, node_addresses=node_addresses))
        except ReplayAborted as e:
            runs[mode] = e.run
            e.report = None
            if any(r.records for r in runs.values()):   # a report needs a finished round
                e.report = _report({m: r for m, r in runs.items() if r.records}, nodes,
                                   prefill_nodes, trace, opts, snic_gbit_per_s)
                e.report["partial"] = str(e)
            raise
    return _report(runs, nodes, prefill_nodes, trace, opts, snic_gbit_per_s), runs


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
    report["settings"]["layerwise"] = opts.layerwise
    report["settings"]["read_policy"] = opts.read_policy or "per mode"
    report["settings"]["nodes"] = list(nodes)
    if trace.meta.get("max_rounds"):
        report["settings"]["max_rounds"] = trace.meta["max_rounds"]
    report["reliability"] = {mode: {
        "requests_submitted": r.requests_submitted, "requests_failed": r.requests_failed,
        "requests_duplicated": r.requests_duplicated, "requests_lost": r.requests_lost,
        "reexecutions": r.reexecutions, "results_without_timings": r.results_without_timings,
        "bytes_mismatched": r.bytes_mismatched} for mode, r in runs.items()}
    return report
