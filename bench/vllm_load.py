"""DualPath under load, as agents load it: concurrent requests on one stored history and
an agentic trace, DualPath P/D beside plain vLLM (its own prefix cache) on the same cores.

Method
  Model: SmolLM2-135M-Instruct (float32, 46,080 KV bytes per token; --model for another)
  at its full context (--max-model-len, 8,192), vLLM's CPU build. Two systems, started
  once and driven through the same OpenAI client (/v1/completions, token-id prompts,
  greedy, ignore_eos, streamed, return_token_ids):
    dualpath  `dualpath up --engine vllm` as a user gets it (dualpath/cluster/vllm_pd.py): a
              scheduler, one prefill and one decode node each beside its own vLLM
              instance (vLLM's prefix cache on, as `up` runs it; off with
              --no-dualpath-prefix-caching: every hit comes through DualPath), the front
              end; the default buffers, derived from the model (up --concurrency 4)
    vllm      one plain `python -m vllm.entrypoints.openai.api_server`, prefix caching
              on, on all the cores DualPath's two instances share, with their two KV
              caches' worth of KV cache (2 x --kv-cache-gib)
    vllm-1c   (--one-core-reference, on by default; the concurrent case only) the same
              plain vLLM bound to one core, as each of DualPath's two instances is: how
              much of the gap is the host's two cores cut in two (a burst's prefills run
              on one core, then its decodes on the other, where plain vLLM runs both on
              two), and how much is DualPath's own. It runs the same cases (the same
              prefixes and suffixes) once the other two have stopped: resident beside
              them, bound to the decode instance's core, it slowed DualPath's K = 8 from
              9.6 s to 17.5 s although idle
  The two systems run one at a time, alternated within each repetition (the idle one
  costs ~1% of a core).
  Cases:
    concurrent  K = 1, 2, 4, 8 requests at once, each a stored --prefix-tokens history
                (one per repetition, stored by one request first, its write-back
                drained) plus a suffix of its own (--suffix-tokens), --gen tokens each;
                each K's suffixes are new, so no K hits another's. Wall time
                from the first submit to the last answer; medians over --reps.
    agentic     Table 2's 32K row scaled to the model's context (--context-scale,
                default max_model_len / 32768), --agents trajectories of their first
                --rounds rounds, all agents at once, real tokens (A.3); JCT, medians
                over --agentic-reps.
  Both systems must produce the same greedy tokens (tokens_mismatched).
  Also: each system's start to its first served request (startup_s, a short prompt,
  on a warm host: the models are prepared) and the idle CPU of all its processes over
  --idle-s seconds once started (idle_cores, from /proc).
  DualPath's nodes' logs and metrics give load timeouts (a load that did not load) and
  lease losses (a group registered again); both must be 0.

Prints a table and writes the same record as JSON (--json) with a ``summary``:
concurrent_hit_wall_vs_vllm_max (K = 4 and 8), concurrent_hit_wall_vs_vllm_one_core (per
K), agentic_jct_vs_vllm, idle_cores, startup_s, tokens_mismatched, load_timeouts,
lease_losses.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from dualpath.cluster.agentic import http_generate, run_agents, summary
from dualpath.cluster.run import make_trace
from dualpath.cluster.vllm_node import PlainVllm
from dualpath.cluster.vllm_pd import VllmPdCluster
from dualpath.trace.model import Trace, Trajectory
from dualpath.vllm import models
from dualpath.vllm.sizing import core_slices

T = 128
KS = (1, 2, 4, 8)


def _group(pgid: int) -> list[int]:
    """Processes of process group ``pgid`` (a vLLM server and its engine core)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if os.getpgid(int(d)) == pgid:
                    out.append(int(d))
            except OSError:
                pass
    return out


def _cpu_s(pids: list[int]) -> float:
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for p in pids:
        try:
            f = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(f[11]) + int(f[12])) / tick
        except (OSError, IndexError):
            pass
    return total


def idle_cores(pids, seconds: float) -> float:
    ps = pids()
    a = _cpu_s(ps)
    time.sleep(seconds)
    return (_cpu_s(ps) - a) / seconds


def _dualpath_pids(pd: VllmPdCluster) -> list[int]:
    """Every process of the DualPath cluster: scheduler, nodes, front end, each vLLM
    instance's group (its server and engine core)."""
    c = pd.cluster
    out = [n.proc.pid for n in c.nodes]
    if c.scheduler is not None:
        out.append(c.scheduler.pid)
    if pd.frontend is not None:
        out.append(pd.frontend.pid)
    for inst in pd.instances.values():
        out += _group(inst.proc.pid)
    return sorted(set(out))


