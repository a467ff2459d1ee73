#!/usr/bin/env python3
"""Storage bench: BlockStore reads against fio on the same files, plus synthetic KV speed.

Method
  1. Write a file set of Full Blocks (synthetic KV: stands in for the model's output)
     through BlockStore.write (crash-safe path: temp, fsync, rename, dir fsync) on a real
     disk (tmpfs refused: RAM would stand in for the disk).
  2. Read it for --seconds through the engines' path: requests reserve slots in a
     BlockPool, a ReadQueue of depth --workers reads blocks into them with O_DIRECT
     (blocks queued behind a reader's go with it as one batch to one of the store's
     ring readers, taking turns: storage.read_rings = --rings threads, each with an
     io_uring ring fed by the batches it is handed, openat2, storage.read_batch_depth =
     --batch-depth reads in flight per ring), checking
     header and payload hash (XXH3-64); then with the cluster key, as a node reads
     (the block tag checked in the read's pass, in place of the hash); then with the
     payload hash off; with no ring readers (read_rings 0: each batch one C call with a
     ring of its own on a read-pool thread, the path before the ring readers); with
     batches off (read_batch_depth 0: one preadv per block on --workers threads, the
     store's fallback without io_uring); and the store's C read loop alone
     (BlockStore.read_batch, no ReadQueue) into --workers buffers (fio's footprint at
     that depth) and into 4 x --workers (the ReadQueue rows' pool): on a virtual disk
     the host copies each read into guest memory, and a few MiB of buffers that stay in
     its cache read faster than the tens of MiB a node's pool spreads its reads over.
  3. fio reads the SAME files with O_DIRECT, bs = file size (header + payload, rounded
     down to 4096 where it is not a multiple), as psync x numjobs (our model: threads
     doing preadv; each job over its own share of the files, through hard links) and as
     libaio x iodepth over all the files, at depths --workers and 2 x --workers, with
     normal and with 2 MiB huge-page buffers (--mem=shmhuge): fio at its best on this
     host. The bench reserves the huge pages it needs for its run (vm.nr_hugepages, as
     root) and gives them back after; the store's buffers use them too (stated).
     fio also reads one large file of the same size (bs 1 MiB): the disk's own limit,
     stated beside the ratio.
  4. The generator and verifier fill / check Full Blocks in a 64 MiB buffer, one thread.
  Store and fio runs alternate for --rounds rounds; each row keeps its best round (on a
  shared machine noise only slows a run down), the same rule for both sides.
  read_vs_fio_ratio = store read (hash on) / the fastest fio variant on the store's files,
  both in file bytes/s.

Prints a table and, with --json PATH, writes the same record with a "summary" object.
Example: .venv/bin/python bench/storage.py --json out/storage.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import itertools
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from dualpath.buffers.pool import BlockPool, slot_stride
from dualpath.buffers.region import MemlockError, PinnedRegion
from dualpath.kv.layout import BlockLayout
from dualpath.kv.prefix import block_keys
from dualpath.kv.profiles import PROFILES, get_profile
from dualpath.kv.synth import LABEL, SyntheticKV
from dualpath.storage import BlockStore
from dualpath.storage.config import StorageConfig
from dualpath.storage.format import HEADER_BYTES, integrity_tag, payload_hash
from dualpath.storage.read_queue import ReadQueue

REPO = Path(__file__).resolve().parents[1]
RAM_FILESYSTEMS = {"tmpfs", "ramfs"}
KEY = os.urandom(32)        # the file set's cluster key (blocks carry their tag)


def fs_type(path: Path) -> str:
    """The filesystem type of the mount holding ``path`` (from /proc/self/mountinfo)."""
    path = path.resolve()
    best, fstype = "", "unknown"
    with open("/proc/self/mountinfo") as fh:
        for line in fh:
            left, _, right = line.partition(" - ")
            mnt = left.split()[4].replace("\\040", " ")
            inside = path == Path(mnt) or str(path).startswith(mnt.rstrip("/") + "/")
            if inside and len(mnt) >= len(best):
                best, fstype = mnt, right.split()[0]
    return fstype


def pinned(nbytes: int) -> tuple[PinnedRegion, str]:
    try:
        r, how = PinnedRegion(nbytes, what="bench buffers"), "mlocked"
    except MemlockError:
        r, how = PinnedRegion(nbytes, lock=False, what="bench buffers"), "not locked (memlock)"
    return r, how + (", 2 MiB huge pages" if r.huge else ", normal pages")


HUGE_PAGES = Path("/proc/sys/vm/nr_hugepages")


@contextlib.contextmanager
def huge_pages_reserved(pages: int) -> Iterator[int]:
    """Reserve ``pages`` more 2 MiB huge pages for the run (root), give them back after;
    yields how many were added (0 where the host refuses: not root, no memory)."""
    try:
        before = int(HUGE_PAGES.read_text())
        HUGE_PAGES.write_text(str(before + pages))
    except (OSError, ValueError) as e:
        print(f"huge pages: cannot reserve {pages} ({e}); fio and the store use normal pages",
              file=sys.stderr)
        yield 0
        return
    try:
        yield int(HUGE_PAGES.read_text()) - before
    finally:
        HUGE_PAGES.write_text(str(before))


def make_big_file(path: Path, nbytes: int) -> None:
    """One large file of ``nbytes`` (fio lays it out, O_DIRECT): the disk's own limit."""
    subprocess.run(["fio", "--name=lay", "--rw=write", "--bs=1M", "--direct=1",
                    f"--size={nbytes}", f"--filename={path}", "--output-format=json"],
                   check=True, capture_output=True)


