"""Data-plane bandwidth, message rate and submission cost, perftest style.

Method. One initiator connection writes into one target region (the TCP provider's
target is a second engine in this process, served by its C server thread over
loopback). For each message size and post-list batch size, the loop keeps up to
``--depth`` WRITEs outstanding, posting ``batch`` per post call (one gathered send = one
doorbell) and signalling every ``--signal-every``-th WRITE (and the last of each post),
like ``ib_write_bw --post_list``. Messages cycle over up to 64 slots of the buffers.
Bandwidth is bytes over the time from the first post to the last completion, in MB/s of
2^20 bytes (the unit perftest and ucx_perftest print); message rate in millions of
WRITEs per second; submission cost is the time inside the post call divided by the
WRITEs it posted (µs, including the cffi call; for TCP it also includes the kernel's copy
of what the socket accepts at once, so large messages cost more per WRITE).

Peers run in the same invocation at the same sizes, each next to ours so load drift on
the host hits both alike: ``--transport tcp --vs-ucx`` runs ``ucx_perftest -t
ucp_put_bw`` over TCP on loopback (UCX_TLS=tcp,self, UCX_NET_DEVICES=lo; server and
client processes on 127.0.0.1). The verbs rig and ``--vs-perftest`` (``ib_write_bw``)
plug into RIGS and PEERS below.

Prints a fixed table and, with ``--json PATH``, writes the same record with a top-level
``summary``: tcp_vs_ucx_min_ratio_ge_64k (ours at the smallest batch run, one WRITE per
post like one ucp_put per call, over ucx at each size >= 64 KiB), the same at our best
batch, batch32_vs_batch1_msg_rate_4k, and the verbs figures (null when not run).

Extending: a rig is ``RIGS[name](args, max_size)`` with ``run(size, batch, iters) ->
Point``, ``verify(size)``, ``close()`` and ``description``; a peer is
``PEERS[flag](size, batches, iters, args) -> [PeerPoint]`` (batch None when the tool has
no post list), enabled by ``--vs-<flag>``; summarise() reads both.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dualpath import clock
from dualpath._version import __version__

KIB, MIB = 1 << 10, 1 << 20
DEFAULT_SIZES = "4K,16K,64K,256K,1M,4M"
DEFAULT_BATCHES = "1,8,32,64"
SLOT_BYTES = 64 * MIB       # per buffer: slots = min(64, SLOT_BYTES // size)


def parse_size(text: str) -> int:
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": KIB, "M": MIB, "G": 1 << 30}.get(t[-1:], 1)
    return int(t[:-1] if mult > 1 else t) * mult


def human(n: int) -> str:
    for unit, m in (("M", MIB), ("K", KIB)):
        if n >= m and n % m == 0:
            return f"{n // m}{unit}"
    return str(n)


@dataclass
class Point:
    """One measured (size, batch) of our data path."""

    transport: str
    size: int
    batch: int
    iters: int
    seconds: float
    bw_mbps: float          # MB/s, MB = 2^20 bytes
    msg_rate_mpps: float
    post_us_per_wr: float
    posts: int


@dataclass
class PeerPoint:
    """One measured size (and post-list batch, where the tool has one) of a reference tool."""

    tool: str
    size: int
    batch: int | None
    iters: int
    bw_mbps: float
    msg_rate_mpps: float
    command: str


def iterations(size: int, target_bytes: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, target_bytes // size))


def bw_loop(transport: str, post, wait, size: int, batch: int, iters: int, depth: int,
            slots: int) -> Point:
    """The perftest-style loop over two callables of a rig:
    post(slot, count) -> WRITEs posted (count <= credits); wait(block) -> WRITEs retired."""
    posted = retired = posts = 0
    post_ns = 0
    now_ns = clock.now_ns
    t0 = now_ns()
    while retired < iters:
        room = min(depth - (posted - retired), iters - posted, batch)
        if room >= batch or (room > 0 and posted + room == iters):
            a = now_ns()
            n = post(posted % slots, room)
            post_ns += now_ns() - a
            posted += n
            posts += 1
            retired += wait(False)
        else:
            retired += wait(True)
    seconds = (now_ns() - t0) / 1e9
    return Point(transport, size, batch, iters, seconds, size * iters / seconds / MIB,
                 iters / seconds / 1e6, post_ns / 1e3 / max(posted, 1), posts)


class TcpRig:
    """Our TCP provider: engine A (initiator) -> engine B (target) over loopback."""

    transport = "tcp"

    def __init__(self, args: argparse.Namespace, max_size: int):
        from dualpath._native import ffi
        from dualpath.tcp import TcpConfig, TcpEngine

        self.ffi = ffi
        depth, sockbuf = args.depth, args.sockbuf
        self.depth, self.signal_every = depth, args.signal_every
        self.a = TcpEngine("127.0.0.1", 0, sockbuf_bytes=sockbuf)
        self.b = TcpEngine("127.0.0.1", 0, sockbuf_bytes=sockbuf)
        self.buf_bytes = max(max_size, min(SLOT_BYTES, max_size * 64))
        self.src = bytearray(os.urandom(1024)) * (self.buf_bytes // 1024 + 1)
        self.dst = bytearray(len(self.src))
        self.src_mr, self.dst_mr = self.a.register(self.src), self.b.register(self.dst)
        self.cq = self.a.cq(max(depth, 64))
        self.conn = self.a.connection(self.cq, TcpConfig(max_send_wr=depth,
                                                         sockbuf_bytes=sockbuf))
        self.conn.connect("127.0.0.1", self.b.port)
        self.description = (f"TCP provider over loopback, engine {self.a.port} -> "
                            f"{self.b.port}, {depth} credits, sockbuf "
                            f"{sockbuf or 'autotuned'}")

    def run(self, size: int, batch: int, iters: int) -> Point:
        ffi, slots = self.ffi, max(1, min(64, self.buf_bytes // size))
        items = ffi.new("struct dp_item[]", slots + batch)
        for i in range(slots + batch):
            s = i % slots
            it = items[i]
            it.local_addr, it.remote_addr = self.src_mr.addr + s * size, self.dst_mr.addr + s * size
            it.length, it.lkey, it.rkey, it.wr_id = size, self.src_mr.lkey, self.dst_mr.rkey, i
        conn, cq, wc, se = self.conn, self.cq, self.cq.wc, self.signal_every

        def post(slot, count):
            return conn.post_raw(items + slot, count, se)

        def wait(block):
            n = cq.wait_n(1.0) if block else cq.poll_n()
            got = 0
            for i in range(n):
                if wc[i].status:
                    raise RuntimeError(f"completion status {wc[i].status}")
                got += wc[i].retired
            return got

        return bw_loop(self.transport, post, wait, size, batch, iters, self.depth, slots)

    def verify(self, size: int) -> bool:
        n = max(1, min(64, self.buf_bytes // size)) * size
        return self.src[:n] == self.dst[:n]

    def close(self):
        self.a.close()
        self.b.close()


RIGS = {"tcp": TcpRig}     # "verbs": a VerbsRig over dualpath.verbs, same run()/close()


# ------------------------------------------------------------------ peers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening(port: int) -> bool:
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(path).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:
                return True
    return False


def run_ucx(size: int, batches: list[int], iters: int, args: argparse.Namespace
            ) -> list[PeerPoint]:
    """ucx_perftest -t ucp_put_bw over TCP on loopback: a server and a client process
    (no post list: one point per size)."""
    warmup = max(10, iters // 20)
    exe = shutil.which("ucx_perftest")
    if exe is None:
        raise SystemExit("--vs-ucx needs ucx_perftest (apt install ucx-utils)")
    env = {**os.environ, "UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "lo"}
    port = args.ucx_port or free_port()
    server = subprocess.Popen([exe, "-p", str(port)], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
    try:
        deadline = clock.now() + 10
        while not listening(port):
            if server.poll() is not None or clock.now() > deadline:
                raise RuntimeError(f"ucx_perftest server did not listen on {port}: "
                                   f"{server.stderr.read() if server.stderr else ''}")
            time.sleep(0.02)
        cmd = [exe, "127.0.0.1", "-p", str(port), "-t", "ucp_put_bw", "-s", str(size),
               "-n", str(iters), "-w", str(warmup), "-v"]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300,
                             check=False)
        rows = [ln.strip() for ln in out.stdout.splitlines() if ln.strip()[:1].isdigit()]
        head = [ln for ln in out.stdout.splitlines() if ln.startswith("iterations,")]
        if out.returncode != 0 or not rows or not head:
            raise RuntimeError(f"ucx_perftest failed (exit {out.returncode}): "
                               f"{out.stdout[-1000:]} {out.stderr[-1000:]}")
        rec = dict(zip(head[0].split(","), rows[-1].split(",")))
        shown = "UCX_TLS=tcp,self UCX_NET_DEVICES=lo " + " ".join(
            ["ucx_perftest", *cmd[1:]])
        return [PeerPoint("ucx_perftest", size, None, int(rec["iterations"]),
                          float(rec["overall_bw"]), float(rec["overall_mr"]) / 1e6, shown)]
    finally:
        try:
            server.wait(timeout=10)     # it exits by itself after one test
        except subprocess.TimeoutExpired:
            server.terminate()
            server.wait(timeout=10)


PEERS = {"ucx": run_ucx}   # "perftest": ib_write_bw --post_list B, one point per batch
PEER_TRANSPORT = {"ucx": "tcp"}     # which rig each peer is compared with


# ------------------------------------------------------------------ report


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def summarise(points: list[Point], peers: list[PeerPoint]) -> dict:
    by = {(p.size, p.batch): p for p in points}
    batches = sorted({p.batch for p in points})
    summary: dict = {
        "verbs_vs_perftest_min_ratio_ge_64k": None,
        "verbs_vs_perftest_ratio_4k_batch32": None,
        "batch32_vs_batch1_msg_rate_4k": None,
        "tcp_vs_ucx_min_ratio_ge_64k": None,
    }
    if (4 * KIB, 32) in by and (4 * KIB, 1) in by:
        summary["batch32_vs_batch1_msg_rate_4k"] = ratio(by[(4 * KIB, 32)].msg_rate_mpps,
                                                         by[(4 * KIB, 1)].msg_rate_mpps)
    ucx = {p.size: p for p in peers if p.tool == "ucx_perftest"}
    if ucx and points and points[0].transport == "tcp":
        low = batches[0]
        at_low, at_best = {}, {}
        for size, peer in ucx.items():
            if size < 64 * KIB:
                continue
            if (size, low) in by:
                at_low[size] = ratio(by[(size, low)].bw_mbps, peer.bw_mbps)
            best = max((p.bw_mbps for p in points if p.size == size), default=None)
            at_best[size] = ratio(best, peer.bw_mbps)
        summary["tcp_vs_ucx_min_ratio_ge_64k"] = min(at_low.values(), default=None)
        summary["tcp_vs_ucx_batch_for_ratio"] = low
        summary["tcp_vs_ucx_ratio_ge_64k_by_size"] = {human(s): r for s, r in at_low.items()}
        summary["tcp_vs_ucx_min_ratio_ge_64k_best_batch"] = min(at_best.values(), default=None)
    return summary


def print_table(points: list[Point], peers: list[PeerPoint]) -> None:
    print(f"{'who':<14}{'#bytes':>10}{'batch':>7}{'#iterations':>13}{'BW MB/s':>11}"
          f"{'Mpps':>9}{'post us/WR':>12}")
    pending = list(peers)
    for p in points:
        for q in [q for q in pending if q.size == p.size and q.batch in (None, p.batch)]:
            pending.remove(q)
            print(f"{q.tool:<14}{q.size:>10}{q.batch or '-':>7}{q.iters:>13}"
                  f"{q.bw_mbps:>11.1f}{q.msg_rate_mpps:>9.3f}{'-':>12}")
        print(f"{'ours/' + p.transport:<14}{p.size:>10}{p.batch:>7}{p.iters:>13}"
              f"{p.bw_mbps:>11.1f}{p.msg_rate_mpps:>9.3f}{p.post_us_per_wr:>12.3f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--transport", choices=sorted(RIGS), default="tcp")
    ap.add_argument("--sizes", default=DEFAULT_SIZES,
                    help=f"message sizes, comma-separated (default {DEFAULT_SIZES})")
    ap.add_argument("--batches", default=DEFAULT_BATCHES,
                    help=f"post-list batch sizes (default {DEFAULT_BATCHES})")
    ap.add_argument("--bytes-per-point", type=parse_size, default=128 * MIB,
                    help="data per point, bounded by --min-iters/--max-iters (default 128M)")
    ap.add_argument("--min-iters", type=int, default=200)
    ap.add_argument("--max-iters", type=int, default=50000)
    ap.add_argument("--depth", type=int, default=128, help="WRITEs outstanding (credits)")
    ap.add_argument("--signal-every", type=int, default=16)
    ap.add_argument("--sockbuf", type=parse_size, default=0,
                    help="TCP SO_SNDBUF/SO_RCVBUF (default 0 = kernel autotuning)")
    ap.add_argument("--vs-ucx", action="store_true",
                    help="run ucx_perftest -t ucp_put_bw over TCP on loopback alongside")
    ap.add_argument("--ucx-port", type=int, default=0,
                    help="ucx_perftest's exchange port (default: a free one)")
    ap.add_argument("--json", metavar="PATH", help="write the record as JSON here")
    args = ap.parse_args(argv)

    sizes = [parse_size(s) for s in args.sizes.split(",")]
    batches = sorted(int(b) for b in args.batches.split(","))
    enabled = [flag for flag in PEERS if getattr(args, f"vs_{flag}", False)]
    for flag in enabled:
        if PEER_TRANSPORT[flag] != args.transport:
            ap.error(f"--vs-{flag} compares the {PEER_TRANSPORT[flag]} data path: use "
                     f"--transport {PEER_TRANSPORT[flag]}")
    if max(batches) > args.depth:
        ap.error(f"a batch ({max(batches)}) cannot exceed --depth ({args.depth})")

    rig = RIGS[args.transport](args, max(sizes))
    points: list[Point] = []
    peers: list[PeerPoint] = []
    try:
        for size in sizes:
            iters = iterations(size, args.bytes_per_point, args.min_iters, args.max_iters)
            for flag in enabled:
                peers += PEERS[flag](size, batches, iters, args)
            for batch in batches:
                rig.run(size, batch, max(batch, iters // 20))     # warm-up
                points.append(rig.run(size, batch, iters))
            if not rig.verify(size):
                raise SystemExit(f"data check failed at {size} bytes: target != source")
        description = rig.description
    finally:
        rig.close()

    print_table(points, peers)
    summary = summarise(points, peers)
    print("summary: " + json.dumps(summary))
    record = {
        "bench": "dataplane",
        "version": __version__,
        "argv": sys.argv[1:] if argv is None else argv,
        "host": {"node": platform.node(), "cpus": os.cpu_count(),
                 "kernel": platform.release()},
        "method": __doc__.split("\n\n")[1].replace("\n", " "),
        "rig": description,
        "units": {"bw_mbps": "MB/s, 2^20 bytes", "msg_rate_mpps": "1e6 WRITEs/s",
                  "post_us_per_wr": "us inside the post call per WRITE"},
        "points": [asdict(p) for p in points],
        "peers": [asdict(p) for p in peers],
        "summary": summary,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
