"""The store bounded and indexed (issue 40): lookup cost, and an agentic replay under a cap.

Part 1, lookup. A 1,000-block chained prefix is written to a store on this host's disk;
the store's key index then holds 10^6 keys in all (the prefix and 999,000 random keys:
what a node's index holds for a store of a million blocks; the other blocks' files are
not written, which changes nothing for a lookup that finds its keys in memory). Timed,
alternated in one run: ``leading()`` of the prefix through the index, and through today's
per-block path (the same store opened with ``index_max_keys = 0``: one ``stat`` per
block, on a warm dentry cache: a networked filesystem's metadata round trips only add to
it). Medians over ``--reps`` reps; the filesystem calls each made are counted.

Part 2, replay. Agentic trajectories (dualpath.trace.generator, the 32K table scaled by
``--context-scale``) with ``--concurrent`` agents active at once (one starts when one
ends), rounds taken round-robin among them. Each round: look up the prompt's full blocks,
read the hit (every byte checked against the synthetic KV it must hold), recompute the
rest (synthesise each block's KV: the emulated prefill) and write every full block of
the prompt and the round's generation the store lacks. Run three ways on the same trace:
unbounded; capped at ``--cap-fraction`` (0.5) of the trace's working set (every block it
ever writes) with the evictor on (upkeep every ``--upkeep-ms``); and an offline LRU at the
same cap simulated on the same sequence of lookups and writes (exact LRU, filling to the
cap). The store's usage is tracked after every round as bytes written less bytes evicted (an
eviction is counted after its unlink, so this never reads low) and checked against a
scan of the directory every 50 rounds (scans are not counted in the JCT).
The capped and unbounded runs alternate ``--replay-reps`` times (which goes first
alternates too: the disk slows as a run goes on); the JCT is each run's wall time, the
figure the median of each.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from dualpath.kv.prefix import block_keys
from dualpath.kv.profiles import get_profile
from dualpath.kv.synth import SyntheticKV
from dualpath.storage import BlockStore
from dualpath.storage.evictor import StoreCapacity
from dualpath.storage.format import HEADER_BYTES
from dualpath.storage.lru import LruCore
from dualpath.storage.store import aligned_bytes
from dualpath.trace.generator import generate
from dualpath.trace.model import plan_rounds, stream_token_ids

ROOT = Path(__file__).resolve().parent.parent


def small_profile(block_tokens: int):
    """One layer of 256 bytes per token: 4 KiB payload blocks at 16 tokens (the bench
    is about counts of blocks, not their bytes)."""
    return dataclasses.replace(get_profile("demo"), name="bench-bound", layers=1,
                               kv_bytes_per_token_layer=256, block_tokens=block_tokens)


# --- part 1: lookup ----------------------------------------------------------------
def lookup(base: Path, args) -> dict:
    profile = get_profile("demo", 4)
    rng = np.random.default_rng(0)
    keys = block_keys(list(range(4 * 1000)), 4)
    d = base / "lookup"
    synth = None
    with BlockStore(d, profile, read_workers=1, fsync=False,
                    index_max_keys=2_000_000) as idx, \
            BlockStore(d, profile, read_workers=1, fsync=False, index_max_keys=0) as per:
        synth = SyntheticKV(idx.layout)
        buf = aligned_bytes(idx.layout.full_bytes)
        for k in keys:
            synth.fill_full(buf, k)
            idx.write(k, buf)
        for r in rng.integers(0, 256, size=(1_000_000 - len(keys), 16), dtype=np.uint8):
            idx.index.add(r.tobytes())
        assert len(idx.index) == 1_000_000
        t_idx, t_per = [], []
        calls0 = idx.index.stats["index_stat_calls"]
        for _ in range(args.reps):
            t0 = time.perf_counter()
            n1 = idx.leading(keys)
            t1 = time.perf_counter()
            n2 = per.leading(keys)
            t2 = time.perf_counter()
            assert n1 == n2 == 1000, (n1, n2)
            t_idx.append((t1 - t0) * 1e3)
            t_per.append((t2 - t1) * 1e3)
        calls = (idx.index.stats["index_stat_calls"] - calls0) / args.reps
    shutil.rmtree(d, ignore_errors=True)
    ms_idx, ms_per = statistics.median(t_idx), statistics.median(t_per)
    return {"index_keys": 1_000_000, "prefix_blocks": 1000, "reps": args.reps,
            "lookup_ms_index": ms_idx, "lookup_ms_per_block_stat": ms_per,
            "fs_calls_per_lookup_index": calls, "fs_calls_per_lookup_per_block": 1000,
            "speedup": ms_per / ms_idx}


# --- part 2: replay ----------------------------------------------------------------
def trace_rounds(args, bt: int) -> list[tuple[list[bytes], list[bytes]]]:
    """[(prompt's full-block keys, keys of full blocks after the round)] in replay order."""
    trace = generate(args.agents, "32k", seed=args.seed, context_scale=args.context_scale)
    per_agent = []
    for t in trace.trajectories:
        rounds = []
        for p in plan_rounds(t, bt):
            end = p.prompt_tokens + p.gen_tokens
            ids = stream_token_ids(t, 0, end).tolist()
            after = block_keys(ids, bt)
            rounds.append((after[:p.prompt_tokens // bt], after))
        per_agent.append(rounds)
    order, active, nxt = [], [], 0
    while nxt < len(per_agent) or active:
        while len(active) < args.concurrent and nxt < len(per_agent):
            active.append([nxt, 0])
            nxt += 1
        for a in list(active):
            i, r = a
            order.append(per_agent[i][r])
            a[1] += 1
            if a[1] == len(per_agent[i]):
                active.remove(a)
    return order


def offline_lru(rounds, cap_blocks: int) -> tuple[int, int]:
    core = LruCore(cap_blocks, high=1.0, low=1.0, lease_s=0.0)
    hits = total = 0
    t = 0.0
    for prompt, after in rounds:
        n = 0
        for k in prompt:
            if k not in core:
                break
            n += 1
        for k in prompt[:n]:
            t += 1e-6
            core.hit(k, t)
        hits += n
        total += len(prompt)
        for k in after:
            if k not in core:
                t += 1e-6
                core.wrote(k, 1, t)
                while core.usage > cap_blocks:
                    core.victims(t)         # over: the least recent goes
    return hits, total


def replay(base: Path, rounds, profile, cap_bytes: int | None, args) -> dict:
    d = base / ("capped" if cap_bytes else "unbounded")
    shutil.rmtree(d, ignore_errors=True)
    cap = StoreCapacity(cap_bytes, high=args.high, low=args.low, lease_s=0.0,
                        interval_s=args.upkeep_ms / 1e3) if cap_bytes else None
    synth = None
    hits = total = mismatched = refused = 0
    max_usage = 0
    scans = 0.0
    t0 = time.perf_counter()
    with BlockStore(d, profile, read_workers=2, fsync=False, direct_io="off",
                    capacity=cap) as s:
        synth = SyntheticKV(s.layout)
        on_disk = HEADER_BYTES + s.layout.full_bytes
        bufs = [aligned_bytes(s.layout.full_bytes) for _ in range(4096)]
        wbuf = aligned_bytes(s.layout.full_bytes)
        for i, (prompt, after) in enumerate(rounds):
            n = s.leading(prompt)
            ok = s.read_many(prompt[:n], bufs[:n]) if n else []
            good = 0
            for k, hit, buf in zip(prompt[:n], ok, bufs):
                if not hit:
                    break                     # evicted since the lookup: recomputed
                if synth.verify_full(buf, k) is not None:
                    mismatched += s.layout.full_bytes
                good += 1
            hits += good
            total += len(prompt)
            for k in after[good:]:
                if s.contains(k):
                    continue
                synth.fill_full(wbuf, k)     # the emulated prefill's KV of this block
                try:
                    s.write(k, wbuf)
                except OSError:
                    refused += 1
            if cap_bytes:
                # Usage now: bytes written less bytes evicted (an eviction counts after
                # its unlink: never under the truth); a scan every 50 rounds checks it.
                u = s.stats.writes * on_disk - s.upkeep.stats.evicted_bytes
                max_usage = max(max_usage, u)
                if i % 50 == 0:               # measuring, not the replay's own time
                    t1 = time.perf_counter()
                    scanned = sum(b.nbytes for b in s.walk())
                    max_usage = max(max_usage, scanned)
                    scans += time.perf_counter() - t1
        jct = time.perf_counter() - t0 - scans
        st = s.stats_dict()
    shutil.rmtree(d, ignore_errors=True)
    return {"jct_s": jct, "hits": hits, "prompt_blocks": total, "hit_rate": hits / total,
            "bytes_mismatched": mismatched, "writes_refused": refused,
            "max_usage_bytes": max_usage, "evictions": st.get("evictions", 0),
            "block_bytes_on_disk": on_disk}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=ROOT / ".cache" / "bench",
                    help="where the stores live (a real disk; default .cache/bench)")
    ap.add_argument("--reps", type=int, default=31, help="lookup reps (median)")
    ap.add_argument("--replay-reps", type=int, default=3,
                    help="alternated capped/unbounded replays (median JCT)")
    ap.add_argument("--agents", type=int, default=40)
    ap.add_argument("--concurrent", type=int, default=6)
    ap.add_argument("--context-scale", type=float, default=0.1)
    ap.add_argument("--block-tokens", type=int, default=16)
    ap.add_argument("--cap-fraction", type=float, default=0.5)
    ap.add_argument("--high", type=float, default=0.9)
    ap.add_argument("--low", type=float, default=0.8)
    ap.add_argument("--upkeep-ms", type=float, default=50.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", type=Path, help="write the record here too")
    args = ap.parse_args(argv)
    args.dir.mkdir(parents=True, exist_ok=True)
    base = Path(tempfile.mkdtemp(prefix="store_bound.", dir=args.dir))
    try:
        lk = lookup(base, args)
        profile = small_profile(args.block_tokens)
        rounds = trace_rounds(args, args.block_tokens)
        blocks = len({k for _, after in rounds for k in after})
        on_disk = HEADER_BYTES + profile.layers * profile.kv_bytes_per_token_layer * \
            args.block_tokens
        cap_bytes = int(blocks * on_disk * args.cap_fraction)
        off_hits, off_total = offline_lru(rounds, cap_bytes // on_disk)
        capped, unbounded = [], []
        for i in range(args.replay_reps):          # which goes first alternates too
            for cap in ((cap_bytes, None) if i % 2 == 0 else (None, cap_bytes)):
                (capped if cap else unbounded).append(replay(base, rounds, profile, cap,
                                                             args))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    c = min(capped, key=lambda r: abs(r["jct_s"] - statistics.median(x["jct_s"] for x in capped)))
    u_jct = statistics.median(r["jct_s"] for r in unbounded)
    c_jct = statistics.median(r["jct_s"] for r in capped)
    off_rate = off_hits / off_total
    summary = {
        "lookup_ms_1000_blocks_1m_store": lk["lookup_ms_index"],
        "lookup_speedup_vs_per_block_stat": lk["speedup"],
        "max_usage_over_capacity": max(r["max_usage_bytes"] for r in capped) / cap_bytes,
        "bytes_mismatched": sum(r["bytes_mismatched"] for r in capped + unbounded),
        "hit_rate_vs_offline_lru": statistics.median(r["hit_rate"] for r in capped) / off_rate,
        "eviction_jct_overhead": c_jct / u_jct - 1.0,
    }
    record = {"bench": "store_bound", "lookup": lk,
              "replay": {"rounds": len(rounds), "agents": args.agents,
                         "concurrent": args.concurrent, "working_set_blocks": blocks,
                         "capacity_bytes": cap_bytes, "capacity_blocks": cap_bytes // on_disk,
                         "offline_lru_hit_rate": off_rate,
                         "unbounded_hit_rate": unbounded[0]["hit_rate"],
                         "capped": capped, "unbounded": unbounded},
              "args": {k: str(v) for k, v in vars(args).items()}, "summary": summary}
    rows = [
        ("lookup, 1,000-block prefix, index of 10^6 keys", f"{lk['lookup_ms_index']:.3f}", "ms"),
        ("lookup, same prefix, a stat per block (before)", f"{lk['lookup_ms_per_block_stat']:.3f}",
         "ms"),
        ("filesystem calls per lookup, index / per block",
         f"{lk['fs_calls_per_lookup_index']:.0f} / 1000", "calls"),
        ("lookup speedup", f"{lk['speedup']:.1f}", "x"),
        ("replay rounds / working set", f"{len(rounds)} / {blocks}", "rounds / blocks"),
        ("capacity", f"{cap_bytes / 2**20:.1f} ({cap_bytes // on_disk} blocks)", "MiB"),
        ("hit rate: unbounded / capped / offline LRU",
         f"{unbounded[0]['hit_rate']:.3f} / {c['hit_rate']:.3f} / {off_rate:.3f}", "fraction"),
        ("max usage over capacity (tracked each round; scans)",
         f"{summary['max_usage_over_capacity']:.3f}", "ratio"),
        ("evictions / writes refused", f"{c['evictions']} / {c['writes_refused']}", "blocks"),
        ("JCT capped / unbounded (median)", f"{c_jct:.2f} / {u_jct:.2f}", "s"),
        ("eviction JCT overhead", f"{summary['eviction_jct_overhead'] * 100:+.1f}", "%"),
        ("bytes mismatched", f"{summary['bytes_mismatched']}", "bytes"),
    ]
    w = max(len(r[0]) for r in rows)
    for name, val, unit in rows:
        print(f"{name:<{w}}  {val:>24}  {unit}")
    print(json.dumps(summary, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
