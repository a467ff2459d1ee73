#!/usr/bin/env python3
"""Python calls on the transfer path per request-layer, counted, at 1 and at 64 blocks.

Method. Two TransferEngines in this process (the TCP provider over loopback, the
in-process out-of-band channel), each with a DRAM buffer of Full Block slots in the
--profile's format (ds660b: 61 layers of 42 KB Layer Blocks). A "request" of B blocks
writes every layer of its B blocks from slots 0..B-1 on one side into slots B-1..0 on
the other (reversed, so no two blocks merge into one run: B runs per layer), one layer
after another, each by ``kvio.write_layer`` (the step every read path takes per layer:
placement.run_arrays -> TransferEngine.write -> the data-path thread's posts and
completions). A profile hook on every thread (the event loop's and the engines'
data-path threads) counts, while --requests requests run:
  py_calls   Python function calls ("call" events)
  c_calls    calls from Python into C functions ("c_call": cffi, numpy, builtins)
per request-layer; the data-path threads' idle waits count too (a wait that returns
nothing is one call of each kind), so the figures are upper bounds. The ratio of the
count at 64 blocks to the count at 1 block is the figure: independent of the block count
means <= 1.1. The bench also prints wall and process CPU time per request-layer with
the hook off (TCP loopback moves the bytes: kernel copies count; not a verbs figure), and
the user part of that CPU (the posting, polling and Python; the kernel's copies are
system time). bench/pipeline.py projects verbs posting cost from it.

Prints a table and writes the same record as JSON (--json) with a ``summary``:
python_calls_per_request_layer_64_over_1_blocks (py_calls + c_calls),
py_calls_per_request_layer_{1,64}, c_calls_per_request_layer_{1,64}; with
--more-blocks N, a row for N blocks and python_calls_per_request_layer_N_over_64_blocks
(e.g. 512, a DS 660B request-layer of 32K tokens: 2.6 GB of buffers).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import sys
import threading
import time
from pathlib import Path

from dualpath.buffers.region import PinnedRegion
from dualpath.kv.layout import BlockLayout
from dualpath.kv.placement import KvFormat, KvPlacement
from dualpath.kv.profiles import get_profile
from dualpath.transfer import InProcessChannel, TransferConfig, TransferEngine
from dualpath.transfer.kvio import write_layer
from dualpath.transfer.tcp_provider import TcpProvider


class Counter:
    """A sys.setprofile hook counting call events by kind (any thread)."""

    def __init__(self):
        self.on = False
        self.counts = {"call": 0, "c_call": 0}
        self._lock = threading.Lock()

    def hook(self, frame, event, arg):
        if self.on and event in self.counts:
            with self._lock:
                self.counts[event] += 1

    def reset(self):
        with self._lock:
            self.counts = dict.fromkeys(self.counts, 0)


async def run(args, blocks: int, counter: Counter | None) -> dict:
    layout = BlockLayout.of(get_profile(args.profile))
    fmt = KvFormat.flat(layout)
    slots = max(64, blocks)
    stride = layout.full_bytes
    oob = InProcessChannel()
    config = TransferConfig(timeout_s=30.0)
    a = TransferEngine("a", TcpProvider(), oob, config)
    b = TransferEngine("b", TcpProvider(), oob, config)
    ra = PinnedRegion(slots * stride, lock=False, what="bench source")
    rb = PinnedRegion(slots * stride, lock=False, what="bench target")
    await a.start()
    await b.start()
    try:
        a.register("src", ra.array)
        b.register("dst", rb.array)
        src = KvPlacement.full_blocks(fmt, "src", stride, slots)
        dst = KvPlacement.full_blocks(fmt, "dst", stride, slots)
        su = src.units_of_slots(range(blocks))
        du = dst.units_of_slots(range(blocks - 1, -1, -1))
        tokens = blocks * layout.tokens

        async def request():
            for layer in range(layout.layers):
                await write_layer(a, "b", src, su, dst, du, layer, 0, tokens)

        await request()                       # connect, warm up
        if counter is not None:
            counter.reset()
            counter.on = True
        c0, t0 = time.process_time(), time.perf_counter()
        u0 = resource.getrusage(resource.RUSAGE_SELF).ru_utime
        for _ in range(args.requests):
            await request()
        cpu, wall = time.process_time() - c0, time.perf_counter() - t0
        user = resource.getrusage(resource.RUSAGE_SELF).ru_utime - u0
        if counter is not None:
            counter.on = False
        n = args.requests * layout.layers
        out = {"blocks": blocks, "request_layers": n,
               "wall_us_per_request_layer": 1e6 * wall / n,
               "cpu_us_per_request_layer": 1e6 * cpu / n,
               "user_cpu_us_per_request_layer": 1e6 * user / n,
               "kv_mbytes_per_request_layer": blocks * layout.layer_bytes / 1e6}
        if counter is not None:
            out.update({f"{k}s_per_request_layer": v / n for k, v in counter.counts.items()})
        return out
    finally:
        await a.close()
        await b.close()
        ra.close()
        rb.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="ds660b")
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--more-blocks", type=int, nargs="*", default=[], metavar="N",
                    help="also count these block counts (rows, and each one's count over "
                    "the count at 64 in the summary): is what grows with blocks bounded?")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    if any(n < 1 for n in args.more_blocks):
        ap.error("--more-blocks takes block counts >= 1")
    if args.json:      # before the run, not after it: a missing folder is made
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for blocks in (1, 64, *args.more_blocks):
        counter = Counter()
        sys.setprofile(counter.hook)
        threading.setprofile(counter.hook)    # the engines' data-path threads, started now
        try:
            counted = asyncio.run(run(args, blocks, counter))
        finally:
            sys.setprofile(None)
            threading.setprofile(None)
        timed = asyncio.run(run(args, blocks, None))
        rows.append({**counted, **{k: timed[k] for k in (
            "wall_us_per_request_layer", "cpu_us_per_request_layer",
            "user_cpu_us_per_request_layer")}})
    one, many = rows[:2]
    print(f"transfer path per request-layer ({args.profile}, TCP loopback, "
          f"{args.requests} requests x every layer)")
    print("| blocks | Python calls | C calls | wall (us) | process CPU (us) | KV (MB) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['blocks']} | {r['calls_per_request_layer']:.1f} | "
              f"{r['c_calls_per_request_layer']:.1f} | {r['wall_us_per_request_layer']:.0f} | "
              f"{r['cpu_us_per_request_layer']:.0f} | {r['kv_mbytes_per_request_layer']:.2f} |")

    def total(r):
        return r["calls_per_request_layer"] + r["c_calls_per_request_layer"]
    summary = {"python_calls_per_request_layer_64_over_1_blocks": total(many) / total(one),
               "py_calls_per_request_layer_1": one["calls_per_request_layer"],
               "py_calls_per_request_layer_64": many["calls_per_request_layer"],
               "c_calls_per_request_layer_1": one["c_calls_per_request_layer"],
               "c_calls_per_request_layer_64": many["c_calls_per_request_layer"],
               **{f"python_calls_per_request_layer_{r['blocks']}_over_64_blocks":
                  total(r) / total(many) for r in rows[2:]},
               "targets": {"python_calls_per_request_layer_64_over_1_blocks": "<= 1.1"}}
    print("\nsummary")
    for k, v in summary.items():
        print(f"  {k}: {v}")
    if args.json:
        Path(args.json).write_text(json.dumps({"bench": "transfer_calls", "summary": summary,
                                               "rows": rows, "args": vars(args)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
