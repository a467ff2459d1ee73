"""PNGs of `dualpath repro` records (matplotlib's Agg canvas: no display, no pyplot
global state)."""

from __future__ import annotations

import textwrap
from collections.abc import Mapping

import numpy as np


def _canvas(width: float = 7.0, panels: int = 1):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, 4), dpi=100)
    FigureCanvasAgg(fig)
    return fig, fig.subplots(1, panels)


def _bars(ax, groups: list[str], series: Mapping[str, list[float]], ylabel: str) -> None:
    x = np.arange(len(groups))
    width = 0.8 / max(1, len(series))
    for i, (name, values) in enumerate(series.items()):
        bars = ax.bar(x + (i - (len(series) - 1) / 2) * width, values, width, label=name)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.set_xticks(x, groups)
    ax.set_ylabel(ylabel)
    ax.legend()


def write(record: Mapping, path: str) -> None:
    fig, ax = _canvas()
    pts, name = record["points"], record["figure"]
    if name == "fig11":
        for mode in dict.fromkeys(p["mode"] for p in pts):
            mine = [p for p in pts if p["mode"] == mode]
            ax.plot([p["aps"] for p in mine], [p["trajectory_s"] for p in mine], "o-",
                    label=mode)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("agents per second (Poisson arrivals)")
        ax.set_ylabel("average trajectory completion (s)")
        ax.legend()
    elif name == "fig10":
        for mode in dict.fromkeys(p["mode"] for p in pts):
            mine = sorted((p for p in pts if p["mode"] == mode), key=lambda p: p["aps"])
            line, = ax.plot([p["aps"] for p in mine], [p["slo_attainment"] for p in mine],
                            "o-", label=mode)
            cap = record["summary"].get(f"capacity_aps_{mode}")
            if cap:
                ax.axvline(cap, color=line.get_color(), linestyle=":")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("agents per second (Poisson arrivals); dotted: capacity")
        ax.set_ylabel("requests within the SLO (fraction)")
        ax.legend()
    elif name == "fig12":
        fig, (left, ax) = _canvas(11.0, panels=2)
        br = [p for p in pts if p.get("half") == "left"]
        groups = [f"{p['mode']}\n{p['aps']:g} APS" for p in br]
        bottom = np.zeros(len(br))
        for part in ("scheduling", "allocating", "reading", "prefill"):
            v = np.array([p[f"{part}_s"] for p in br])
            left.bar(groups, v, bottom=bottom, label=part)
            bottom += v
        left.set_ylabel("mean TTFT (s), by part")
        left.tick_params(axis="x", labelsize=7)
        left.legend(fontsize=7)
        ab = [p for p in pts if p.get("half") == "right"]
        _bars(ax, [p["step"] for p in ab], {"JCT": [p["jct_s"] for p in ab]}, "JCT (s)")
        ax.tick_params(axis="x", labelsize=7)
    elif name == "fig14":
        _bars(ax, [p["quota"] for p in pts],
              {"mean": [p["attention_max_avg_mean"] or 0 for p in pts],
               "p90": [p["attention_max_avg_p90"] or 0 for p in pts]},
              "attention time max/avg over engines, per step")
    elif name == "table3":
        off = [p for p in pts if "tokens_per_s_per_gpu" in p]
        _bars(ax, [p["shape"] for p in off],
              {"tokens/s per GPU (simulated)": [p["tokens_per_s_per_gpu"] for p in off]},
              "prompt + generated tokens / s / GPU")
        ax.set_xlabel("P/D shape (8 GPUs a node)")
    elif name == "fig9":
        _bars(ax, [p["scaled"] for p in pts], {"dualpath / basic": [p["speedup"] for p in pts]},
              "speedup (JCT basic / dualpath)")
    elif name == "fig13":
        _bars(ax, [p["policy"] for p in pts],
              {"max/avg (byte-weighted windows)": [p["window_max_avg_bytes_weighted"] or 0
                                                   for p in pts]},
              "storage-NIC max/avg over nodes")
    else:
        key = "agents" if name == "fig7" else "shape"
        groups = list(dict.fromkeys(str(p[key]) for p in pts))
        modes = list(dict.fromkeys(p["mode"] for p in pts))
        jct = {(str(p[key]), p["mode"]): p["jct_s"] for p in pts}
        _bars(ax, groups, {m: [jct.get((g, m), 0) for g in groups] for m in modes},
              "JCT (s)")
        ax.set_xlabel("agents" if name == "fig7" else "P/D shape")
    ax.set_title(f"{name}: {record['title']}", fontsize=10)
    fig.text(0.01, 0.01, "\n".join(textwrap.wrap(record["scale"]["described"], 140)),
             fontsize=6)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, format="png")