def first_served(url: str, model: str, timeout_s: float = 600.0) -> None:
    """Until ``url`` answers a short completion."""
    body = json.dumps({"model": model, "prompt": [1, 2, 3], "max_tokens": 1,
                       "temperature": 0}).encode()
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            req = urllib.request.Request(url + "/v1/completions", body,
                                         {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=60) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} served nothing in {timeout_s:g} s")
        time.sleep(0.5)


async def store(url: str, model: str, prefix: list[int], tag: str) -> None:
    """One request of ``prefix`` alone: its KV is computed and stored (DualPath) or kept
    in the prefix cache (vLLM)."""
    g, close = http_generate(url, model)
    try:
        await g(f"{tag}-store", prefix, 1, 0)
    finally:
        await close()


async def concurrent(url: str, model: str, prefix: list[int], suffixes: list[list[int]],
                     gen: int, tag: str) -> tuple[float, list[list[int]]]:
    """Every suffix after ``prefix`` at once: (wall s, tokens)."""
    g, close = http_generate(url, model)
    try:
        t0 = time.monotonic()
        outs = await asyncio.gather(*(g(f"{tag}-{i}", prefix + s, gen, len(prefix))
                                      for i, s in enumerate(suffixes)))
        return time.monotonic() - t0, [o.token_ids for o in outs]
    finally:
        await close()


