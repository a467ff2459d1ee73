#!/usr/bin/env python3
"""The data path at line rate: a 1P2D cluster with the storage-NIC limiter off, each node
in a network namespace of its own, against the disk's and the network's limits measured
in the same run, with the CPU it costs.

Method
  1. Network. A bridge in this namespace (10.77.K.1/24) and one namespace per node joined
     to it by a veth pair (node i at 10.77.K.(10+i)). The scheduler, this driver and its
     result sink listen on the bridge's address, each node on its own, so node-to-node
     transfers (TCP provider) cross two veths and the bridge: no shared-memory shortcut.
     A PE writing its own engine memory stays a copy, as it is on a real node.
  2. Limits, measured in this run. The disk: fio, one large file on the store's
     filesystem, libaio iodepth 8, bs 1 MiB, O_DIRECT, huge-page buffers (reserved for
     the run and given back). The network: iperf3, one stream for --net-seconds from the
     first decode node's namespace to the prefill node's (the path the DE-read WRITEs
     take), and over this namespace's loopback.
  3. Throughput. A generated trace (Table 2's 32k row, --context-scale, --agents x
     --rounds) replayed in dualpath mode after a warm-up, every node reading with
     O_DIRECT (storage.direct_io = "on") through the C read loop, with the cluster key
     (blocks tagged and checked), mutual TLS and the scheduler's journal on
     (journal_sync = "full"), leaders fetching every 20 ms (the shipped default); emulated
     GPU --speed-scale times the profile's (compute is not the bottleneck); storage NIC
     unlimited. KV moved = the prompt KV every decode node received (prompt tokens x KV
     bytes per token): the hit read from storage and written across the veths, and the
     computed part. The decode nodes check a --verify-fraction of the requests byte by
     byte (tests check all of them).
  4. CPU. utime + stime of every process (/proc/PID/stat) over the measured replay, by
     kind (scheduler, prefill node, decode nodes; this driver apart), less the emulator's
     own work that each node counts (dualpath_node_emulator_cpu_seconds_total:
     synthesising KV, verifying it), which is reported beside.
  5. Small requests. --small trajectories of two rounds (64 + 1 tokens, then 63 + 1: a
     128-token prompt whose first block is a hit), the same cluster: cluster CPU (all
     processes but this driver) per request, emulator work excluded, less what the idle
     cluster spends in the same time (measured next, --idle-seconds: leaders fetching,
     leases renewing); both are reported.
  6. Python calls per request-layer on the transfer path: bench/transfer_calls.py (its
     count at 64 blocks over its count at 1).
  7. Projection to one node with a 50 GB/s storage NIC on verbs, DS 660B blocks: this
     host's storage-read CPU per GB (the store's C read loop on DS 660B Full Blocks,
     O_DIRECT, tags checked, --proj-blocks blocks) x 50, plus the Layer Blocks per
     second a 50 GB/s stream is cut into x the user CPU per Layer Block of the transfer
     path: bench/transfer_calls.py's user CPU per request-layer at 1 block (the fixed
     cost of one write_layer) spread over the Layer Blocks of a --proj-context-token
     request, plus the growth from 1 to 64 blocks per block (both ends in one process
     over TCP: the kernel's copy, which a NIC does, is system time and left out; the
     target's user work is in, which verbs does not have). The NIC moves the bytes.
     Beside it, the floor of the read's part while every byte is checked: the payload
     hash over 384 MB of blocks not in any cache (a freshly read block is not), x 50.

Needs root (namespaces, huge pages), ip, fio and iperf3 (tools/install-system-packages.sh).
Prints a table and, with --json PATH, writes the same record with a "summary" object.
Example: .venv/bin/python bench/pipeline.py --json .cache/bench/pipeline.json
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from dualpath.buffers.pool import slot_stride
from dualpath.buffers.region import PinnedRegion
from dualpath.cluster.local import LocalCluster
from dualpath.cluster.netns import Namespaces
from dualpath.cluster.replay import ReplayOptions
from dualpath.cluster.run import make_trace, run_modes
from dualpath.kv.layout import BlockLayout
from dualpath.kv.prefix import block_keys
from dualpath.kv.profiles import get_profile
from dualpath.kv.synth import SyntheticKV
from dualpath.storage import BlockStore
from dualpath.storage.store import aligned_bytes
from dualpath.trace.model import Round, Trace, Trajectory

REPO = Path(__file__).resolve().parents[1]
METRICS_PORT = 9464
NIC_GBYTES = 50.0                  # the projection's storage NIC (GB/s)


def _bench(name: str):
    """A sibling bench script as a module (bench/ is not a package)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


