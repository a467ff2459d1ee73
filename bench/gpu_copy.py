#!/usr/bin/env python3
"""GPU copy bench: per-block cudaMemcpyAsync submission cost for many small blocks.

Method
  The paper's baseline for moving KV blocks between host and GPU is one cudaMemcpyAsync
  per block at 5-7 us of submission each, against ~1 us to post an RDMA WRITE (and less
  with doorbell batching). For each block size, --blocks blocks of pinned host memory
  (cudaHostAlloc) are copied host->device (and device->host) into one cudaMalloc'd
  buffer, one cudaMemcpyAsync per block on one non-blocking stream:
    submit us/block = time of the loop of cudaMemcpyAsync calls / blocks (the call
                      returns once the copy is queued; the loop includes cupy's thin
                      Cython wrapper, about what any Python caller pays);
    total us/block  = time from the first call until the stream is synchronised / blocks;
    GB/s            = bytes / total time (GB = 1e9 bytes).
  Each row keeps the best of --rounds rounds after one warm-up round. A row "one copy"
  copies the same bytes with a single call, for the bandwidth ceiling.
  With an RDMA device and --rdma, the same blocks also go host->GPU as RDMA WRITEs
  through the local NIC (dualpath.gpu.LocalRdmaCopier), reporting post us/WRITE.

Prints a table and, with --json PATH, writes the same record with a "summary" object
(submit_us_per_block by size, h2d). Needs cupy and a CUDA GPU: without them it says what
is missing and exits 1.
Example: .venv/bin/python bench/gpu_copy.py --json out/gpu_copy.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dualpath import gpu
from dualpath._version import __version__

KIB = 1 << 10
H2D, D2H = 1, 2     # cudaMemcpyKind


def parse_size(text: str) -> int:
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": KIB, "M": KIB * KIB}.get(t[-1:], 1)
    return int(t[:-1] if mult > 1 else t) * mult


def measure(cupy, dst: int, src: int, size: int, blocks: int, kind: int, stream,
            rounds: int) -> dict:
    memcpy = cupy.cuda.runtime.memcpyAsync
    s = stream.ptr
    best = None
    for r in range(rounds + 1):     # round 0 is the warm-up
        stream.synchronize()
        t0 = time.perf_counter_ns()
        for i in range(blocks):
            off = i * size
            memcpy(dst + off, src + off, size, kind, s)
        t1 = time.perf_counter_ns()
        stream.synchronize()
        t2 = time.perf_counter_ns()
        if r and (best is None or t2 - t0 < best[1]):
            best = (t1 - t0, t2 - t0)
    submit, total = best
    return {"submit_us_per_block": submit / 1e3 / blocks,
            "total_us_per_block": total / 1e3 / blocks,
            "gbps": size * blocks / (total / 1e9) / 1e9}


def one_copy(cupy, dst: int, src: int, nbytes: int, kind: int, stream, rounds: int) -> float:
    best = None
    for r in range(rounds + 1):
        stream.synchronize()
        t0 = time.perf_counter_ns()
        cupy.cuda.runtime.memcpyAsync(dst, src, nbytes, kind, stream.ptr)
        stream.synchronize()
        t = time.perf_counter_ns() - t0
        if r and (best is None or t < best):
            best = t
    return nbytes / (best / 1e9) / 1e9


def rdma_rows(sizes: list[int], blocks: int, device: str | None) -> list[dict]:
    """Host->GPU as RDMA WRITEs through the local NIC: post us/WRITE and GB/s."""
    from dualpath import verbs

    if not verbs.list_devices():
        return []
    rows = []
    with gpu.LocalRdmaCopier(device) as copier:
        for size in sizes:
            with gpu.GpuBuffer(size * blocks) as buf:
                host = bytearray(size * blocks)
                hmr, gmr = copier.register_host(host), copier.register_gpu(buf)
                items = [(i * size, i * size, size) for i in range(blocks)]
                t0 = time.perf_counter_ns()
                copier.copy(hmr, gmr, items)
                t = time.perf_counter_ns() - t0
                rows.append({"size": size, "blocks": blocks, "mr": gmr.kind,
                             "us_per_write": t / 1e3 / blocks,
                             "gbps": size * blocks / (t / 1e9) / 1e9})
                gmr.close()
                hmr.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="4K,16K,64K,256K",
                    help="block sizes, comma-separated (default 4K,16K,64K,256K)")
    ap.add_argument("--blocks", type=int, default=4096, help="blocks per round (4096)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds per row, best kept (5)")
    ap.add_argument("--device", type=int, default=0, help="CUDA device (0)")
    ap.add_argument("--rdma", action="store_true",
                    help="also copy host->GPU as RDMA WRITEs when an RDMA device exists")
    ap.add_argument("--rdma-device", default=None, help="RDMA device for --rdma")
    ap.add_argument("--json", metavar="PATH", help="write the record as JSON here")
    args = ap.parse_args(argv)
    if args.json:      # before the run, not after it: a missing folder is made
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    if args.blocks < 1 or args.rounds < 1 or min(sizes) < 1:
        ap.error("--blocks, --rounds and every size must be >= 1")

    p = gpu.probe()
    if not p.usable:
        print(f"bench/gpu_copy.py: no GPU here, nothing measured: {p.reason}", file=sys.stderr)
        return 1
    import cupy

    rows = []
    with cupy.cuda.Device(args.device):
        stream = cupy.cuda.Stream(non_blocking=True)
        span = max(sizes) * args.blocks
        host = cupy.cuda.alloc_pinned_memory(span)
        dev = cupy.cuda.Memory(span)
        h, d = host.ptr, int(dev.ptr)
        for size in sizes:
            for name, kind, dst, src in (("h2d", H2D, d, h), ("d2h", D2H, h, d)):
                r = measure(cupy, dst, src, size, args.blocks, kind, stream, args.rounds)
                rows.append({"direction": name, "size": size, "blocks": args.blocks, **r,
                             "one_copy_gbps": one_copy(cupy, dst, src, size * args.blocks,
                                                       kind, stream, args.rounds)})
        props = cupy.cuda.runtime.getDeviceProperties(args.device)
    rdma = rdma_rows(sizes, min(args.blocks, 256), args.rdma_device) if args.rdma else []

    print(f"{'dir':<5}{'block B':>9}{'blocks':>8}{'submit us/blk':>15}{'total us/blk':>14}"
          f"{'GB/s':>8}{'one copy GB/s':>15}")
    for r in rows:
        print(f"{r['direction']:<5}{r['size']:>9}{r['blocks']:>8}"
              f"{r['submit_us_per_block']:>15.2f}{r['total_us_per_block']:>14.2f}"
              f"{r['gbps']:>8.2f}{r['one_copy_gbps']:>15.2f}")
    for r in rdma:
        print(f"rdma h2d {r['size']:>9} B x {r['blocks']}: {r['us_per_write']:.2f} us/WRITE "
              f"(post + completion), {r['gbps']:.2f} GB/s, GPU MR by {r['mr']}")
    summary = {
        "submit_us_per_block_h2d": {str(r["size"]): round(r["submit_us_per_block"], 3)
                                    for r in rows if r["direction"] == "h2d"},
        "submit_us_per_block_d2h": {str(r["size"]): round(r["submit_us_per_block"], 3)
                                    for r in rows if r["direction"] == "d2h"},
        "rdma_us_per_write_h2d": {str(r["size"]): round(r["us_per_write"], 3) for r in rdma}
        or None,
    }
    print("summary: " + json.dumps(summary))
    name = props["name"]
    record = {
        "bench": "gpu_copy", "version": __version__,
        "argv": sys.argv[1:] if argv is None else argv,
        "host": {"node": platform.node(), "cpus": os.cpu_count(), "kernel": platform.release(),
                 "gpu": name.decode() if isinstance(name, bytes) else name,
                 "cupy": cupy.__version__, "probe": p.reason},
        "method": __doc__.split("\n\n")[1].replace("\n", " "),
        "units": {"submit_us_per_block": "us in the cudaMemcpyAsync loop per block",
                  "gbps": "1e9 bytes/s"},
        "rows": rows, "rdma": rdma, "summary": summary,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
