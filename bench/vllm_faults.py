#!/usr/bin/env python3
"""Faults at random times during agentic conversations on a vLLM P/D cluster: totals.

Method. A VllmPdCluster (1 prefill node, 2 decode nodes, each beside its own `vllm
serve` with DualPath's connector; vLLM's prefix cache on in each instance, as `up` runs
them, so the blocks an instance holds are neither staged nor sent (docs/vllm.md; off
with --no-prefix-caching: every hit through DualPath); vLLM's CPU build, the tiny model
unless --model; TCP
provider on loopback; lease --lease-ms; a slow storage NIC so that a read is in flight
when a fault strikes) serves --agents conversations at once: each turn's prompt is the
previous context, the tokens generated for it and --append new token ids (seeded), with
the previous context's blocks asked for as a hit; a conversation that would pass the
context starts over. While they run, the main thread strikes faults one after another
with random gaps (uniform in [--gap-min-s, --gap-max-s]), their kinds in random order,
every kind of KINDS once before any comes again: a SIGKILL of the prefill node daemon or of a decode node daemon (started
again), a SIGKILL of the prefill instance or of a decode instance (vLLM's whole process
group; started again, its worker attaches to the running node), a SIGTERM of a node
daemon (a graceful restart), and a SIGSTOP of a node daemon for 1.5-3 leases, then
SIGCONT. Conversations go on until --faults faults have struck, then finish the turn
they are in.

Afterwards every turn is run again on plain vLLM (its prefix cache on, the same model,
greedy) in conversation order, and compared: the same token ids, logprobs within TOL (a
P/D decode instance recomputes the prompt's partial last block: another computation
split than the reference's). Counted: turns whose tokens differ (tokens_mismatched:
the differing positions), turns that failed with an error (requests_failed, each error
printed: a clear error is allowed, a wrong token is not), turns that did not end within
--request-timeout-s (requests_hung), the idle invariant once the conversations are over
(`dualpath ctl check`, waited for: every node's pools whole, nothing fenced, no request
state), and tracebacks or "never retrieved" lines in the daemons' logs
(unhandled_errors).

Prints a table per fault kind and the totals; --json PATH writes the same record, its
"summary" holding faults_injected, kills, turns, requests_failed, requests_hung,
tokens_mismatched, max_logprob_diff, retried_turns (turns that needed a second attempt:
the faults that met a request), max_attempts, idle_invariant_violations,
unhandled_errors, blocks_in_instance_cache and blocks_held_by_decode_instances (the
blocks the instances' prefix caches spared, since each node last started) and wall_s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from dualpath.cluster.faults import stall, unhandled_errors, wait_idle
from dualpath.cluster.vllm_node import ENGINE_ENV, engine_args
from dualpath.cluster.vllm_pd import VllmPdCluster
from dualpath.scheduler.generate import Generator
from dualpath.vllm import models
from dualpath.vllm.driver import EngineProcess

T = 128                      # tokens per block (the connector's block)
TOL = 1e-4                   # tests/vllm/conftest.py TOL: the CPU build's split noise
VOCAB = 49152                # the tiny model's vocabulary (SmolLM2's tokenizer)
MAX_MODEL_LEN = 8192
NODES = ("p0", "d0", "d1")

KINDS = ("sigkill_prefill_daemon", "sigkill_decode_daemon", "sigkill_prefill_instance",
         "sigkill_decode_instance", "sigterm_node", "sigstop_node")
KILLS = {k for k in KINDS if k.startswith("sigkill") or k == "sigterm_node"}


@dataclass
class Turn:
    agent: int
    index: int
    prompt: list[int]
    gen: int
    hit: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    attempt: int = 0
    error: str = ""
    hung: bool = False
    seconds: float = 0.0
    mismatched: int | None = None       # against plain vLLM (None: not compared)
    max_diff: float = 0.0


class Conversations:
    """``agents`` seeded conversations of token ids, driven through the scheduler."""

    def __init__(self, gen: Generator, args):
        self.gen, self.args = gen, args
        self.turns: list[Turn] = []
        self.stop = threading.Event()

    async def agent(self, a: int) -> None:
        rng = random.Random(self.args.seed * 1000 + a)
        context: list[int] = []
        stored = 0
        n = 0
        while not self.stop.is_set():
            append = [rng.randrange(VOCAB) for _ in range(
                self.args.first if not context else self.args.append)]
            if len(context) + len(append) + self.args.gen > MAX_MODEL_LEN:
                context, stored = [], 0          # past the context: a new conversation
                continue
            prompt = context + append
            t = Turn(a, n, prompt, self.args.gen, stored)
            n += 1
            self.turns.append(t)
            t0 = time.monotonic()
            try:
                g = await self.gen.generate(
                    f"vf{self.args.seed}-{a}-{t.index}-{int(time.time())}", prompt, t.gen,
                    hit_tokens=stored, block_tokens=T,
                    timeout_s=self.args.request_timeout_s)
                t.token_ids, t.logprobs, t.attempt = g.token_ids, g.logprobs, g.attempt
            except Exception as e:  # noqa: BLE001 - every failure is counted and printed
                t.error = f"{type(e).__name__}: {e}"
                t.hung = "no result within" in str(e)
            t.seconds = time.monotonic() - t0
            if t.error:
                context, stored = [], 0          # start over: what is stored is unknown
                continue
            context = prompt + t.token_ids
            stored = (len(prompt) + t.gen - 1) // T * T



def strike(pd: VllmPdCluster, kind: str, rng: random.Random, lease_s: float) -> dict:
    """Inject one fault of ``kind`` (and restart what it killed); what was done."""
    d = rng.choice([n for n in NODES if n.startswith("d")])
    t0 = time.monotonic()
    if kind == "sigkill_prefill_daemon":
        victim = "p0"
        pd.kill_node(victim)
        pd.restart_node(victim)
    elif kind == "sigkill_decode_daemon":
        victim = d
        pd.kill_node(victim)
        pd.restart_node(victim)
    elif kind == "sigkill_prefill_instance":
        victim = "vllm-p0"
        pd.restart_instance("p0")
    elif kind == "sigkill_decode_instance":
        victim = f"vllm-{d}"
        pd.restart_instance(d)
    elif kind == "sigterm_node":
        victim = rng.choice(NODES)
        pd.restart_node(victim)                  # SIGTERM, wait, start again
    elif kind == "sigstop_node":
        victim = rng.choice(NODES)
        stall(victim, rng.uniform(1.5, 3.0) * lease_s)(pd.cluster)
    else:
        raise ValueError(kind)
    return {"kind": kind, "victim": victim, "seconds": round(time.monotonic() - t0, 2)}


def compare(turns: list[Turn], model: Path, work: Path) -> None:
    """Each finished turn against plain vLLM's greedy run of its prompt (in order, so the
    reference's prefix cache holds the conversation)."""
    ref = EngineProcess(engine_args(model, prefix_caching=True, max_model_len=MAX_MODEL_LEN),
                        work / "reference.log", env=ENGINE_ENV)
    try:
        for t in sorted(turns, key=lambda t: (t.agent, t.index)):
            if t.error:
                continue
            r = ref.generate(t.prompt, t.gen)
            t.mismatched = (sum(a != b for a, b in zip(t.token_ids, r["token_ids"]))
                            + abs(len(t.token_ids) - len(r["token_ids"])))
            t.max_diff = max((abs(a - b) for a, b in zip(t.logprobs, r["logprobs"])),
                             default=0.0)
            if t.mismatched == 0 and t.max_diff > TOL:
                t.mismatched = 1             # same ids, other numbers: wrong KV
    finally:
        ref.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="model directory (default: the tiny model)")
    ap.add_argument("--faults", type=int, default=12)
    ap.add_argument("--agents", type=int, default=3)
    ap.add_argument("--first", type=int, default=1500, help="first turn's prompt tokens")
    ap.add_argument("--append", type=int, default=300, help="tokens each turn appends")
    ap.add_argument("--gen", type=int, default=16, help="tokens each turn generates")
    ap.add_argument("--lease-ms", type=int, default=2000)
    ap.add_argument("--snic-gbit", type=float, default=0.05)
    ap.add_argument("--gap-min-s", type=float, default=2.0)
    ap.add_argument("--gap-max-s", type=float, default=8.0)
    ap.add_argument("--request-timeout-s", type=float, default=300.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                    help="vLLM's prefix cache in the instances (as `up` runs them)")
    ap.add_argument("--work-dir", default="", help="keep the cluster's logs here")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    if args.faults < 1 or args.agents < 1 or not 0 < args.gap_min_s <= args.gap_max_s:
        ap.error("need --faults >= 1, --agents >= 1 and 0 < --gap-min-s <= --gap-max-s")
    model = Path(args.model) if args.model else models.prepare(models.default_dir())["tiny"]
    lease_s = args.lease_ms / 1000
    rng = random.Random(args.seed)
    work = Path(args.work_dir) if args.work_dir else Path(f"/tmp/vllm-faults-{args.seed}")
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    pd = VllmPdCluster(model, decode_nodes=2, work_dir=str(work / "cluster"),
                       max_model_len=MAX_MODEL_LEN, prefix_caching=args.prefix_caching,
                       settings={"storage": {"snic_gbit_per_s": args.snic_gbit},
                                 "scheduler": {"lease_ms": args.lease_ms}}).start()
    loop = asyncio.new_event_loop()
    faults: list[dict] = []
    try:
        gen = loop.run_until_complete(Generator(pd.cluster.scheduler_address,
                                                pd.cluster.client_tls,
                                                pd.cluster.node_tls).start())
        conv = Conversations(gen, args)
        # The conversations on a worker thread, the faults on this one: a process the
        # cluster restarts dies with the thread that forked it (PR_SET_PDEATHSIG).
        async def agents() -> None:
            await asyncio.gather(*(conv.agent(a) for a in range(args.agents)))
        worker = threading.Thread(target=lambda: loop.run_until_complete(agents()),
                                  daemon=True)
        worker.start()
        order: list[str] = []
        while len(faults) < args.faults and worker.is_alive():
            time.sleep(rng.uniform(args.gap_min_s, args.gap_max_s))
            if not order:
                order = rng.sample(KINDS, len(KINDS))
            kind = order.pop()
            in_flight = sum(1 for t in conv.turns if not t.token_ids and not t.error)
            f = strike(pd, kind, rng, lease_s)
            f["turns_in_flight"] = in_flight
            faults.append(f)
            print(f"fault {len(faults)}/{args.faults}: {f['kind']} of {f['victim']} "
                  f"({f['seconds']} s, {in_flight} turns in flight)", file=sys.stderr)
        conv.stop.set()
        worker.join(args.request_timeout_s + 60)
        stuck = worker.is_alive()
        rc, rec = wait_idle(pd.cluster, 120)
        idle = [] if rc == 0 else (rec.get("violations") or [f"not idle: {rec.get('busy')}"])
        unhandled = unhandled_errors(pd.dir / "logs")
        # What the instances' own prefix caches spared, since each node last started.
        spared = {n: {k: pd.node_metrics(n).get(f"dualpath_node_{k}_total", 0.0)
                      for k in ("hit_blocks_in_instance_cache",
                                "prompt_blocks_held_by_instance")} for n in NODES}
        if not stuck:
            loop.run_until_complete(gen.close())
    finally:
        pd.stop()
        pd.cleanup(keep_logs=True)
    compare(conv.turns, model, work)
    turns = conv.turns
    done = [t for t in turns if not t.error]
    by_kind = Counter(f["kind"] for f in faults)
    summary = {
        "engine": "vLLM (CPU build), real model",
        "model": model.name,
        "prefix_caching": args.prefix_caching,
        "faults_injected": len(faults),
        "kills": sum(1 for f in faults if f["kind"] in KILLS),
        "by_kind": dict(by_kind),
        "turns": len(turns),
        "turns_done": len(done),
        "requests_failed": sum(1 for t in turns if t.error and not t.hung),
        "requests_hung": sum(1 for t in turns if t.hung) + (1 if stuck else 0),
        "tokens_mismatched": sum(t.mismatched or 0 for t in done),
        "max_logprob_diff": max((t.max_diff for t in done), default=0.0),
        "retried_turns": sum(1 for t in done if t.attempt >= 2),
        "max_attempts": max((t.attempt for t in done), default=0),
        "idle_invariant_violations": len(idle),
        # Since each node's last start: hit blocks not staged (prefill node) and prompt
        # blocks not sent (decode nodes) because an instance held them.
        "blocks_in_instance_cache": int(sum(v["hit_blocks_in_instance_cache"]
                                            for v in spared.values())),
        "blocks_held_by_decode_instances": int(sum(v["prompt_blocks_held_by_instance"]
                                                   for v in spared.values())),
        "unhandled_errors": len(unhandled),
        "lease_ms": args.lease_ms,
        "wall_s": round(time.monotonic() - t0, 1),
    }
    print(f"{'fault':<26} {'count':>5} {'max s':>7}")
    for k in KINDS:
        fs = [f for f in faults if f["kind"] == k]
        if fs:
            print(f"{k:<26} {len(fs):>5} {max(f['seconds'] for f in fs):>7.1f}")
    print(f"faults_injected {summary['faults_injected']} (kills {summary['kills']})  "
          f"turns {summary['turns']} (done {summary['turns_done']}, retried "
          f"{summary['retried_turns']}, max attempts {summary['max_attempts']})")
    print(f"tokens_mismatched {summary['tokens_mismatched']}  max_logprob_diff "
          f"{summary['max_logprob_diff']:.2e}  requests_failed {summary['requests_failed']}  "
          f"requests_hung {summary['requests_hung']}  idle_invariant_violations "
          f"{summary['idle_invariant_violations']}  unhandled_errors "
          f"{summary['unhandled_errors']}  wall {summary['wall_s']} s")
    print(f"blocks_in_instance_cache {summary['blocks_in_instance_cache']}  "
          f"blocks_held_by_decode_instances {summary['blocks_held_by_decode_instances']}")
    for t in turns:
        if t.error:
            print(f"  agent {t.agent} turn {t.index}: {t.error[:300]}")
    for v in idle + unhandled:
        print(f"  {v}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"summary": summary, "faults": faults,
                       "turns": [{"agent": t.agent, "turn": t.index, "prompt_tokens":
                                  len(t.prompt), "hit_tokens": t.hit, "attempt": t.attempt,
                                  "error": t.error, "seconds": round(t.seconds, 2),
                                  "mismatched": t.mismatched}
                                 for t in turns],
                       "idle_violations": idle, "unhandled": unhandled}, fh, indent=1)
    bad = (summary["tokens_mismatched"] or summary["requests_hung"]
           or summary["idle_invariant_violations"])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