def _trace(args, rep: int, scale: float) -> Trace:
    t = make_trace(args.agents, table="32k", context_scale=scale,
                   max_rounds=args.rounds, seed=args.seed + rep)
    return Trace(tuple(Trajectory(f"r{rep}-{tr.id}", tr.rounds, tr.token_ids)
                       for tr in t.trajectories), t.meta)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="model directory (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--kv-cache-gib", type=int, default=1,
                    help="each DualPath instance's vLLM KV cache (plain vLLM gets twice)")
    ap.add_argument("--prefix-tokens", type=int, default=6144)
    ap.add_argument("--suffix-tokens", type=int, default=64)
    ap.add_argument("--gen", type=int, default=16)
    ap.add_argument("--ks", default=",".join(map(str, KS)),
                    help="concurrency levels of the concurrent case (comma-separated)")
    ap.add_argument("--agents", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--context-scale", type=float, default=0.0,
                    help="Table 2's 32K row scaled by this (0: max_model_len / 32768)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dualpath-prefix-caching", action=argparse.BooleanOptionalAction,
                    default=True, help="vLLM's prefix cache in DualPath's instances too, "
                    "as `up --engine vllm` has it by default")
    ap.add_argument("--agentic-reps", type=int, default=1,
                    help="repetitions of the agentic case (each prefills every agent's "
                    "first context on both systems: minutes with SmolLM2 on 2 cores)")
    ap.add_argument("--cases", default="concurrent,agentic")
    ap.add_argument("--one-core-reference", action=argparse.BooleanOptionalAction,
                    default=True, help="also run the concurrent case on plain vLLM bound "
                    "to one core, as each DualPath instance is")
    ap.add_argument("--idle-s", type=float, default=10.0)
    ap.add_argument("--work-dir", default="", help="keep the systems' logs here")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    cases = set(args.cases.split(","))
    if not cases or cases - {"concurrent", "agentic"}:
        ap.error(f"--cases: concurrent, agentic or both, not {args.cases!r}")
    try:
        ks = [int(k) for k in args.ks.split(",")]
    except ValueError:
        ap.error(f"--ks: comma-separated integers, not {args.ks!r}")
    if any(k < 1 for k in ks) or args.reps < 1 or args.agents < 1:
        ap.error("--ks, --reps and --agents must be >= 1")
    if args.prefix_tokens + args.suffix_tokens + args.gen >= args.max_model_len:
        ap.error("--prefix-tokens + --suffix-tokens + --gen must fit --max-model-len")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    scale = args.context_scale or args.max_model_len / 32768
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    model = Path(args.model) if args.model else models.prepare(models.default_dir())["smollm2"]
    vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="dualpath-vllm-load-"))
    work.mkdir(parents=True, exist_ok=True)

    rec: dict = {"settings": {**vars(args), "context_scale": scale, "model": model.name},
                 "concurrent": {}, "agentic": {}, "startup_s": {}, "idle_cores": {}}
    plain = PlainVllm(model, args.max_model_len, 2 * args.kv_cache_gib, work,
                      core_slices(1)[0])
    one = (PlainVllm(model, args.max_model_len, args.kv_cache_gib, work / "one-core",
                     core_slices(2)[1]) if args.one_core_reference and "concurrent" in cases
           else None)
    cases_run: list[tuple[int, list[int], int, list[list[int]]]] = []   # for vllm-1c
    pd = VllmPdCluster(model, work_dir=str(work / "dualpath"), max_model_len=args.max_model_len,
                       kv_cache_gib=args.kv_cache_gib, frontend={},
                       prefix_caching=args.dualpath_prefix_caching)
    urls: dict[str, str] = {}
    try:
        t0 = time.monotonic()
        plain.start()
        first_served(plain.url, model.name)
        rec["startup_s"]["vllm"] = time.monotonic() - t0
        t0 = time.monotonic()
        pd.start()
        first_served(pd.frontend_url, model.name)
        rec["startup_s"]["dualpath"] = time.monotonic() - t0
        urls = {"vllm": plain.url, "dualpath": pd.frontend_url}
        time.sleep(3)                       # let start-up work settle before idling
        rec["idle_cores"]["dualpath"] = idle_cores(lambda: _dualpath_pids(pd), args.idle_s)
        rec["idle_cores"]["vllm"] = idle_cores(lambda: _group(plain.proc.pid),
                                                 args.idle_s)
        mismatched = 0
        rng = random.Random(args.seed)
        for rep in range(args.reps):
            order = ["dualpath", "vllm"] if rep % 2 == 0 else ["vllm", "dualpath"]
            if "concurrent" in cases:
                # One stored history per repetition (storing it is a full prefill);
                # each K's suffixes are new, so no K hits another's.
                prefix = [rng.randrange(vocab) for _ in range(args.prefix_tokens)]
                for sysname in order:
                    asyncio.run(store(urls[sysname], model.name, prefix, f"s{rep}"))
                pd.wait_written()            # stored: on disk, not only in write-back
                for k in ks:
                    sufs = [[rng.randrange(vocab) for _ in range(args.suffix_tokens)]
                            for _ in range(k)]
                    cases_run.append((rep, prefix, k, sufs))
                    toks = {}
                    for sysname in order:
                        wall, toks[sysname] = asyncio.run(concurrent(
                            urls[sysname], model.name, prefix, sufs, args.gen,
                            f"c{rep}-{k}-{sysname}"))
                        rec["concurrent"].setdefault(str(k), {}).setdefault(
                            sysname, []).append(wall)
                        if sysname == "dualpath":
                            pd.wait_written()
                    mismatched += sum(a != b for a, b in zip(toks["dualpath"], toks["vllm"]))
                    print(f"rep {rep} K={k}: " + ", ".join(
                        f"{s} {rec['concurrent'][str(k)][s][-1]:.2f} s" for s in order),
                        flush=True)
            if "agentic" in cases and rep < args.agentic_reps:
                trace = _trace(args, rep, scale)
                toks = {}
                for sysname in order:
                    async def go(url=urls[sysname], tag=f"a{rep}-{sysname}", trace=trace):
                        g, close = http_generate(url, model.name)
                        try:
                            return await run_agents(trace, g, vocab=vocab, block_tokens=T,
                                                    tag=tag, concurrency=args.agents)
                        finally:
                            await close()
                    records = asyncio.run(go())
                    s = summary(records)
                    rec["agentic"].setdefault(sysname, []).append(s)
                    toks[sysname] = {(r.trajectory, r.round): r.token_ids for r in records}
                    if sysname == "dualpath":
                        pd.wait_written()
                mismatched += sum(toks["dualpath"][k] != toks["vllm"].get(k)
                                  for k in toks["dualpath"])
                print(f"rep {rep} agentic: " + ", ".join(
                    f"{s} JCT {rec['agentic'][s][-1]['jct_s']:.2f} s" for s in order),
                    flush=True)
        rec["load_timeouts"], rec["lease_losses"] = _dualpath_faults(pd)
        rec["tokens_mismatched"] = mismatched
    finally:
        pd.stop()
        plain.stop()
        pd.cleanup(keep=bool(args.work_dir))
    if one is not None and cases_run:
        one_core(one, model.name, cases_run, args.gen, rec, work)
    return report(rec, ks, args)