def write_set(store: BlockStore, keys: list[bytes]) -> float:
    """Write every block; returns seconds. Blocks are filled before the clock starts."""
    synth = SyntheticKV(store.layout)
    ring = [np.empty(store.layout.full_bytes, np.uint8) for _ in range(8)]
    for i, k in enumerate(keys[:len(ring)]):
        synth.fill_full(ring[i], k)
    # Distinct keys, but only 8 distinct payloads: generating 1 GiB is measured apart.
    t0 = time.perf_counter()
    for i, k in enumerate(keys):
        store.write(k, ring[i % len(ring)], overwrite=True)
    return time.perf_counter() - t0


async def read_for(store: BlockStore, keys: list[bytes], pool: BlockPool, workers: int,
                   seconds: float) -> tuple[int, float]:
    """Read blocks round-robin through a ReadQueue for ``seconds``; (blocks, elapsed)."""
    q = ReadQueue(store, depth=workers)
    per_req = workers
    requests = max(2, pool.capacity // per_req)
    done = 0
    nxt = 0
    deadline = time.perf_counter() + seconds
    t0 = time.perf_counter()

    async def client():
        nonlocal done, nxt
        while time.perf_counter() < deadline:
            batch = [keys[(nxt + i) % len(keys)] for i in range(per_req)]
            nxt += per_req
            with await pool.reserve(per_req) as res:
                result = await q.read(batch, [res.flat(i) for i in range(per_req)])
            if not result.all_hit:
                raise RuntimeError(f"bench read missed: {store.stats}")
            done += per_req

    await asyncio.gather(*(client() for _ in range(requests)))
    elapsed = time.perf_counter() - t0
    await q.close()
    return done, elapsed


def timed_reads(store: BlockStore, keys: list[bytes], pool: BlockPool, args
                ) -> tuple[int, float, float]:
    """:func:`read_for`, and the CPU seconds this process spent meanwhile (every thread:
    the event loop, the store's readers)."""
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    n, sec = asyncio.run(read_for(store, keys, pool, args.workers, args.seconds))
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    return n, sec, (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)


def c_loop_reads(store: BlockStore, keys: list[bytes], region: PinnedRegion, stride: int,
                 nbuf: int, seconds: float) -> tuple[int, float, float]:
    """The store's C read loop alone: ``read_batch`` of ``nbuf`` blocks a call into the
    same ``nbuf`` buffers of ``region`` each time, for ``seconds``; (blocks, elapsed, CPU
    seconds). Its buffer footprint is nbuf blocks, as fio's is its depth's: on a virtual
    disk whose host copies into guest memory, how much memory the reads land in changes
    their speed (a node's reads land all over its DRAM buffer)."""
    full = store.layout.full_bytes
    outs = [region.array[i * stride:i * stride + full] for i in range(nbuf)]
    n = nxt = 0
    c0, t0 = time.process_time(), time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        batch = [keys[(nxt + i) % len(keys)] for i in range(nbuf)]
        nxt += nbuf
        if not all(store.read_batch(batch, outs)):
            raise RuntimeError(f"bench read missed: {store.stats}")
        n += nbuf
    return n, time.perf_counter() - t0, time.process_time() - c0


def link_per_job(store_dir: Path, links: Path, jobs: int) -> int:
    """Hard-link the block files as ``blk.<job>.<n>`` so each fio job reads its own share.

    Links, not copies: fio reads the very same inodes and disk blocks as the store.
    Returns files per job.
    """
    files = sorted(store_dir.rglob("*.kvb"))
    per_job = len(files) // jobs
    links.mkdir()
    for i, f in enumerate(files[:per_job * jobs]):
        os.link(f, links / f"blk.{i % jobs}.{i // jobs}")
    return per_job


def run_fio(store_dir: Path, links: Path, per_job: int, bs: int, file_bytes: int,
            workers: int, seconds: float, engine: str, huge: bool = False,
            big_file: Path | None = None) -> dict:
    """fio reading the store's block files (or ``big_file``), O_DIRECT, queue depth
    ``workers``, from huge-page buffers with ``huge``.

    psync: ``workers`` threads, each over its own share of the files (as our workers
    take distinct blocks). libaio: one job over every file, ``workers`` I/Os in flight.
    """
    if big_file is not None:
        files = [f"--filename={big_file}", "--ioengine=libaio", f"--iodepth={workers}"]
    elif engine == "psync":
        files = [f"--directory={links}", "--filename_format=blk.$jobnum.$filenum",
                 f"--nrfiles={per_job}", f"--filesize={file_bytes}",
                 "--ioengine=psync", f"--numjobs={workers}", "--thread", "--group_reporting"]
    else:
        files = [f"--opendir={store_dir}", "--ioengine=libaio", f"--iodepth={workers}"]
    if huge:
        files.append("--mem=shmhuge")
    cmd = ["fio", "--name=blk", "--rw=read", f"--bs={bs}", "--direct=1", "--time_based",
           f"--runtime={int(seconds * 1000)}ms", "--output-format=json", *files]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    whole = json.loads(out[out.index("{"):])["jobs"][0]
    job = whole["read"]
    seconds = job["runtime"] / 1000.0
    # usr_cpu / sys_cpu: percent of one CPU over the run (group_reporting sums the jobs)
    cpu_s = (whole["usr_cpu"] + whole["sys_cpu"]) / 100.0 * seconds
    return {"nbytes": job["io_bytes"], "seconds": seconds, "ios": job["total_ios"],
            "cpu_s_per_gb": cpu_s / (job["io_bytes"] / 1e9) if job["io_bytes"] else None,
            "cmd": " ".join(cmd)}


def synth_speed(layout: BlockLayout, seconds: float = 0.5) -> tuple[float, float]:
    """(generator, verifier) bytes/s on one thread over a 64 MiB ring of blocks."""
    synth = SyntheticKV(layout)
    n = max(1, (64 << 20) // layout.full_bytes)
    ring = np.zeros((n, layout.full_bytes), np.uint8)     # touched: no page faults timed
    keys = block_keys(np.arange(n * layout.tokens) % 50000, layout.tokens)

    def timed(fn) -> float:
        fn(0)                                             # warm
        reps, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            fn(reps)
            reps += 1
        return reps * ring.nbytes / (time.perf_counter() - t0)

    gen = timed(lambda r: [synth.fill_full(ring[i], k) for i, k in enumerate(keys)])
    for i, k in enumerate(keys):
        synth.fill_full(ring[i], k)

    def verify(_r):
        for i, k in enumerate(keys):
            if synth.verify_full(ring[i], k) is not None:
                raise RuntimeError("verifier rejected what the generator wrote")

    return gen, timed(verify)


def hash_speed(seconds: float = 0.3) -> dict[str, float]:
    """Bytes/s on 1 MiB of the store's payload hash and of zlib.crc32 (the alternative),
    of the block tag (format 2) and of format 1's keyed BLAKE2b."""
    buf = np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8)
    head = bytes(HEADER_BYTES)
    out = {}
    for name, fn in (("xxh3_64", payload_hash), ("zlib.crc32", zlib.crc32),
                     ("block_tag", lambda b: integrity_tag(KEY, head, b)),
                     ("blake2b_keyed", lambda b: hashlib.blake2b(b, key=KEY).digest())):
        fn(buf)
        reps, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            fn(buf)
            reps += 1
        out[name] = reps * buf.nbytes / (time.perf_counter() - t0)
    return out


def measure_reads(work: Path, profile, keys: list[bytes], args, huge: int
                  ) -> tuple[dict, dict]:
    """Interleaved rounds of store and fio reads; per row the best round (noise only slows)."""
    layout = BlockLayout.of(profile)
    file_bytes = HEADER_BYTES + layout.full_bytes
    fio_bs = file_bytes if file_bytes % 4096 == 0 else file_bytes // 4096 * 4096
    best: dict[str, dict] = {}
    meta: dict = {}

    def keep(label: str, nbytes: int, seconds: float, ios: int, **extra) -> None:
        row = {"row": label, "bytes": nbytes, "seconds": seconds, "ios": ios, **extra,
               "gbytes_per_s": nbytes / seconds / 1e9}
        if label not in best or row["gbytes_per_s"] > best[label]["gbytes_per_s"]:
            best[label] = row

    def keep_store(label: str, timed: tuple[int, float, float], **extra) -> None:
        """A store row from (blocks, seconds, CPU seconds)."""
        n, sec, cpu = timed
        keep(label, n * file_bytes, sec, n, cpu_s_per_gb=cpu / (n * file_bytes / 1e9), **extra)

    big = work / "big.file"
    make_big_file(big, len(keys) * file_bytes)
    meta["huge_pages_reserved"] = huge
    with BlockStore(work / "files", profile, read_workers=args.workers,
                    read_batch_depth=args.batch_depth, read_rings=args.rings) as store:
        per_job = link_per_job(store.dir, work / "fio", args.workers)
        region, meta["buffers"] = pinned(args.workers * 4 * slot_stride(layout))
        pool = BlockPool("bench", region.array, layout, region_addr=region.addr)
        mems = (False, True) if huge else (False,)
        threads = BlockStore(work / "files", profile, read_workers=args.workers,
                             read_batch_depth=0)
        per_batch = BlockStore(work / "files", profile, read_workers=args.workers,
                               read_batch_depth=args.batch_depth, read_rings=0)
        keyed = BlockStore(work / "files", profile, read_workers=args.workers,
                           read_batch_depth=args.batch_depth, read_rings=args.rings,
                           integrity_key=KEY)
        meta["store_batched"] = store.batched
        stride = slot_stride(layout)
        for _ in range(args.rounds):
            for verify in (True, False):
                store.verify_checksum = verify
                keep_store("read: store, ReadQueue, O_DIRECT, "
                           + ("header + payload hash" if verify else "header only")
                           + (f", {store.read_rings} io_uring rings x "
                              f"{store.read_batch_depth} in flight" if store.batched
                              else ", worker threads"),
                           timed_reads(store, keys, pool, args))
            store.verify_checksum = True
            for nbuf in (args.workers, 4 * args.workers):
                keep_store(f"read: the store's C read loop alone (read_batch of {nbuf}, "
                           f"{store.read_batch_depth} in flight), header + payload hash, into "
                           f"{nbuf} buffers ({nbuf * stride / 2**20:.0f} MiB)",
                           c_loop_reads(store, keys, region, stride, nbuf, args.seconds),
                           buffers=nbuf)
            keep_store("read: store, ReadQueue, O_DIRECT, header + block tag (cluster key; "
                       f"in place of the payload hash), {keyed.read_rings} io_uring rings x "
                       f"{keyed.read_batch_depth} in flight",
                       timed_reads(keyed, keys, pool, args))
            keep_store(f"read: store, ReadQueue, O_DIRECT, header + payload hash, a ring of "
                       f"{args.batch_depth} per batch on the read pool (read_rings 0)",
                       timed_reads(per_batch, keys, pool, args))
            keep_store(f"read: store, ReadQueue, O_DIRECT, header + payload hash, "
                       f"{args.workers} worker threads (read_batch_depth 0)",
                       timed_reads(threads, keys, pool, args))
            for depth, engine, mem in itertools.product(
                    (args.workers, 2 * args.workers), ("psync", "libaio"), mems):
                r = run_fio(store.dir, work / "fio", per_job, fio_bs, file_bytes, depth,
                            args.seconds, engine, huge=mem)
                how = f"numjobs={depth}" if engine == "psync" else f"iodepth={depth}"
                keep(f"read: fio {engine}, {how}, bs={fio_bs}, direct=1"
                     + (", huge-page buffers" if mem else ""), **r)
            for depth, mem in itertools.product((args.workers, 2 * args.workers), mems):
                r = run_fio(store.dir, work / "fio", per_job, 1 << 20, file_bytes, depth,
                            args.seconds, "libaio", huge=mem, big_file=big)
                keep(f"read: fio libaio, one large file, iodepth={depth}, bs=1M, direct=1"
                     + (", huge-page buffers" if mem else ""), **r)
        meta["o_direct"] = store.direct
        meta["store_stats"] = store.stats_dict()
        threads.close()
        per_batch.close()
        keyed.close()
        del pool
        region.close()
    return best, meta


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", type=Path, default=REPO / ".cache" / "bench",
                    help="where the file set goes (a real disk; default %(default)s)")
    ap.add_argument("--profile", default="demo", choices=sorted(PROFILES))
    ap.add_argument("--block-tokens", type=int, default=64)
    ap.add_argument("--gib", type=float, default=1.0, help="size of the file set (GiB)")
    ap.add_argument("--workers", type=int, default=8, help="store read workers = fio depth")
    ap.add_argument("--batch-depth", type=int, default=StorageConfig.read_batch_depth,
                    help="the store's storage.read_batch_depth (reads in flight per ring; "
                    "default %(default)s as shipped)")
    ap.add_argument("--rings", type=int, default=StorageConfig.read_rings,
                    help="the store's storage.read_rings (default %(default)s as shipped)")
    ap.add_argument("--seconds", type=float, default=2.0, help="per read measurement")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved store/fio rounds")
    ap.add_argument("--allow-tmpfs", action="store_true", help="bench a RAM filesystem anyway")
    ap.add_argument("--keep", action="store_true", help="keep the file set afterwards")
    ap.add_argument("--huge-pages", action=argparse.BooleanOptionalAction, default=True,
                    help="reserve 2 MiB huge pages for the run (root; given back after) so "
                    "fio and the store read into huge-page buffers")
    ap.add_argument("--json", type=Path, help="also write the record as JSON here")
    args = ap.parse_args(argv)

    if shutil.which("fio") is None:
        print("fio is not installed (apt-get install fio): the peer must run in the same run",
              file=sys.stderr)
        return 1
    profile = get_profile(args.profile, args.block_tokens)
    layout = BlockLayout.of(profile)
    args.dir.mkdir(parents=True, exist_ok=True)
    fstype = fs_type(args.dir)
    if fstype in RAM_FILESYSTEMS and not args.allow_tmpfs:
        print(f"{args.dir} is on {fstype}: that measures RAM, not a disk. Use --dir on a real "
              f"disk (or --allow-tmpfs).", file=sys.stderr)
        return 2
    # fio keeps every file of the set open in each of its jobs
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))

    work = Path(tempfile.mkdtemp(prefix="storage-", dir=args.dir))
    file_bytes = HEADER_BYTES + layout.full_bytes
    nblocks = max(args.workers * 4, int(args.gib * (1 << 30)) // file_bytes)
    keys = block_keys(np.arange(nblocks * layout.tokens) % 100_000, layout.tokens)
    try:
        with BlockStore(work / "files", profile, integrity_key=KEY) as store:
            wsec = write_set(store, keys)
        os.sync()
        # The store's buffers and fio's deepest run (2 x workers buffers), with room.
        need = (args.workers * 4 * slot_stride(layout) + 2 * args.workers * (2 << 20)) >> 21
        with huge_pages_reserved(need + 16 if args.huge_pages else 0) as huge:
            reads, meta = measure_reads(work, profile, keys, args, huge)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    gen, ver = synth_speed(layout)
    hashes = hash_speed()

    rows = [{"row": "write: store (temp, fsync, rename, dir fsync)", "bytes": nblocks * file_bytes,
             "seconds": wsec, "ios": nblocks, "gbytes_per_s": nblocks * file_bytes / wsec / 1e9},
            *reads.values()]
    store_row = next(r for r in rows if "payload hash" in r["row"]
                     and "read_batch_depth 0" not in r["row"] and "tag" not in r["row"]
                     and "read_rings 0" not in r["row"])
    per_batch_row = next(r for r in rows if "read_rings 0" in r["row"])
    keyed_row = next(r for r in rows if "block tag" in r["row"])
    threads_row = next(r for r in rows if "read_batch_depth 0" in r["row"])
    bare_row = next(r for r in rows if "header only" in r["row"])
    loop_rows = {r["buffers"]: r for r in rows if "C read loop alone" in r["row"]}
    fio_rows = [r for r in rows if "fio" in r["row"] and "large file" not in r["row"]]
    fio_top = max(fio_rows, key=lambda r: r["gbytes_per_s"])
    fio_best = fio_top["gbytes_per_s"]
    disk = max(r["gbytes_per_s"] for r in rows if "large file" in r["row"])
    summary = {
        "read_vs_fio_ratio": round(store_row["gbytes_per_s"] / fio_best, 3),
        "store_read_gbytes_per_s": round(store_row["gbytes_per_s"], 3),
        "store_read_no_hash_gbytes_per_s": round(bare_row["gbytes_per_s"], 3),
        "store_read_batched": meta["store_batched"],
        "store_read_threads_gbytes_per_s": round(threads_row["gbytes_per_s"], 3),
        "store_read_ring_per_batch_gbytes_per_s": round(per_batch_row["gbytes_per_s"], 3),
        "read_ring_per_batch_vs_fio_ratio": round(per_batch_row["gbytes_per_s"] / fio_best, 3),
        **{f"c_loop_{b}_buffers_vs_fio_ratio": round(r["gbytes_per_s"] / fio_best, 3)
           for b, r in sorted(loop_rows.items())},
        "store_read_cpu_s_per_gb": round(store_row["cpu_s_per_gb"], 3),
        "read_keyed_vs_fio_ratio": round(keyed_row["gbytes_per_s"] / fio_best, 3),
        "store_read_keyed_cpu_s_per_gb": round(keyed_row["cpu_s_per_gb"], 3),
        "store_read_threads_cpu_s_per_gb": round(threads_row["cpu_s_per_gb"], 3),
        "fio_best_cpu_s_per_gb": round(fio_top["cpu_s_per_gb"], 3),
        "fio_read_gbytes_per_s": round(fio_best, 3),
        "fio_best_variant": fio_top["row"],
        "fio_large_file_gbytes_per_s": round(disk, 3),
        "store_read_vs_large_file": round(store_row["gbytes_per_s"] / disk, 3),
        "huge_pages_reserved": meta["huge_pages_reserved"],
        "write_gbytes_per_s": round(rows[0]["gbytes_per_s"], 3),
        "generator_gbytes_per_s": round(gen / 1e9, 3),
        "verifier_gbytes_per_s": round(ver / 1e9, 3),
        "xxh3_gbytes_per_s": round(hashes["xxh3_64"] / 1e9, 3),
        "crc32_gbytes_per_s": round(hashes["zlib.crc32"] / 1e9, 3),
        "block_tag_gbytes_per_s": round(hashes["block_tag"] / 1e9, 3),
        "blake2b_keyed_gbytes_per_s": round(hashes["blake2b_keyed"] / 1e9, 3),
    }
    record = {
        "bench": "storage",
        "method": __doc__.split("Method\n")[1].split("\n\nPrints")[0],
        "command": " ".join([sys.executable, *sys.argv]),
        "config": {"profile": profile.name, "block_tokens": layout.tokens,
                   "full_block_bytes": layout.full_bytes, "file_bytes": file_bytes,
                   "files": nblocks, "workers": args.workers, "seconds": args.seconds,
                   "rounds": args.rounds, "dir": str(args.dir), "fstype": fstype,
                   "o_direct": meta["o_direct"], "buffers": meta["buffers"],
                   "huge_pages_reserved": meta["huge_pages_reserved"],
                   "cpus": os.cpu_count(), "kernel": platform.release(),
                   "load_avg_1m": os.getloadavg()[0]},
        "rows": rows,
        "store_stats": meta["store_stats"],
        "summary": summary,
    }

    print(f"storage bench: profile {profile.name}, {layout.full_bytes}-byte full blocks "
          f"({file_bytes}-byte files) x {nblocks} = {nblocks * file_bytes / 2**30:.2f} GiB on "
          f"{args.dir} ({fstype}); O_DIRECT {'on' if meta['o_direct'] else 'OFF'}; depth "
          f"{args.workers}; best of {args.rounds} interleaved rounds of {args.seconds:g} s")
    w = max(68, *(len(r["row"]) for r in rows))
    print(f"{'measurement':<{w}} {'GB/s':>7} {'blocks/s':>9} {'CPU s/GB':>9}")
    for r in rows:
        cpu = r.get("cpu_s_per_gb")
        print(f"{r['row']:<{w}} {r['gbytes_per_s']:>7.3f} {r['ios'] / r['seconds']:>9.0f} "
              + (f"{cpu:>9.3f}" if cpu is not None else f"{'':>9}"))
    for label, v in ((f"{LABEL} generator, 1 thread", gen),
                     (f"{LABEL} verifier, 1 thread", ver),
                     ("payload hash xxh3_64, 1 thread, 1 MiB", hashes["xxh3_64"]),
                     ("for comparison: zlib.crc32, 1 thread, 1 MiB", hashes["zlib.crc32"]),
                     ("block tag (Poly1305, one-time key), 1 thread, 1 MiB",
                      hashes["block_tag"]),
                     ("for comparison: keyed BLAKE2b (format 1's tag), 1 thread, 1 MiB",
                      hashes["blake2b_keyed"])):
        print(f"{label:<{w}} {v / 1e9:>7.3f}")
    print(f"read_vs_fio_ratio (store with payload hash / best fio on the same files: "
          f"{summary['fio_best_variant']}) = {summary['read_vs_fio_ratio']:.3f}; against "
          f"fio on one large file (the disk's limit, {disk:.3f} GB/s): "
          f"{summary['store_read_vs_large_file']:.3f}; the C read loop alone over "
          + ", ".join(f"{b} buffers {r['gbytes_per_s'] / fio_best:.3f}"
                      for b, r in sorted(loop_rows.items()))
          + f"   (GB = 1e9 bytes of file data; store "
          f"buffers {meta['buffers']}; {meta['huge_pages_reserved']} huge pages reserved for "
          f"the run; load avg {record['config']['load_avg_1m']:.1f} on {os.cpu_count()} CPUs)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
