"""Replay results: per-request records -> JCT, latencies, SLO, throughput, storage-NIC
load, a cross-mode comparison; rendered as a fixed unit-labelled table, a JSON-ready
dict and a PNG plot. Pure except :func:`write_plot`, which writes the file it is given.

Definitions (docs/traces.md repeats them):

- JCT (offline) = last finish - first submit (or the given start): the whole batch.
- TTFT = first token - submit. TTST = second token - first token (the paper's "time to
  second token" is the gap: its Table 3 has TTST < TTFT); it covers the PE -> DE hand-off.
- TPOT = (finish - second token) / (gen - 2): the DE's decode steps after the hand-off;
  undefined for rounds of fewer than 3 tokens (they pass the TPOT half of the SLO).
- Percentiles: numpy.percentile, linear interpolation.
- SLO attainment = share of requests with TTFT <= 4 s x scale and TPOT <= 50 ms x scale
  (§7; ``slo_scale`` > 1 where the emulated model runs slower than the paper's).
- speedup = basic JCT / mode JCT. efficiency (issue 6, the bench's figure) =
  max(I/O lower bound, oracle JCT) / mode JCT, where the I/O lower bound = hit bytes /
  the storage-NIC bandwidth the mode can use (:func:`io_lower_bound_s`); without a lower
  bound, oracle JCT / mode JCT. gain_captured = (speedup - 1) / (oracle speedup - 1):
  the share of oracle's gain over basic that the mode keeps.
- Storage-NIC utilisation of a node = its bytes / (rate limit x duration). Balance =
  max / mean bytes over nodes, overall, and averaged over short windows when given
  (the paper's Fig. 13 figure).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from dualpath.errors import UsageError

SLO_TTFT_S = 4.0
SLO_TPOT_S = 0.050
MODE_ORDER = ("basic", "dualpath", "oracle")


@dataclass(frozen=True)
class RequestRecord:
    """One finished round, times in seconds on one clock. ``second_token_s`` is None
    exactly when the round generated a single token."""

    agent: int
    round: int
    submit_s: float
    first_token_s: float
    second_token_s: float | None
    finish_s: float
    prompt_tokens: int
    hit_tokens: int
    gen_tokens: int

    def __post_init__(self):
        name = f"record a{self.agent}-r{self.round}"
        if self.gen_tokens < 1 or not 0 <= self.hit_tokens <= self.prompt_tokens:
            raise UsageError(f"{name}: need gen_tokens >= 1 and 0 <= hit_tokens <= "
                             f"prompt_tokens, got {self.gen_tokens}, {self.hit_tokens}, "
                             f"{self.prompt_tokens}")
        if (self.second_token_s is None) != (self.gen_tokens == 1):
            raise UsageError(f"{name}: second_token_s must be given iff gen_tokens >= 2")
        times = [self.submit_s, self.first_token_s, self.second_token_s, self.finish_s]
        times = [t for t in times if t is not None]
        if times != sorted(times):
            raise UsageError(f"{name}: times must not decrease (submit <= first <= second "
                             f"<= finish), got {times}")

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.submit_s

    @property
    def ttst_s(self) -> float | None:
        return None if self.second_token_s is None else self.second_token_s - self.first_token_s

    @property
    def tpot_s(self) -> float | None:
        if self.gen_tokens < 3:
            return None
        return (self.finish_s - self.second_token_s) / (self.gen_tokens - 2)


def stats(values: Sequence[float]) -> dict:
    """mean, p50, p99 (numpy linear percentiles) and count; None values when empty."""
    if not values:
        return {"count": 0, "mean": None, "p50": None, "p99": None}
    v = np.asarray(values, dtype=np.float64)
    return {"count": int(v.size), "mean": float(v.mean()),
            "p50": float(np.percentile(v, 50)), "p99": float(np.percentile(v, 99))}


def summarize(records: Sequence[RequestRecord], *, start_s: float | None = None,
              slo_scale: float = 1.0) -> dict:
    """One mode's run: JCT, latency stats, SLO attainment and throughput."""
    if not records:
        raise UsageError("summarize: no request records")
    if not slo_scale > 0:
        raise UsageError(f"slo_scale must be > 0, got {slo_scale!r}")
    start = min(r.submit_s for r in records) if start_s is None else start_s
    jct = max(r.finish_s for r in records) - start
    ttft_lim, tpot_lim = SLO_TTFT_S * slo_scale, SLO_TPOT_S * slo_scale
    ok = sum(1 for r in records
             if r.ttft_s <= ttft_lim and (r.tpot_s is None or r.tpot_s <= tpot_lim))
    gen = sum(r.gen_tokens for r in records)
    prompt = sum(r.prompt_tokens for r in records)
    rate = (lambda x: x / jct) if jct > 0 else (lambda x: None)
    return {
        "requests": len(records),
        "agents": len({r.agent for r in records}),
        "prompt_tokens": prompt,
        "hit_tokens": sum(r.hit_tokens for r in records),
        "gen_tokens": gen,
        "jct_s": jct,
        "ttft_s": stats([r.ttft_s for r in records]),
        "ttst_s": stats([r.ttst_s for r in records if r.ttst_s is not None]),
        "tpot_s": stats([r.tpot_s for r in records if r.tpot_s is not None]),
        "slo": {"ttft_limit_s": ttft_lim, "tpot_limit_s": tpot_lim,
                "attainment": ok / len(records)},
        "throughput": {"gen_tokens_per_s": rate(gen), "prompt_tokens_per_s": rate(prompt),
                       "requests_per_s": rate(len(records))},
    }


