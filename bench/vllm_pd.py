"""The paper's effect with a real model: vLLM prefill and decode instances (1P2D) under
DualPath's scheduler, basic vs dualpath vs oracle, on one agentic trace.

Method
  Model: SmolLM2-135M-Instruct (float32, 46,080 KV bytes per token, 128-token blocks;
  --model for another), vLLM's CPU build; a scheduler, one prefill node and two decode
  nodes, each beside its own `vllm serve` (dualpath/cluster/vllm_pd.py), all on this host. The
  trace: Table 2's 32K row scaled by --context-scale, --agents trajectories of their
  first --rounds rounds, replayed offline (every agent starts at once) with real tokens:
  round k's prompt = the previous prompt + the tokens actually generated + the appended
  tokens (A.3), exactly g_k tokens generated (ignore_eos), greedy.
  Modes, alternated within each repetition (each repetition its own trajectories; the
  modes of one repetition run the same prompts, and the store is emptied after each
  mode, so no mode reads or skips writing another's blocks):
    basic     every hit read by the prefill node (the PE read path), and no layerwise
              loading: the prefill waits for the whole hit before its first layer
    dualpath  the scheduler picks the reading side per request (with --split-read, the
              default, it may split a hit between the PE and the DE so both queues
              drain together; --no-split-read: one side, as the paper), layerwise
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
  Every node's DE buffer is --de-buffer-mib, room for the prompts in flight and the
  write-back behind them, so persisting new KV (at the storage NIC's pace) never holds
  up a request; each mode's write-back is drained before the next mode starts.
  Figures: medians over --reps of JCT; TTFT / TPOT p50 and p99 over all rounds of all
  repetitions; each node's storage-NIC bytes read and bytes written (from the node's
  /metrics) and the hit blocks the nodes found missing and computed instead (a block
  still in write-back when its agent's next round reads it); its load, the busier of the two directions of the full-duplex NIC
  (storage/ratelimit.py), its utilisation (load / (limit x JCT)), and max/avg of the
  load over the three nodes (io_bound_snic_max_avg; reads alone:
  io_bound_snic_read_max_avg);
  tokens: every mode's generated tokens against the oracle run's of the same round
  (I/O-bound case; all greedy, so they must agree).

Prints a table and writes the same record as JSON (--json) with a ``summary``:
io_bound_speedup_vs_basic (and io_bound_speedup_vs_basic_p2d1 with --prefill-tp 2),
compute_bound_slowdown_vs_basic (a fraction), io_bound_snic_max_avg, tokens_mismatched.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import statistics
import sys
import time
from pathlib import Path

from dualpath.cluster.agentic import Generation, run_agents, summary
from dualpath.cluster.run import make_trace
from dualpath.cluster.vllm_pd import VllmPdCluster
from dualpath.scheduler.generate import Generator
from dualpath.storage.store import SUFFIX
from dualpath.trace.model import Trace, Trajectory
from dualpath.vllm import models

T = 128
MODES = {"basic": ("basic", "prefill", False), "dualpath": ("dualpath", "scheduler", True),
         "oracle": ("oracle", "none", True)}


def _trace(args, rep: int) -> Trace:
    t = make_trace(args.agents, table="32k", context_scale=args.context_scale,
                   max_rounds=args.rounds, seed=args.seed)
    # Fresh trajectory names per repetition: no repetition hits another's blocks.
    return Trace(tuple(Trajectory(f"r{rep}-{tr.id}", tr.rounds, tr.token_ids)
                       for tr in t.trajectories), t.meta)


NODES = ("p0", "d0", "d1")
READ, WRITTEN = "dualpath_node_storage_read_bytes_total", \
    "dualpath_node_storage_written_bytes_total"
RECOMPUTED = "dualpath_node_hit_blocks_recomputed_total"


async def _run(gen: Generator, trace: Trace, mode: str, vocab: int, tag: str):
    payload_mode, policy, layerwise = MODES[mode]

    async def generate(rid, prompt, n, hit) -> Generation:
        salt = rid.rsplit("-", 1)[0] if mode == "oracle" else rid   # trajectory / request
        g = await gen.generate(rid, prompt, n, hit_tokens=hit, block_tokens=T,
                               mode=payload_mode, read_policy=policy, layerwise=layerwise,
                               timeout_s=1800, cache_salt=salt)
        return Generation(g.token_ids, g.first_token_unix_s - g.submit_unix_s,
                          g.finish_unix_s - g.submit_unix_s)
    return await run_agents(trace, generate, vocab=vocab, block_tokens=T, tag=tag,
                            concurrency=64)


def _io_bytes(pd: VllmPdCluster) -> dict[str, tuple[float, float, float]]:
    """node -> (bytes read, bytes written) through its storage NIC so far, and the hit
    blocks it found missing and computed instead."""
    out = {}
    for n in NODES:
        m = pd.node_metrics(n)
        out[n] = (m.get(READ, 0.0), m.get(WRITTEN, 0.0), m.get(RECOMPUTED, 0.0))
    return out


def _empty_store(pd: VllmPdCluster) -> None:
    """Delete every stored block (the cluster's one shared store), so the next mode
    reads and writes only its own blocks: modes run the same prompts (their tokens are
    compared), and a mode after another would otherwise find its first rounds already
    written and its hits already in the disk's page cache. Block files only: the
    manifests and the directory tree stay (nodes hold descriptors of it)."""
    for f in (pd.dir / "kv").rglob(f"*{SUFFIX}"):
        f.unlink(missing_ok=True)


def _median_mb(reps: list, k: int) -> dict[str, float]:
    """node -> median MB over the repetitions of its bytes read (k=0) or written (k=1)."""
    return {n: statistics.median(io_[n][k] for _, io_, _ in reps) / 1e6 for n in NODES}


def _cluster(model: Path, snic: float, work: Path, name: str, args) -> VllmPdCluster:
    settings = {"buffers": {"de_buffer_mib": args.de_buffer_mib},
                "scheduler": {"split_read": args.split_read}}
    if snic:
        settings["storage"] = {"snic_gbit_per_s": snic}
    return VllmPdCluster(model, decode_nodes=2, work_dir=str(work / name), settings=settings,
                         max_model_len=8192, kv_cache_gib=args.kv_cache_gib,
                         prefix_caching=True, prefill_tp=args.prefill_tp,
                         decode_tp=args.decode_tp).start()


def case(args, model: Path, vocab: int, snic: float, modes: list[str], work: Path) -> dict:
    need_oracle = "oracle" in modes
    pd = _cluster(model, snic, work, f"pd-{snic:g}", args)
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
                before = _io_bytes(pd)
                recs = loop.run_until_complete(_run(
                    gens["dp"], _trace(args, rep), m, vocab, f"{m}{rep}-{int(time.time())}"))
                # Write-back goes on after the last token (off the requests' latency);
                # it ends before the next mode starts, so no mode's reads wait behind
                # another's writes, and its bytes are this mode's.
                drain = pd.wait_written()
                after = _io_bytes(pd)
                _empty_store(pd)
                io_ = {n: tuple(a - b for a, b in zip(after[n], before[n])) for n in NODES}
                if rep >= args.warmup:
                    runs[m].append((recs, io_, drain))
                print(f"  {'warm-up' if rep < args.warmup else f'rep {rep - args.warmup}'}"
                      f" {m}: JCT {summary(recs)['jct_s']:.2f} s, write-back drained "
                      f"{drain:.1f} s later, MB read/written "
                      + ", ".join(f"{n} {r / 1e6:.0f}/{w / 1e6:.0f}"
                                  for n, (r, w, _) in io_.items())
                      + f", hit blocks recomputed {sum(x[2] for x in io_.values()):.0f}",
                      file=sys.stderr)
    finally:
        for g in gens.values():
            loop.run_until_complete(g.close())
        loop.close()
        pd.stop()
        pd.cleanup()
    out = {}
    rate = snic * 1e9 / 8 if snic else 0.0
    for m, reps in runs.items():
        s = [summary(r) for r, _, _ in reps]
        flat = summary([x for r, _, _ in reps for x in r])
        # A storage NIC is full duplex (storage/ratelimit.py): reads come in and
        # write-back goes out, each at the limit. Its load is its busier direction, and
        # its utilisation that load over the mode's JCT at the limit.
        load = {n: statistics.median(max(io_[n][:2]) for _, io_, _ in reps) for n in NODES}
        reads = {n: statistics.median(io_[n][0] for _, io_, _ in reps) for n in NODES}
        jct = statistics.median(x["jct_s"] for x in s)
        avg = sum(load.values()) / len(load)
        ravg = sum(reads.values()) / len(reads)
        out[m] = {"jct_s": jct, "jct_s_reps": [x["jct_s"] for x in s],
                  "ttft_p50_s": flat["ttft_p50_s"], "ttft_p99_s": flat["ttft_p99_s"],
                  "tpot_p50_s": flat["tpot_p50_s"], "tpot_p99_s": flat["tpot_p99_s"],
                  "rounds": flat["rounds"],
                  "write_back_drain_s": statistics.median(d for _, _, d in reps),
                  "snic_read_mb": _median_mb(reps, 0),
                  "snic_written_mb": _median_mb(reps, 1),
                  "hit_blocks_recomputed": statistics.median(
                      sum(x[2] for x in io_.values()) for _, io_, _ in reps),
                  "snic_utilisation": {n: load[n] / (rate * jct) for n in NODES} if rate
                  else {},
                  "snic_max_avg": max(load.values()) / avg if avg else None,
                  "snic_read_max_avg": max(reads.values()) / ravg if ravg else None,
                  "tokens": [[list(x.token_ids) for x in r] for r, _, _ in reps]}
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
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--context-scale", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1, help="unreported repetitions first")
    ap.add_argument("--snic-gbit", type=float, default=0.015,
                    help="I/O-bound case: every node's storage-NIC limit (Gbit/s; the "
                    "default makes basic >= 3x the oracle on a slow 2-core host)")
    ap.add_argument("--kv-cache-gib", type=int, default=2,
                    help="each vLLM instance's KV cache: the oracle's prefix cache must "
                    "hold every agent's context")
    ap.add_argument("--de-buffer-mib", type=int, default=1024,
                    help="each node's DE buffer: room for every prompt in flight and the "
                    "write-back behind it, so writes never hold up a request")
    ap.add_argument("--split-read", action=argparse.BooleanOptionalAction, default=True,
                    help="the scheduler may split a hit between the PE and the DE "
                    "(scheduler.split_read); --no-split-read: one side per request, as "
                    "the paper")
    ap.add_argument("--cases", default="io,compute",
                    help="which cases to run: io, compute or both (comma-separated)")
    ap.add_argument("--work-dir", default="", help="keep the clusters' logs here")
    ap.add_argument("--prefill-tp", type=int, default=1, choices=(1, 2),
                    help="tensor parallelism of the prefill instance (its ranks share its "
                    "cores)")
    ap.add_argument("--decode-tp", type=int, default=1, choices=(1, 2),
                    help="tensor parallelism of each decode instance")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    if args.json:      # before the run, not after it: a missing folder is made
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    cases = set(args.cases.split(","))
    if not cases or cases - {"io", "compute"}:
        ap.error(f"--cases: io, compute or io,compute, not {args.cases!r}")
    import tempfile

    # SIGTERM unwinds like Ctrl-C, so each cluster's finally stops it: vLLM's engine
    # processes outlive a killed `vllm serve` (measured: ~2.5 GiB each, left behind).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    model = Path(args.model) if args.model else models.prepare(models.default_dir())["smollm2"]
    vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="dualpath-vllm-pd-"))
    io = case(args, model, vocab, args.snic_gbit, ["basic", "dualpath", "oracle"], work) \
        if "io" in cases else {}
    cb = case(args, model, vocab, 0.0, ["basic", "dualpath"], work) \
        if "compute" in cases else {}
    print(f"\nvLLM P/D (1P2D, {model.name}, {args.agents} agents x {args.rounds} rounds, "
          f"medians of {args.reps} alternated repetitions)")
    print("| case | mode | JCT (s) | TTFT p50 / p99 (s) | TPOT p50 / p99 (ms) | storage NIC "
          "p0 / d0 / d1 (MB read+written, utilisation of the busier direction) | write-back drained after (s) "
          "| hit blocks recomputed | tokens mismatched |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, res in ((f"I/O-bound ({args.snic_gbit:g} Gbit/s)", io), ("compute-bound", cb)):
        for m, r in res.items():
            u = r["snic_utilisation"]
            nic = " / ".join(f"{r['snic_read_mb'][n]:.0f}+{r['snic_written_mb'][n]:.0f}"
                             + (f" {100 * u[n]:.0f}%" if u else "") for n in NODES)
            print(f"| {name} | {m} | {r['jct_s']:.2f} | {r['ttft_p50_s']:.3f} / "
                  f"{r['ttft_p99_s']:.3f} | {1e3 * r['tpot_p50_s']:.1f} / "
                  f"{1e3 * r['tpot_p99_s']:.1f} | {nic} | {r['write_back_drain_s']:.1f} "
                  f"| {r['hit_blocks_recomputed']:.0f} | {r.get('tokens_mismatched', '-')} |")

    def ratio(a: dict, b: dict) -> float | None:
        return a["jct_s"] / b["jct_s"] if a and b else None
    tp = f"p{args.prefill_tp}d{args.decode_tp}"
    s = {"io_bound_speedup_vs_basic": ratio(io.get("basic"), io.get("dualpath")),
         # The name for a P TP=2 / D TP=1 run (and its like for others).
         **({f"io_bound_speedup_vs_basic_{tp}": ratio(io.get("basic"), io.get("dualpath"))}
            if tp != "p1d1" else {}),
         "tensor_parallel": tp,
         "io_bound_basic_over_oracle": ratio(io.get("basic"), io.get("oracle")),
         "compute_bound_slowdown_vs_basic": (ratio(cb["dualpath"], cb["basic"]) - 1.0)
         if cb else None,
         "io_bound_snic_max_avg": io["dualpath"]["snic_max_avg"] if io else None,
         "io_bound_snic_read_max_avg": io["dualpath"]["snic_read_max_avg"] if io else None,
         "tokens_mismatched": sum(r.get("tokens_mismatched", 0) for r in io.values())
         if io else None,
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