storage_bench = _bench("storage")
proc_cpu_s = _bench("scheduler").cpu_seconds      # utime + stime of a process (seconds)


# ------------------------------------------------------------------ network
def iperf3(server_ns: list[str], server_ip: str, client_ns: list[str], seconds: int
           ) -> dict:
    """One iperf3 stream from the client's namespace to the server's: GB/s, and the CPU
    seconds per GB both ends spent (the TCP stack's own cost of moving the bytes). Whole
    seconds: iperf3 reads -t 0 as "forever"."""
    seconds = max(1, int(seconds))
    port = str(5201 + os.getpid() % 1000)
    srv = subprocess.Popen([*server_ns, "iperf3", "-s", "-1", "-B", server_ip, "-p", port],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(50):
            r = subprocess.run([*client_ns, "iperf3", "-c", server_ip, "-p", port, "-t",
                                str(seconds), "-J"], check=False, capture_output=True,
                               text=True, timeout=seconds + 30)
            try:
                got = json.loads(r.stdout)
            except ValueError:
                got = {}
            received = got.get("end", {}).get("sum_received")
            if r.returncode == 0 and received:
                cpu = got["end"].get("cpu_utilization_percent", {})
                cpu_s = (cpu.get("host_total", 0.0) + cpu.get("remote_total", 0.0)) / 100 \
                    * received["seconds"]
                return {"gbytes_per_s": received["bits_per_second"] / 8e9,
                        "cpu_s_per_gb": cpu_s / (received["bytes"] / 1e9)}
            time.sleep(0.1)                 # the server not listening yet
        raise RuntimeError(f"iperf3 failed: {got.get('error') or r.stderr[-400:]}")
    finally:
        srv.kill()
        srv.wait()


def disk_limit(work: Path, gib: float, seconds: float) -> dict:
    """fio on one large file in ``work``: the disk's read limit (GB/s)."""
    big = work / "disk-limit.file"
    storage_bench.make_big_file(big, int(gib * (1 << 30)))
    try:
        with storage_bench.huge_pages_reserved(16 + 8) as huge:
            r = storage_bench.run_fio(work, work, 0, 1 << 20, 0, 8, seconds, "libaio",
                                      huge=bool(huge), big_file=big)
    finally:
        big.unlink(missing_ok=True)
    return {"gbytes_per_s": r["nbytes"] / r["seconds"] / 1e9, "huge_pages": bool(huge),
            "cmd": r["cmd"]}


# ------------------------------------------------------------------ CPU and metrics
def scrape(url: str) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


class Meter:
    """CPU seconds per process kind and the nodes' counters between two snapshots."""

    def __init__(self, cluster: LocalCluster, metrics_urls: dict[str, str]):
        self.cluster, self.urls = cluster, metrics_urls

    def snapshot(self) -> dict:
        c = self.cluster
        cpu = {"scheduler": proc_cpu_s(c.scheduler.pid)}
        for n in c.nodes:
            cpu[n.node_id] = proc_cpu_s(n.proc.pid)
        ru = os.times()
        cpu["driver"] = ru.user + ru.system
        metrics = {nid: scrape(url) for nid, url in self.urls.items()}
        return {"cpu": cpu, "metrics": metrics, "t": time.monotonic()}

    @staticmethod
    def delta(a: dict, b: dict) -> dict:
        cpu = {k: b["cpu"][k] - a["cpu"][k] for k in a["cpu"]}

        def metric(nid: str, name: str, **labels) -> float:
            key = (name, tuple(sorted(labels.items())))
            return b["metrics"][nid].get(key, 0.0) - a["metrics"][nid].get(key, 0.0)

        emu = {nid: {w: metric(nid, "dualpath_node_emulator_cpu_seconds_total", work=w)
                     for w in ("synth", "verify")} for nid in a["metrics"]}
        counters = {nid: {k: metric(nid, f"dualpath_node_{k}_total") for k in (
            "storage_read_bytes", "storage_written_bytes", "kv_verified_bytes",
            "kv_unverified_bytes", "kv_mismatched_bytes")} for nid in a["metrics"]}
        return {"cpu_s": cpu, "emulator_cpu_s": emu, "counters": counters,
                "wall_s": b["t"] - a["t"]}


def by_kind(d: dict, cluster: LocalCluster) -> dict[str, dict[str, float]]:
    """CPU seconds per process kind: all, the emulator's part, and the rest."""
    kinds: dict[str, dict[str, float]] = {}
    for n in cluster.nodes:
        kind = "prefill node" if n.role == "prefill" else "decode nodes"
        k = kinds.setdefault(kind, {"cpu_s": 0.0, "emulator_cpu_s": 0.0})
        k["cpu_s"] += d["cpu_s"][n.node_id]
        k["emulator_cpu_s"] += sum(d["emulator_cpu_s"][n.node_id].values())
    kinds["scheduler"] = {"cpu_s": d["cpu_s"]["scheduler"], "emulator_cpu_s": 0.0}
    for k in kinds.values():
        k["data_path_cpu_s"] = k["cpu_s"] - k["emulator_cpu_s"]
    return kinds


# ------------------------------------------------------------------ workloads
def small_trace(n: int) -> Trace:
    """``n`` two-round trajectories: 64 + 1 tokens, then 63 + 1 (a 128-token prompt whose
    first 64-token block is a hit)."""
    return Trace(tuple(Trajectory(f"small-{os.getpid()}-{i}", (Round(64, 1), Round(63, 1)))
                       for i in range(n)), {"generator": "bench/pipeline.py small"})


def store_read_cost(work: Path, blocks: int, depth: int, keyed: bool) -> dict:
    """CPU seconds per GB of the store's C read loop on DS 660B Full Blocks (O_DIRECT,
    tags checked with ``keyed``), in this process, into a buffer region as a node's
    (huge pages where they can be had): the storage-read part of the projection."""
    profile = get_profile("ds660b")
    layout = BlockLayout.of(profile)
    stride = slot_stride(layout)
    key = os.urandom(32) if keyed else None
    keys = block_keys(np.arange(blocks * layout.tokens) % 100_000, layout.tokens)
    with BlockStore(work / "proj", profile, integrity_key=key, fsync=False,
                    direct_io="on", read_batch_depth=depth) as store, \
            storage_bench.huge_pages_reserved((2 * depth * stride >> 21) + 4), \
            contextlib.closing(PinnedRegion(2 * depth * stride, lock=False,
                                            what="projection buffers")) as region:
        buf = aligned_bytes(layout.full_bytes)
        synth = SyntheticKV(layout)
        for k in keys:
            synth.fill_full(buf, k)
            store.write(k, buf)
        os.sync()
        outs = [region.array[i * stride:i * stride + layout.full_bytes]
                for i in range(2 * depth)]
        c0, t0 = time.process_time(), time.perf_counter()
        ok = 0
        for i in range(0, blocks, 2 * depth):
            batch = keys[i:i + 2 * depth]
            ok += sum(store.read_batch(batch, outs[:len(batch)]))
        cpu, wall = time.process_time() - c0, time.perf_counter() - t0
        batched, huge = store.batched, region.huge
        del outs
    nbytes = ok * layout.full_bytes
    if ok != blocks:
        raise RuntimeError(f"projection read: {ok} of {blocks} blocks verified")
    return {"cpu_s_per_gb": cpu / (nbytes / 1e9), "gbytes_per_s": nbytes / wall / 1e9,
            "blocks": blocks, "full_block_bytes": layout.full_bytes,
            "layer_block_bytes": layout.layer_bytes, "batched": batched, "keyed": keyed,
            "huge_pages": huge}


def cold_hash_cost(full_bytes: int, total_bytes: int = 384 << 20, passes: int = 3) -> dict:
    """CPU seconds per GB of the payload hash (XXH3-64, what an unkeyed read checks)
    over buffers not in any cache: ``total_bytes`` of Full Blocks, far more than a
    last-level cache, hashed in turn, as a read's freshly DMA'd block is. What checking
    every byte once costs in memory bandwidth alone: the floor of the store's read CPU
    while it verifies every block (its hashing in cache runs several times faster)."""
    from dualpath.storage.format import payload_hash

    bufs = [np.random.default_rng(i).integers(0, 255, full_bytes, dtype=np.uint8)
            for i in range(max(2, total_bytes // full_bytes))]
    best = float("inf")
    for _ in range(passes):
        c0 = time.process_time()
        for b in bufs:
            payload_hash(b)
        best = min(best, time.process_time() - c0)
    return {"cpu_s_per_gb": best / (len(bufs) * full_bytes / 1e9),
            "buffers": len(bufs), "buffer_bytes": full_bytes}


def transfer_calls(requests: int) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as fh:
        subprocess.run([sys.executable, str(REPO / "bench" / "transfer_calls.py"),
                        "--requests", str(requests), "--json", fh.name], check=True,
                       capture_output=True)
        return json.loads(Path(fh.name).read_text())


@contextlib.contextmanager
def netns_cluster(args, work: Path) -> Iterator[tuple[LocalCluster, Namespaces, dict]]:
    node_ids = ["p0", "d0", "d1"]
    nets = Namespaces(node_ids)
    try:
        node_settings = {n: {"engine": {"control_listen": f"{nets.ip[n]}:0",
                                        "metrics_listen": f"{nets.ip[n]}:{METRICS_PORT}"},
                             "transfer": {"tcp_listen": nets.ip[n]}} for n in node_ids}
        settings = {
            "transport": {"kind": "tcp"},
            "storage": {"snic_gbit_per_s": 0.0, "direct_io": "on", "fsync": False,
                        "dir": str(work / "kv")},
            "engine": {"speed_scale": args.speed_scale,
                       "verify_fraction": args.verify_fraction,
                       "prefill_hbm_mib": 1024, "decode_hbm_mib": 1024},
            "buffers": {"pe_buffer_mib": 1024, "de_buffer_mib": 1024},
            # The shipped fetch period (the local cluster's 5 ms is for test latency).
            "scheduler": {"journal_sync": "full", "fetch_interval_ms": 20},
        }
        cluster = LocalCluster(1, 2, settings=settings, host=nets.bridge_ip,
                               node_settings=node_settings, tls_ips=tuple(nets.ip.values()),
                               node_launchers={n: nets.launcher(n) for n in node_ids})
        urls = {n: f"http://{nets.ip[n]}:{METRICS_PORT}/metrics" for n in node_ids}
        with cluster:
            try:
                yield cluster, nets, urls
            finally:
                cluster.stop()
                cluster.cleanup()
    finally:
        nets.close()


def replay_modes(cluster: LocalCluster, nets: Namespaces, trace: Trace, seed: int) -> dict:
    report, _ = run_modes(cluster.scheduler_address, cluster.node_ids(), 1, trace,
                          ("dualpath",), ReplayOptions(progress=False, seed=seed,
                                                       sink_listen=f"{nets.bridge_ip}:0"),
                          snic_gbit_per_s=0.0, tls_config=cluster.client_tls,
                          node_tls=cluster.node_tls, node_addresses=cluster.addresses())
    return report


# ------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, metavar="PATH")
    ap.add_argument("--dir", type=Path, default=REPO / ".cache" / "bench",
                    help="where the store and fio's file go (a real disk)")
    ap.add_argument("--agents", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--context-scale", type=float, default=0.25)
    ap.add_argument("--speed-scale", type=float, default=1000.0)
    ap.add_argument("--verify-fraction", type=float, default=0.1)
    ap.add_argument("--small", type=int, default=100, help="small-request trajectories")
    ap.add_argument("--idle-seconds", type=float, default=3.0,
                    help="the idle cluster's CPU is measured this long")
    ap.add_argument("--net-seconds", type=int, default=3, help="per iperf3 run (>= 1)")
    ap.add_argument("--disk-gib", type=float, default=2.0)
    ap.add_argument("--proj-blocks", type=int, default=300,
                    help="DS 660B Full Blocks the projection's store read measures")
    ap.add_argument("--proj-context", type=int, default=32768,
                    help="hit tokens per request in the projection (its Layer Blocks per "
                    "request-layer spread the fixed cost of one)")
    ap.add_argument("--calls-requests", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if not 0.0 <= args.verify_fraction <= 1.0 or min(args.agents, args.rounds, args.small,
                                                      args.proj_blocks, args.proj_context) < 1:
        ap.error("--verify-fraction must be in [0, 1]; --agents, --rounds, --small, "
                 "--proj-blocks and --proj-context at least 1")
    if os.geteuid() != 0:
        print("bench/pipeline.py needs root (network namespaces, huge pages)", file=sys.stderr)
        return 2
    missing = [t for t in ("ip", "fio", "iperf3") if shutil.which(t) is None]
    if missing:
        print(f"missing tools: {', '.join(missing)} (tools/install-system-packages.sh)",
              file=sys.stderr)
        return 2
    args.dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="pipeline-", dir=args.dir))
    prof = get_profile("demo")
    record: dict = {"bench": "pipeline", "command": " ".join([sys.executable, *sys.argv]),
                    "args": {k: str(v) for k, v in vars(args).items()},
                    "cpus": os.cpu_count(), "load_avg_1m_start": os.getloadavg()[0]}
    try:
        print("limits: the disk (fio) ...", flush=True)
        record["disk"] = disk_limit(work, args.disk_gib, 3.0)
        with netns_cluster(args, work) as (cluster, nets, urls):
            print("limits: the network (iperf3) ...", flush=True)
            record["net"] = {
                "veth": iperf3(nets.launcher("p0"), nets.ip["p0"], nets.launcher("d0"),
                               args.net_seconds),
                "loopback": iperf3([], "127.0.0.1", [], args.net_seconds)}
            record["nodes"] = {"scheduler": cluster.scheduler_address,
                               **cluster.addresses(), "namespaces": nets.ns}
            meter = Meter(cluster, urls)
            trace = make_trace(args.agents, context_scale=args.context_scale,
                               max_rounds=args.rounds, seed=args.seed)
            print(f"throughput: {args.agents} agents x {args.rounds} rounds ...", flush=True)
            # A warm-up (2 other agents, 2 rounds: first connections, handshakes, reads)
            # on its own, then the measured replay, which the meter brackets.
            replay_modes(cluster, nets, make_trace(2, context_scale=args.context_scale,
                                                   max_rounds=2, seed=args.seed + 1000),
                         args.seed)
            a = meter.snapshot()
            report = replay_modes(cluster, nets, trace, args.seed)
            b = meter.snapshot()
            thr = Meter.delta(a, b)
            dp = report["modes"]["dualpath"]
            print(f"small requests: {args.small} x 2 rounds ...", flush=True)
            a = meter.snapshot()
            small = replay_modes(cluster, nets, small_trace(args.small), args.seed)
            b = meter.snapshot()
            sm = Meter.delta(a, b)
            print(f"idle: {args.idle_seconds:g} s ...", flush=True)
            a = meter.snapshot()
            time.sleep(args.idle_seconds)
            idle = Meter.delta(a, meter.snapshot())
        print("projection: DS 660B store reads; transfer-path calls ...", flush=True)
        proj_reads = {keyed: store_read_cost(work, args.proj_blocks, 8, keyed)
                      for keyed in (True, False)}
        cold = cold_hash_cost(get_profile("ds660b").full_block_bytes)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    calls = transfer_calls(args.calls_requests)

    # ---- throughput figures
    kv_bytes = dp["prompt_tokens"] * prof.kv_bytes_per_token
    kv_gb = kv_bytes / 1e9
    jct = dp["jct_s"]
    kinds = by_kind(thr, cluster)
    cluster_cpu = sum(k["cpu_s"] for k in kinds.values())
    emulator_cpu = sum(k["emulator_cpu_s"] for k in kinds.values())
    verified = sum(c["kv_verified_bytes"] for c in thr["counters"].values())
    unverified = sum(c["kv_unverified_bytes"] for c in thr["counters"].values())
    mismatched = sum(c["kv_mismatched_bytes"] for c in thr["counters"].values())
    read = sum(c["storage_read_bytes"] for c in thr["counters"].values())
    kv_rate = kv_gb / jct
    disk = record["disk"]["gbytes_per_s"]
    # ---- small requests
    # The cluster is not quiet when idle (leaders fetch every few ms, leases renew): that
    # rate over the phase's wall time is subtracted to give the CPU the requests cost.
    small_kinds = by_kind(sm, cluster)
    idle_kinds = by_kind(idle, cluster)
    for kind, k in small_kinds.items():
        k["idle_cpu_s"] = idle_kinds[kind]["cpu_s"] / idle["wall_s"] * sm["wall_s"]
        k["request_cpu_s"] = k["data_path_cpu_s"] - k["idle_cpu_s"]
    small_n = small["modes"]["dualpath"]["requests"]
    small_cpu_ms = 1e3 * sum(k["request_cpu_s"] for k in small_kinds.values()) / small_n
    small_cpu_ms_all = 1e3 * sum(k["data_path_cpu_s"] for k in small_kinds.values()) / small_n
    idle_cores = sum(k["cpu_s"] for k in idle_kinds.values()) / idle["wall_s"]
    # ---- projection
    # Posting/polling per Layer Block: a fixed part per request-layer (the event loop's
    # and the data-path thread's work for one write_layer) and a part per block, from
    # the user CPU at 1 and at 64 blocks; the fixed part spread over the blocks of a
    # request-layer of --proj-context tokens.
    one, many = (next(r for r in calls["rows"] if r["blocks"] == b) for b in (1, 64))
    fixed_us = one["user_cpu_us_per_request_layer"]
    per_block_us = max(0.0, (many["user_cpu_us_per_request_layer"] - fixed_us) / 63)
    proj_read = proj_reads[True]
    lb_bytes = proj_read["layer_block_bytes"]
    blocks_per_rl = max(1, args.proj_context // get_profile("ds660b").block_tokens)
    user_us_per_lb = per_block_us + fixed_us / blocks_per_rl
    posting = NIC_GBYTES * 1e9 / lb_bytes * user_us_per_lb * 1e-6
    proj = {"storage_read_cores": NIC_GBYTES * proj_read["cpu_s_per_gb"],
            "storage_read_cores_no_key": NIC_GBYTES * proj_reads[False]["cpu_s_per_gb"],
            "posting_cores": posting}
    proj["total_cores"] = proj["storage_read_cores"] + posting
    # Of the unkeyed read's CPU, what one hash pass over uncached memory costs by itself.
    proj["verify_floor_cores"] = NIC_GBYTES * cold["cpu_s_per_gb"]
    proj["total_cores_no_key"] = proj["storage_read_cores_no_key"] + posting

    summary = {
        "kv_gbytes_per_s": round(kv_rate, 3),
        "disk_limit_gbytes_per_s": round(disk, 3),
        "kv_gbytes_per_s_vs_disk_limit": round(kv_rate / disk, 3),
        "storage_read_gbytes_per_s": round(read / 1e9 / jct, 3),
        "veth_gbytes_per_s": round(record["net"]["veth"]["gbytes_per_s"], 3),
        "veth_tcp_cpu_s_per_gb": round(record["net"]["veth"]["cpu_s_per_gb"], 3),
        "loopback_gbytes_per_s": round(record["net"]["loopback"]["gbytes_per_s"], 3),
        "cluster_cpu_s_per_gb": round((cluster_cpu - emulator_cpu) / kv_gb, 3),
        "cluster_cpu_s_per_gb_with_emulator": round(cluster_cpu / kv_gb, 3),
        "emulator_cpu_s_per_gb": round(emulator_cpu / kv_gb, 3),
        "verified_fraction_of_kv": round(verified / max(1, verified + unverified), 3),
        "kv_bytes_mismatched": int(mismatched),
        "cpu_ms_per_small_request": round(small_cpu_ms, 3),
        "cpu_ms_per_small_request_with_idle": round(small_cpu_ms_all, 3),
        "idle_cluster_cores": round(idle_cores, 3),
        "projected_cores_50gbps": round(proj["total_cores"], 2),
        "projected_cores_50gbps_no_key": round(proj["total_cores_no_key"], 2),
        "projected_verify_floor_cores_50gbps": round(proj["verify_floor_cores"], 2),
        "python_calls_per_request_layer_64_over_1_blocks": round(
            calls["summary"]["python_calls_per_request_layer_64_over_1_blocks"], 3),
        "targets": {"kv_gbytes_per_s_vs_disk_limit": ">= 0.6", "cluster_cpu_s_per_gb": "<= 0.8",
                    "cpu_ms_per_small_request": "<= 3", "projected_cores_50gbps": "<= 4",
                    "python_calls_per_request_layer_64_over_1_blocks": "<= 1.1"},
    }
    record.update({
        "throughput": {"kv_bytes": kv_bytes, "jct_s": jct, "requests": dp["requests"],
                       "storage_read_bytes": read, "kv_verified_bytes": verified,
                       "kv_unverified_bytes": unverified, "cpu_by_kind": kinds,
                       "driver_cpu_s": thr["cpu_s"]["driver"], "per_node": thr,
                       "report": report},
        "small": {"requests": small_n, "cpu_by_kind": small_kinds, "wall_s": sm["wall_s"],
                  "idle_cpu_by_kind": idle_kinds, "idle_wall_s": idle["wall_s"],
                  "driver_cpu_s": sm["cpu_s"]["driver"], "jct_s": small["modes"][
                      "dualpath"]["jct_s"]},
        "projection": {**proj, "store_read": proj_read, "store_read_no_key": proj_reads[False],
                       "cold_hash": cold,
                       "user_cpu_us_per_request_layer_fixed": fixed_us,
                       "user_cpu_us_per_layer_block_marginal": per_block_us,
                       "layer_blocks_per_request_layer": blocks_per_rl,
                       "user_cpu_us_per_layer_block": user_us_per_lb, "nic_gbytes_per_s":
                       NIC_GBYTES},
        "transfer_calls": calls, "summary": summary,
        "load_avg_1m_end": os.getloadavg()[0]})

    print(f"\npipeline: 1P2D, nodes in network namespaces, storage NIC unlimited, TCP "
          f"provider across veths; model execution emulated (speed x{args.speed_scale:g}); "
          f"{dp['requests']} requests, {kv_gb:.2f} GB of prompt KV, "
          f"{summary['verified_fraction_of_kv']:.0%} of it verified byte by byte")
    print(f"{'limit / throughput':<52} {'GB/s':>8}")
    for label, v in (("disk: fio, one large file, libaio x8, 1 MiB, huge pages", disk),
                     ("network: iperf3 d0 -> p0 across the veths", summary["veth_gbytes_per_s"]),
                     ("   (its CPU, both ends, s/GB)", summary["veth_tcp_cpu_s_per_gb"]),
                     ("network: iperf3 over loopback", summary["loopback_gbytes_per_s"]),
                     ("cluster: prompt KV delivered to the decode nodes", kv_rate),
                     ("cluster: storage reads (all nodes)", summary["storage_read_gbytes_per_s"])):
        print(f"{label:<52} {v:>8.3f}")
    print(f"\n{'CPU by process kind (throughput run)':<40} {'CPU s':>8} {'emulator s':>11} "
          f"{'data path s/GB':>15}")
    for kind, k in kinds.items():
        print(f"{kind:<40} {k['cpu_s']:>8.2f} {k['emulator_cpu_s']:>11.2f} "
              f"{k['data_path_cpu_s'] / kv_gb:>15.3f}")
    print(f"{'driver (replay client, not counted)':<40} {thr['cpu_s']['driver']:>8.2f}")
    print(f"\nsmall requests: {small_n} requests in {sm['wall_s']:.1f} s, cluster CPU per "
          "request beyond the idle cluster's (ms): "
          + ", ".join(f"{kind} {1e3 * k['request_cpu_s'] / small_n:.2f}"
                      for kind, k in small_kinds.items())
          + f"; total {small_cpu_ms:.2f} ({small_cpu_ms_all:.2f} with the idle cluster's "
          f"{idle_cores:.2f} cores over the phase)")
    print(f"projection, one node at {NIC_GBYTES:g} GB/s (DS 660B): storage reads "
          f"{proj_read['cpu_s_per_gb']:.3f} CPU s/GB x {NIC_GBYTES:g} = "
          f"{proj['storage_read_cores']:.2f} cores; {NIC_GBYTES * 1e9 / lb_bytes / 1e6:.2f} M "
          f"Layer Blocks/s x {user_us_per_lb:.3f} us = {proj['posting_cores']:.2f} cores; "
          f"total {proj['total_cores']:.2f} (without a cluster key: storage reads "
          f"{proj_reads[False]['cpu_s_per_gb']:.3f} CPU s/GB, total "
          f"{proj['total_cores_no_key']:.2f}); of that, hashing every byte once from "
          f"uncached memory alone: {cold['cpu_s_per_gb']:.3f} CPU s/GB = "
          f"{proj['verify_floor_cores']:.2f} cores")
    print("\nsummary")
    for k, v in summary.items():
        if k != "targets":
            print(f"  {k:<50} {v}" + (f"   (target {summary['targets'][k]})"
                                      if k in summary["targets"] else ""))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=1, default=str) + "\n")
    return 0 if mismatched == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