def _max_avg(values: Sequence[float]) -> float | None:
    mean = sum(values) / len(values) if values else 0
    return max(values) / mean if mean > 0 else None


def snic_usage(node_bytes: Mapping[str, int], *, rate_bytes_per_s: float,
               duration_s: float,
               windows: Sequence[Mapping[str, int]] | None = None) -> dict:
    """Per-node storage-NIC bytes and utilisation, and the max/avg balance over nodes.
    ``windows`` (per-node bytes in short equal windows) gives the windowed balance:
    the mean over windows that carried traffic of max/avg across all nodes
    (``window_max_avg``), and the same mean weighted by each window's bytes
    (``window_max_avg_bytes_weighted``): a run's first and last windows carry a few
    stragglers on one node (max/avg up to the node count) and little traffic, and the
    weighted figure keeps them from standing for the busy period the paper's Fig. 13
    shows."""
    if not node_bytes:
        raise UsageError("snic_usage: no nodes")
    if not rate_bytes_per_s > 0 or not duration_s > 0:
        raise UsageError(f"snic_usage: rate and duration must be > 0, got "
                         f"{rate_bytes_per_s!r} B/s, {duration_s!r} s")
    nodes = list(node_bytes)  # the caller's order (e.g. prefill nodes first)
    out = {"rate_bytes_per_s": float(rate_bytes_per_s), "duration_s": float(duration_s),
           "nodes": {n: {"bytes": int(node_bytes[n]),
                         "utilisation": node_bytes[n] / (rate_bytes_per_s * duration_s)}
                     for n in nodes},
           "max_avg": _max_avg([node_bytes[n] for n in nodes]),
           "window_max_avg": None, "window_max_avg_bytes_weighted": None}
    if windows:
        unknown = sorted(set().union(*windows) - set(nodes))
        if unknown:
            raise UsageError(f"snic_usage: window names unknown node {unknown[0]!r}")
        busy = [(r, sum(w.values())) for w in windows
                if (r := _max_avg([w.get(n, 0) for n in nodes]))]
        if busy:
            out["window_max_avg"] = sum(r for r, _ in busy) / len(busy)
            out["window_max_avg_bytes_weighted"] = (
                sum(r * b for r, b in busy) / sum(b for _, b in busy))
    return out


#: The parts of TTFT (the paper's Fig. 12 left), in order.
TTFT_PARTS = ("scheduling", "allocating", "reading", "prefill")


def ttft_breakdown(rows: Iterable[tuple[float, float, float, float, float]]) -> dict | None:
    """Mean seconds of each part of TTFT over ``(submit, assigned, allocated, staged,
    first_token)`` times, one row per request: scheduling (submitted -> its PE fetched
    it), allocating (-> its DE's and PE's buffers held), reading (-> its hit staged in
    the PE buffer, whichever side read it), prefill (-> its first token: the forward's
    queue and compute). Rows without a breakdown (assigned 0) are left out; None when
    none has one."""
    sums = [0.0] * len(TTFT_PARTS)
    n = 0
    for submit, assigned, allocated, staged, first in rows:
        if not assigned:
            continue
        marks = [submit, assigned, allocated, staged, first]
        for i in range(len(TTFT_PARTS)):
            sums[i] += max(0.0, marks[i + 1] - marks[i])
        n += 1
    return {k: v / n for k, v in zip(TTFT_PARTS, sums)} if n else None