def one_core(one: PlainVllm, model: str, cases_run, gen: int, rec: dict, work: Path) -> None:
    """The concurrent cases again on plain vLLM bound to one core, alone on the host."""
    (work / "one-core").mkdir(exist_ok=True)
    try:
        one.start()
        first_served(one.url, model)
        stored = -1
        for rep, prefix, k, sufs in cases_run:
            if rep != stored:
                asyncio.run(store(one.url, model, prefix, f"s{rep}"))
                stored = rep
            wall, _ = asyncio.run(concurrent(one.url, model, prefix, sufs, gen,
                                             f"c{rep}-{k}-vllm-1c"))
            rec["concurrent"][str(k)].setdefault("vllm-1c", []).append(wall)
            print(f"rep {rep} K={k}: vllm-1c {wall:.2f} s", flush=True)
    finally:
        one.stop()


def _dualpath_faults(pd: VllmPdCluster) -> tuple[int, int]:
    logs = pd.dir / "logs"
    # A hit block found missing is recomputed (not a timeout); a load that timed out or
    # stalled is.
    timeouts = sum(p.read_text(errors="replace").count("DEADLINE_EXCEEDED")
                   + p.read_text(errors="replace").count("made no progress")
                   for p in logs.glob("vllm-*.log"))
    losses = sum(max(0, pd.registrations(n.node_id) - 1) for n in pd.cluster.nodes)
    return timeouts, losses


def report(rec: dict, ks: list[int], args) -> int:
    med = statistics.median
    print(f"\nDualPath under load ({rec['settings']['model']}, context "
          f"{args.max_model_len}; medians of {args.reps} alternated repetitions)")
    print("| case | DualPath P/D (s) | plain vLLM (s) | DualPath / vLLM | plain vLLM, one "
          "core (s) | DualPath / vLLM on one core |")
    print("|---|---|---|---|---|---|")
    ratios, ratios1 = {}, {}
    for k in ks:
        c = rec["concurrent"].get(str(k))
        if not c:
            continue
        d, v = med(c["dualpath"]), med(c["vllm"])
        ratios[k] = d / v
        v1 = med(c["vllm-1c"]) if c.get("vllm-1c") else None
        if v1:
            ratios1[k] = d / v1
        print(f"| K={k} concurrent on a stored {args.prefix_tokens}-token prefix, wall "
              f"| {d:.2f} | {v:.2f} | {d / v:.2f} | "
              + (f"{v1:.2f} | {d / v1:.2f} |" if v1 else "| |"))
    agentic = None
    if rec["agentic"]:
        d = med(s["jct_s"] for s in rec["agentic"]["dualpath"])
        v = med(s["jct_s"] for s in rec["agentic"]["vllm"])
        agentic = d / v
        print(f"| agentic, {args.agents} agents x {args.rounds} rounds, JCT | {d:.2f} | "
              f"{v:.2f} | {agentic:.2f} | | |")
    for what, unit in (("startup_s", "s"), ("idle_cores", "cores")):
        r = rec[what]
        print(f"| {what} ({unit}) | {r['dualpath']:.3f} | {r['vllm']:.3f} | "
              f"{r['dualpath'] / r['vllm']:.2f} | | |")
    high = [ratios[k] for k in (4, 8) if k in ratios]
    rec["summary"] = {
        "concurrent_hit_wall_vs_vllm": {str(k): r for k, r in ratios.items()},
        "concurrent_hit_wall_vs_vllm_max": max(high) if high else None,
        "concurrent_hit_wall_vs_vllm_one_core": {str(k): r for k, r in ratios1.items()},
        "agentic_jct_vs_vllm": agentic,
        "idle_cores": rec["idle_cores"]["dualpath"],
        "idle_cores_vllm": rec["idle_cores"]["vllm"],
        "startup_s": rec["startup_s"]["dualpath"],
        "startup_s_vllm": rec["startup_s"]["vllm"],
        "tokens_mismatched": rec["tokens_mismatched"],
        "load_timeouts": rec["load_timeouts"], "lease_losses": rec["lease_losses"],
        "targets": {"concurrent_hit_wall_vs_vllm_max": "<= 1.25",
                    "agentic_jct_vs_vllm": "<= 1.25", "idle_cores": "<= 0.05",
                    "startup_s": "<= 60", "tokens_mismatched": "0", "load_timeouts": "0",
                    "lease_losses": "0"}}
    print("\nsummary")
    for k, v in rec["summary"].items():
        print(f"  {k}: {v}")
    if args.json:
        Path(args.json).write_text(json.dumps(rec, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
