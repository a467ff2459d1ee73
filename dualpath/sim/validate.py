"""The simulator against the local cluster (bench/sim_validate.py and its test): the
same trace, shape and modes on real processes (`LocalCluster`, `run_modes`) and on
the simulator, each figure's error, and the calibration of the simulator's host model
(what this host's CPU spends per request and per byte moved, the fetch round trip) on
one set of runs, to be validated on others it never saw.

:func:`errors` and :func:`calibrate` are pure; :func:`real_runs` runs the cluster.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

from dualpath.sim.cluster import SimCluster
from dualpath.sim.hardware import LOCAL, Shape, SimHardware

HOST_CORES = os.cpu_count() or 1


@dataclass(frozen=True)
class Case:
    """One run: a generated trace (Table 2 row, seed, agents, rounds, context scale) on a
    P x D local cluster with every node's storage NIC at ``snic_gbit_per_s``."""

    table: str
    seed: int
    agents: int
    rounds: int
    context_scale: float
    prefill_nodes: int
    decode_nodes: int
    snic_gbit_per_s: float

    @property
    def shape(self) -> Shape:
        return Shape(self.prefill_nodes, self.decode_nodes)

    def name(self) -> str:
        return (f"{self.shape} {self.table} s{self.seed} {self.agents}x{self.rounds} "
                f"ctx{self.context_scale:g}")

    def trace(self):
        from dualpath.cluster.run import make_trace

        return make_trace(self.agents, table=self.table, context_scale=self.context_scale,
                          max_rounds=self.rounds, seed=self.seed)

    def hardware(self, base: SimHardware = LOCAL) -> SimHardware:
        return base.with_(snic_bytes_per_s=self.snic_gbit_per_s * 1e9 / 8)


def _figures(jct_s: float, util: dict[str, float]) -> dict:
    return {"jct_s": jct_s, "snic_util": util}


def sim_runs(case: Case, modes: Sequence[str], hw: SimHardware, seed: int = 0) -> dict:
    """{mode: {jct_s, snic_util per node}} of the simulator."""
    tr = case.trace()
    hw = case.hardware(hw)
    out = {}
    for m in modes:
        r = SimCluster(case.shape, hw, tr, m, seed=seed).run()
        rate = hw.snic_bytes_per_s
        out[m] = _figures(r.sim_s, {n: b / (rate * r.sim_s)
                                    for n, b in r.snic_read_bytes.items()})
    return out


def _cpu_s(pids: Iterable[int]) -> float:
    import psutil

    total = 0.0
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
        except psutil.Error:
            pass
    return total


def real_runs(case: Case, modes: Sequence[str]) -> dict:
    """{mode: {jct_s, snic_util per node, host_cpu_load}} of a local cluster (real
    processes; model execution emulated). The host's load is the CPU time of the
    scheduler, the nodes and this process (the replay driver) over the run's wall
    time and this host's cores."""
    from dualpath.cluster.local import LocalCluster
    from dualpath.cluster.replay import ReplayOptions
    from dualpath.cluster.run import run_modes

    tr = case.trace()
    out = {}
    with LocalCluster(case.prefill_nodes, case.decode_nodes, settings={
            "storage": {"snic_gbit_per_s": case.snic_gbit_per_s}}) as c:
        pids = [c.scheduler.pid, *(n.proc.pid for n in c.nodes)]
        for i, m in enumerate(modes):
            w0, c0, s0 = time.monotonic(), _cpu_s(pids), time.process_time()
            rep, _ = run_modes(c.scheduler_address, c.node_ids(), c.prefill_nodes, tr, [m],
                               ReplayOptions(), snic_gbit_per_s=case.snic_gbit_per_s,
                               tls_config=c.client_tls, node_tls=c.node_tls,
                               node_addresses=c.addresses(), warmup_agents=int(i == 0))
            wall = time.monotonic() - w0
            cpu = _cpu_s(pids) - c0 + time.process_time() - s0
            s = rep["modes"][m]
            out[m] = _figures(s["jct_s"], {n: v["utilisation"]
                                           for n, v in s["snic"]["nodes"].items()})
            out[m]["host_cpu_load"] = cpu / wall / HOST_CORES
            out[m]["wall_s"] = wall
    return out


def errors(real: dict, sim: dict) -> dict:
    """Per mode: the simulated JCT's relative error and the largest absolute error of a
    node's storage-NIC utilisation."""
    out = {}
    for m, r in real.items():
        s = sim[m]
        util = [abs(s["snic_util"].get(n, 0.0) - u) for n, u in r["snic_util"].items()]
        out[m] = {"jct_real_s": r["jct_s"], "jct_sim_s": s["jct_s"],
                  "jct_rel_error": abs(s["jct_s"] - r["jct_s"]) / r["jct_s"],
                  "snic_util_abs_error_max": max(util) if util else 0.0}
    return out


#: What calibration searches: this host's CPU per request and per KV byte (the local
#: cluster's processes share its cores), a fetch's round trip and the replay driver's
#: delay from a result to the next round, and a node-to-node control hop.
GRID = {"cpu_s_per_request": (0.0, 0.005),
        "cpu_s_per_byte": (0.0, 1e-9),
        "rpc_s": (0.001, 0.0025, 0.005),
        "client_s": (0.0, 0.010, 0.025, 0.050),
        "hop_s": (0.0, 0.005, 0.010, 0.020, 0.040)}


def calibrate(runs: Sequence[tuple[Case, dict]], base: SimHardware = LOCAL,
              grid: dict = GRID) -> tuple[SimHardware, float]:
    """The host model minimising the largest relative JCT error over ``runs`` ((case,
    real figures by mode)); returns it and that error."""
    best: tuple[float, SimHardware] | None = None
    keys = list(grid)
    for values in itertools.product(*(grid[k] for k in keys)):
        hw = base.with_(host_cores=float(HOST_CORES), **dict(zip(keys, values)))
        worst = 0.0
        for case, real in runs:
            sim = sim_runs(case, list(real), hw)
            worst = max(worst, *(e["jct_rel_error"] for e in errors(real, sim).values()))
            if best is not None and worst >= best[0]:
                break
        if best is None or worst < best[0]:
            best = (worst, hw)
    assert best is not None
    return best[1], best[0]


def host_model(hw: SimHardware) -> dict:
    d = asdict(hw)
    return {k: d[k] for k in ("host_cores", *GRID)}