def attention_balance(steps: Iterable[tuple[float, Sequence[float]]]) -> dict | None:
    """The attention balance across one node's engines (the paper's Fig. 14), over
    forward steps given as ``(duration_s, attention seconds per engine)``: per step the
    slowest engine's attention over the engines' mean (an engine without work counts
    as 0: the others wait for it at the step's synchronisation), then the mean over
    steps weighted by step time, the median and the 90th percentile. Steps with no
    attention at all are left out; None when none is left."""
    rows = []
    for dur, attn in steps:
        mean = sum(attn) / len(attn) if attn else 0.0
        if mean > 0:
            rows.append((max(attn) / mean, dur))
    if not rows:
        return None
    ratios = sorted(r for r, _ in rows)
    total = sum(d for _, d in rows)
    return {"steps": len(rows),
            "max_avg_mean": (sum(r * d for r, d in rows) / total if total > 0
                             else sum(ratios) / len(ratios)),
            "max_avg_p50": ratios[len(ratios) // 2],
            "max_avg_p90": ratios[min(len(ratios) - 1, int(0.9 * len(ratios)))]}


def io_lower_bound_s(hit_bytes: int, snic_nodes: int, rate_bytes_per_s: float) -> float:
    """The least time a mode needs to read its hits: bytes over the storage-NIC bandwidth
    it can use (basic: the P nodes' NICs; dualpath: P + D nodes'; oracle reads nothing)."""
    if snic_nodes < 1 or not rate_bytes_per_s > 0:
        raise UsageError("io_lower_bound_s: need >= 1 node and a rate > 0")
    return hit_bytes / (snic_nodes * rate_bytes_per_s)


@dataclass
class ModeResult:
    """What a replay in one mode produced, as the report needs it."""

    mode: str
    records: Sequence[RequestRecord]
    snic_bytes: Mapping[str, int]
    snic_windows: Sequence[Mapping[str, int]] | None = None
    io_lower_bound_s: float | None = None
    extra: dict = field(default_factory=dict)  # e.g. bytes_verified; copied to the JSON


def compare(summaries: Mapping[str, dict],
            io_lower_bounds: Mapping[str, float | None] | None = None) -> list[dict]:
    """Rows of JCT, speedup vs basic, efficiency and gain_captured (module docstring)."""
    lbs = io_lower_bounds or {}
    basic = summaries.get("basic", {}).get("jct_s")
    oracle = summaries.get("oracle", {}).get("jct_s")
    s_oracle = basic / oracle if basic and oracle else None
    rows = []
    for mode in _ordered(summaries):
        jct = summaries[mode]["jct_s"]
        speedup = basic / jct if basic and jct > 0 else None
        eff = None
        if oracle is not None and jct > 0:
            eff = max(lbs.get(mode) or 0.0, oracle) / jct
        gain = None
        if speedup is not None and s_oracle is not None and s_oracle > 1:
            gain = (speedup - 1) / (s_oracle - 1)
        rows.append({"mode": mode, "jct_s": jct, "speedup_vs_basic": speedup,
                     "efficiency": eff, "gain_captured": gain,
                     "io_lower_bound_s": lbs.get(mode)})
    return rows


def _ordered(modes) -> list[str]:
    return sorted(modes, key=lambda m: (MODE_ORDER.index(m) if m in MODE_ORDER else 99, m))


def build_report(results: Sequence[ModeResult], *, replay_mode: str,
                 rate_bytes_per_s: float, context_scale: float, slo_scale: float = 1.0,
                 trace: Mapping | None = None, start_s: float | None = None) -> dict:
    """The whole record, JSON-ready: settings (context_scale always among them), the
    trace's statistics, one summary per mode and the comparison. Model execution is
    emulated by the cost model, and the record says so."""
    if not results:
        raise UsageError("build_report: no results")
    modes = [r.mode for r in results]
    if len(set(modes)) != len(modes):
        raise UsageError(f"build_report: a mode appears twice in {modes}")
    per_mode = {}
    for r in results:
        s = summarize(r.records, start_s=start_s, slo_scale=slo_scale)
        s["snic"] = snic_usage(r.snic_bytes, rate_bytes_per_s=rate_bytes_per_s,
                               duration_s=s["jct_s"], windows=r.snic_windows)
        s.update(r.extra)
        per_mode[r.mode] = s
    return {
        "settings": {"replay_mode": replay_mode, "context_scale": float(context_scale),
                     "slo_scale": float(slo_scale),
                     "snic_rate_bytes_per_s": float(rate_bytes_per_s),
                     "model_execution": "emulated (cost model)"},
        "trace": dict(trace or {}),
        "modes": per_mode,
        "comparison": compare(per_mode, {r.mode: r.io_lower_bound_s for r in results}),
    }


def _f(v, fmt: str, scale: float = 1.0) -> str:
    """Format ``v * scale``; a missing value is "-" in the same width."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        width = fmt.split(".")[0]
        return "-".rjust(int(width)) if width.isdigit() else "-"
    return format(v * scale, fmt)


def format_table(report: Mapping) -> str:
    """The fixed, unit-labelled text table of a report."""
    st = report["settings"]
    title = (f"DualPath replay: {st['replay_mode']}, context_scale {st['context_scale']:g}, "
             f"SLO scale {st['slo_scale']:g}, model execution {st['model_execution']}")
    lines = [title]
    tr = report.get("trace") or {}
    if "turns" in tr:
        lines.append(
            f"trace: {tr.get('trajectories', '?')} trajectories, turns {tr['turns']:.1f}, "
            f"append {tr['append_tokens']:.1f} tok, gen {tr['gen_tokens']:.1f} tok, "
            f"total {tr['total_tokens']:.0f} tok, context {tr['context_tokens']:.0f} tok")
    cmp_rows = {c["mode"]: c for c in report["comparison"]}
    head = (f"{'mode':<9} {'JCT(s)':>9} {'speedup(x)':>10} {'effic.':>7} {'gain':>6} "
            f"{'TTFT p50(s)':>11} {'TTFT p99(s)':>11} {'TTST p50(s)':>11} "
            f"{'TPOT p50(ms)':>12} {'SLO(%)':>7} {'gen(tok/s)':>10}")
    lines += [head, "-" * len(head)]
    for mode, s in report["modes"].items():
        c = cmp_rows.get(mode, {})
        lines.append(
            f"{mode:<9} {_f(s['jct_s'], '9.3f')} {_f(c.get('speedup_vs_basic'), '10.2f')} "
            f"{_f(c.get('efficiency'), '7.2f')} {_f(c.get('gain_captured'), '6.2f')} "
            f"{_f(s['ttft_s']['p50'], '11.3f')} {_f(s['ttft_s']['p99'], '11.3f')} "
            f"{_f(s['ttst_s']['p50'], '11.3f')} {_f(s['tpot_s']['p50'], '12.1f', 1e3)} "
            f"{_f(s['slo']['attainment'], '7.1f', 100)} "
            f"{_f(s['throughput']['gen_tokens_per_s'], '10.1f')}")
    lines.append("")
    lines.append(f"storage NIC per node (rate limit {st['snic_rate_bytes_per_s'] / 1e6:.1f} MB/s)")
    head = f"{'mode':<9} {'node':<12} {'read(MB)':>10} {'util(%)':>8}"
    lines += [head, "-" * len(head)]
    for mode, s in report["modes"].items():
        for node, n in s["snic"]["nodes"].items():
            lines.append(f"{mode:<9} {node:<12} {n['bytes'] / 1e6:10.2f} "
                         f"{n['utilisation'] * 100:8.1f}")
        lines.append(f"{mode:<9} {'max/avg':<12} {_f(s['snic']['max_avg'], '10.2f')} "
                     f"{'':8} (max/avg in windows: {_f(s['snic']['window_max_avg'], '.2f')}, "
                     f"byte-weighted {_f(s['snic']['window_max_avg_bytes_weighted'], '.2f')})")
    return "\n".join(lines)


def to_json(report: Mapping) -> str:
    return json.dumps(report, indent=2, sort_keys=True, allow_nan=False)


def write_plot(report: Mapping, path: str) -> None:
    """PNG: JCT per mode (offline) or TTFT p50/p99 per mode (online), and storage-NIC
    utilisation per node and mode. Uses matplotlib's Agg canvas (no display, no pyplot
    global state)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    st, modes = report["settings"], report["modes"]
    names = list(modes)
    fig = Figure(figsize=(10, 4), dpi=100)
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2)
    x = np.arange(len(names))
    if st["replay_mode"] == "offline":
        bars = left.bar(x, [modes[m]["jct_s"] for m in names], color="tab:blue")
        left.bar_label(bars, fmt="%.2f s")
        left.set_ylabel("JCT (s)")
        left.set_title("Job completion time")
    else:
        for off, q in ((-0.2, "p50"), (0.2, "p99")):
            left.bar(x + off, [modes[m]["ttft_s"][q] or 0 for m in names], 0.4, label=q)
        left.set_ylabel("TTFT (s)")
        left.set_title("Time to first token")
        left.legend()
    left.set_xticks(x, names)
    nodes = list(dict.fromkeys(n for m in names for n in modes[m]["snic"]["nodes"]))
    width = 0.8 / max(1, len(names))
    xn = np.arange(len(nodes))
    for i, m in enumerate(names):
        util = [modes[m]["snic"]["nodes"].get(n, {}).get("utilisation", 0) * 100 for n in nodes]
        right.bar(xn + (i - (len(names) - 1) / 2) * width, util, width, label=m)
    right.set_xticks(xn, nodes)
    right.set_ylabel("storage-NIC utilisation (%)")
    right.set_title("Storage-NIC load per node")
    right.legend()
    fig.suptitle(f"DualPath replay ({st['replay_mode']}, context_scale "
                 f"{st['context_scale']:g}; model execution emulated)")
    fig.tight_layout()
    fig.savefig(path, format="png")


def records_to_json(records: Sequence[RequestRecord]) -> list[dict]:
    return [asdict(r) for r in records]
