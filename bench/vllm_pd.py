"""The paper's effect with a real model: vLLM prefill and decode instances (1P2D) under
DualPath's scheduler, basic vs dualpath vs oracle, on one agentic trace.

Method
  Model: SmolLM2-135M-Instruct (float32, 46,080 KV bytes per token, 128-token blocks;
  --model for another), vLLM's CPU build; a scheduler, one prefill node and two decode
  nodes, each beside its own `vllm serve` (dualpath/vllm/pd.py), all on this host. The
  trace: Table 2's 32K row scaled by --context-scale, --agents trajectories of their
  first --rounds rounds, replayed offline (every agent starts at once) with real tokens:
  round k's prompt = the previous prompt + the tokens actually generated + the appended
  tokens (A.3), exactly g_k tokens generated (ignore_eos), greedy.
  Modes, alternated within each repetition (each repetition its own trajectories, so
  no mode reads another's blocks):
    basic     every hit read by the prefill node (the PE read path), and no layerwise
              loading: the prefill waits for the whole hit before its first layer
    dualpath  the scheduler picks the reading side (PE, DE, or a real split) per request,
              layerwise loading
    oracle    the hit is in the prefill instance's own memory (vLLM's prefix cache),
              nothing is read from storage; every prompt block still goes to the DE
  The instances keep vLLM's prefix cache on; a request's cache_salt decides what it may
  hit there: the oracle's salt is its trajectory (each round hits the previous ones),
  every other request's its own id (no local hit: every hit comes through DualPath).
  (Two clusters side by side, one with the cache and one without, did not fit this
  host's memory: six SmolLM2 instances, one killed by the OOM killer.)
  Cases: I/O-bound (every node's storage NIC limited to --snic-gbit, chosen so that
  basic's JCT is >= 3x oracle's; the run checks and reports the ratio) and
  compute-bound (no limit; basic vs dualpath only).
  Figures: medians over --reps of JCT; TTFT / TPOT p50 and p99 over all rounds of all
  repetitions; each node's storage-NIC utilisation (its bytes read / (limit x JCT));
  tokens: every mode's generated tokens against the oracle run's of the same round
  (I/O-bound case; all greedy, so they must agree).

Prints a table and writes the same record as JSON (--json) with a ``summary``:
io_bound_speedup_vs_basic, compute_bound_slowdown_vs_basic (a fraction),
io_bound_snic_max_avg, tokens_mismatched.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

from dualpath.cluster.agentic import Generation, run_agents, summary
from dualpath.cluster.generate import Generator
from dualpath.cluster.run import make_trace
from dualpath.trace.model import Trace, Trajectory
from dualpath.vllm import models
from dualpath.vllm.pd import VllmPdCluster

T = 128
MODES = {"basic": ("basic", "prefill", False), "dualpath": ("dualpath", "scheduler", True),
         "oracle": ("oracle", "none", True)}


def _trace(args, rep: int) -> Trace:
    t = make_trace(args.agents, table="32k", context_scale=args.context_scale,
                   max_rounds=args.rounds, seed=args.seed)
    # Fresh trajectory names per repetition: no repetition hits another's blocks.
    return Trace(tuple(Trajectory(f"r{rep}-{tr.id}", tr.rounds, tr.token_ids)
                       for tr in t.trajectories), t.meta)


async def _run(gen: Generator, trace: Trace, mode: str, vocab: int, tag: str):
    payload_mode, policy, layerwise = MODES[mode]
    reads: dict[str, int] = {}

    async def generate(rid, prompt, n, hit) -> Generation:
        salt = rid.rsplit("-", 1)[0] if mode == "oracle" else rid   # trajectory / request
        g = await gen.generate(rid, prompt, n, hit_tokens=hit, block_tokens=T,
                               mode=payload_mode, read_policy=policy, layerwise=layerwise,
                               timeout_s=1800, cache_salt=salt)
        reads[g.prefill_node_id] = reads.get(g.prefill_node_id, 0) + g.prefill_read_bytes
        reads[g.decode_node_id] = reads.get(g.decode_node_id, 0) + g.decode_read_bytes
        return Generation(g.token_ids, g.first_token_unix_s - g.submit_unix_s,
                          g.finish_unix_s - g.submit_unix_s)
    records = await run_agents(trace, generate, vocab=vocab, block_tokens=T, tag=tag,
                               concurrency=64)
    return records, reads


def _cluster(model: Path, snic: float, work: Path, name: str, oracle: bool) -> VllmPdCluster:
    settings = {"storage": {"snic_gbit_per_s": snic}} if snic else {}
    return VllmPdCluster(model, decode_nodes=2, work_dir=str(work / name), settings=settings,
                         max_model_len=8192, prefix_caching=oracle).start()


def case(args, model: Path, vocab: int, snic: float, modes: list[str], work: Path) -> dict:
    need_oracle = "oracle" in modes
    pd = _cluster(model, snic, work, f"pd-{snic:g}", True)
    loop = asyncio.new_event_loop()
    gens = {}
    try:
        gens["dp"] = loop.run_until_complete(Generator(
            pd.cluster.scheduler_address, pd.cluster.client_tls,
            pd.cluster.node_tls).start())
        runs: dict[str, list] = {m: [] for m in modes}
        for rep in range(args.warmup + args.reps):
            order = modes if rep % 2 == 0 else list(reversed(modes))
            for m in order:
                gen = gens["dp"]
                recs, reads = loop.run_until_complete(_run(
                    gen, _trace(args, rep), m, vocab, f"{m}{rep}-{int(time.time())}"))
                if rep >= args.warmup:
                    runs[m].append((recs, reads))
                print(f"  {'warm-up' if rep < args.warmup else f'rep {rep - args.warmup}'}"
                      f" {m}: JCT {summary(recs)['jct_s']:.2f} s", file=sys.stderr)
    finally:
        for g in gens.values():
            loop.run_until_complete(g.close())
        loop.close()
        pd.stop()
        pd.cleanup()
    out = {}
    rate = snic * 1e9 / 8 if snic else 0.0
    for m, reps in runs.items():
        s = [summary(r) for r, _ in reps]
        all_recs = [x for r, _ in reps for x in r]
        flat = summary(all_recs)
        util = []
        for (recs, reads), si in zip(reps, s):
            if rate:
                per = {n: reads.get(n, 0) / (rate * si["jct_s"]) for n in ("p0", "d0", "d1")}
                util.append(per)
        snic_util = ({n: statistics.median(u[n] for u in util) for n in ("p0", "d0", "d1")}
                     if util else {})
        out[m] = {"jct_s": statistics.median(x["jct_s"] for x in s),
                  "jct_s_reps": [x["jct_s"] for x in s],
                  "ttft_p50_s": flat["ttft_p50_s"], "ttft_p99_s": flat["ttft_p99_s"],
                  "tpot_p50_s": flat["tpot_p50_s"], "tpot_p99_s": flat["tpot_p99_s"],
                  "rounds": flat["rounds"], "snic_utilisation": snic_util,
                  "snic_max_avg": (max(snic_util.values()) /
                                   (sum(snic_util.values()) / len(snic_util)))
                  if snic_util and sum(snic_util.values()) else None,
                  "tokens": [[list(x.token_ids) for x in r] for r, _ in reps]}
    if need_oracle:
        ref = out["oracle"]["tokens"]
        for m in modes:
            mism = 0
            for rep_a, rep_b in zip(out[m]["tokens"], ref):
                for a, b in zip(rep_a, rep_b):
                    mism += sum(x != y for x, y in zip(a, b)) + abs(len(a) - len(b))
            out[m]["tokens_mismatched"] = mism
    for r in out.values():
        del r["tokens"]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="model directory (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--agents", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--context-scale", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1, help="unreported repetitions first")
    ap.add_argument("--snic-gbit", type=float, default=0.1,
                    help="I/O-bound case: every node's storage-NIC limit (Gbit/s)")
    ap.add_argument("--work-dir", default="", help="keep the clusters' logs here")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    import tempfile

    model = Path(args.model) if args.model else models.prepare(models.default_dir())["smollm2"]
    vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="dualpath-vllm-pd-"))
    io = case(args, model, vocab, args.snic_gbit, ["basic", "dualpath", "oracle"], work)
    cb = case(args, model, vocab, 0.0, ["basic", "dualpath"], work)
    print(f"\nvLLM P/D (1P2D, {model.name}, {args.agents} agents x {args.rounds} rounds, "
          f"medians of {args.reps} alternated repetitions)")
    print("| case | mode | JCT (s) | TTFT p50 / p99 (s) | TPOT p50 / p99 (ms) | storage NIC "
          "p0 / d0 / d1 | tokens mismatched |")
    print("|---|---|---|---|---|---|---|")
    for name, res in ((f"I/O-bound ({args.snic_gbit:g} Gbit/s)", io), ("compute-bound", cb)):
        for m, r in res.items():
            u = r["snic_utilisation"]
            util = " / ".join(f"{100 * u[n]:.0f}%" for n in ("p0", "d0", "d1")) if u else "-"
            print(f"| {name} | {m} | {r['jct_s']:.2f} | {r['ttft_p50_s']:.3f} / "
                  f"{r['ttft_p99_s']:.3f} | {1e3 * r['tpot_p50_s']:.1f} / "
                  f"{1e3 * r['tpot_p99_s']:.1f} | {util} | {r.get('tokens_mismatched', '-')} |")
    s = {"io_bound_speedup_vs_basic": io["basic"]["jct_s"] / io["dualpath"]["jct_s"],
         "io_bound_basic_over_oracle": io["basic"]["jct_s"] / io["oracle"]["jct_s"],
         "compute_bound_slowdown_vs_basic": cb["dualpath"]["jct_s"] / cb["basic"]["jct_s"]
         - 1.0,
         "io_bound_snic_max_avg": io["dualpath"]["snic_max_avg"],
         "tokens_mismatched": sum(r.get("tokens_mismatched", 0) for r in io.values()),
         "snic_gbit_per_s": args.snic_gbit,
         "targets": {"io_bound_speedup_vs_basic": ">= 2.0",
                     "compute_bound_slowdown_vs_basic": "<= 0.05",
                     "io_bound_snic_max_avg": "<= 1.2", "tokens_mismatched": "0",
                     "io_bound_basic_over_oracle": ">= 3 (the case is I/O-bound)"}}
    print("\nsummary")
    for k, v in s.items():
        print(f"  {k}: {v}")
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": s, "io_bound": io,
                                               "compute_bound": cb,
                                               "args": vars(args)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
