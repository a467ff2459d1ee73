"""Data-plane bandwidth, message rate and submission cost, perftest style.

Method. One initiator connection writes into one target region (the TCP provider's
target is a second engine in this process, served by its C server thread over
loopback; the verbs rig's is a second RC QP on --peer-device, by default the same
device: rxe loopback). For each message size and post-list batch size, the loop keeps up to
``--depth`` WRITEs outstanding, posting ``batch`` per post call (one gathered send = one
doorbell) and signalling every ``--signal-every``-th WRITE (and the last of each post),
like ``ib_write_bw --post_list`` (verbs: signalled as ib_write_bw does, every
post-list-th WRITE, or every 100th at batch 1, its default cq-mod). Messages cycle over up to 64 slots of the buffers.
With ``--rounds R`` (verbs default 5, see VERBS_DEFAULTS) peers and ours alternate R
times per size and each row keeps its best round, the same rule for both sides.
Bandwidth is bytes over the time from the first post to the last completion, in MB/s of
2^20 bytes (the unit perftest and ucx_perftest print); message rate in millions of
WRITEs per second; submission cost is the time inside the post call divided by the
WRITEs it posted (µs, including the cffi call; for TCP it also includes the kernel's copy
of what the socket accepts at once, so large messages cost more per WRITE).

Peers run in the same invocation at the same sizes, each next to ours so load drift on
the host hits both alike: ``--transport tcp --vs-ucx`` runs ``ucx_perftest -t
ucp_put_bw`` over TCP on loopback (UCX_TLS=tcp,self, UCX_NET_DEVICES=lo; server and
client processes on 127.0.0.1). ``--transport verbs --vs-perftest`` runs perftest's
``ib_write_bw`` (server and client on --device, ``-s SIZE -n ITERS -t DEPTH -l BATCH
-x GID``) at every size and batch, a fresh exchange port per run, retried when it
prints no result.

The TCP provider runs authenticated (every connection admitted by a credential's
challenge-response, as deployed, into a scoped region: each WRITE's range looked up in
the writer's grant, which shares its hash bucket with 64 other peers' grants) and, as its own peer ``tcp_open``, on a twin pair of
engines without admission (DP_TCP_OPEN), back to back with ours at each size and batch
(the twin first in even rounds, ours first in odd ones). tcp_auth_overhead_max_ge_64k is
1 - authenticated / open bandwidth at the worst size >= 64 KiB, each size's ratio the
median over its rounds and batches of every back-to-back pair (robust to load that
comes and goes; tcp_auth_overhead_by_size); beside it the worst single size and batch
from bests of rounds (tcp_auth_overhead_max_point_ge_64k, _by_point), which the noise
of one point moves either way. Connection set-up (connect, plus the handshake when admitted) is
timed over 20 fresh connections each way: tcp_connect_us_{auth,open} are medians in us.

Prints a fixed table and, with ``--json PATH``, writes the same record with a top-level
``summary``: tcp_vs_ucx_min_ratio_ge_64k (ours at the smallest batch run, one WRITE per
post like one ucp_put per call, over ucx at each size >= 64 KiB), the same at our best
batch, batch32_vs_batch1_msg_rate_4k, verbs_vs_perftest_min_ratio_ge_64k (ours over
ib_write_bw at the same batch, the lowest over sizes >= 64 KiB and the batches run),
verbs_vs_perftest_ratio_4k_batch32 (null when not run); beside the ratios of bests,
verbs_vs_perftest_paired_median_ratios (the median over rounds of each back-to-back
pair) and every round's figure under rounds_bw_mbps, so noise can be judged.

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
# rxe under emulation (the SoftRoCE guest) moves ~15-80 MB/s: a shorter default sweep
# that still holds every figure issue 3 targets; --sizes/--batches give the full one.
VERBS_DEFAULTS = {"sizes": "4K,64K,1M,4M", "batches": "1,32", "bytes_per_point": 32 * MIB,
                  "min_iters": 64, "rounds": 5}
SLOT_BYTES = 64 * MIB       # per buffer: slots = min(64, SLOT_BYTES // size)
VERBS_SLOT_BYTES = 16 * MIB  # rxe pins and maps every page: keep its MRs small
PERFTEST_CQ_MOD = 100       # ib_write_bw's default CQ moderation without --post_list
STALL_S = 30.0              # no completion this long while waiting: stop, do not hang


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


def ring_items(ffi, src_mr, dst_mr, size: int, slots: int, batch: int):
    """``slots + batch`` prebuilt WRITEs of ``size`` bytes cycling over ``slots`` message
    slots of the two regions, so ``items + slot`` is a run of ``batch`` for any slot."""
    items = ffi.new("struct dp_item[]", slots + batch)
    for i in range(slots + batch):
        s = i % slots
        it = items[i]
        it.local_addr, it.remote_addr = src_mr.addr + s * size, dst_mr.addr + s * size
        it.length, it.lkey, it.rkey, it.wr_id = size, src_mr.lkey, dst_mr.rkey, i
    return items


def retired_waiter(cq):
    """bw_loop's wait(block): poll (or wait for the next completion) and count the WRITEs
    retired; an error completion, or none for STALL_S seconds, stops the bench."""
    wc = cq.wc

    def wait(block: bool) -> int:
        n = cq.wait_n(STALL_S) if block else cq.poll_n()
        if block and n == 0:
            raise RuntimeError(f"no completion within {STALL_S} s: the data path is stuck")
        got = 0
        for i in range(n):
            if wc[i].status:
                raise RuntimeError(f"completion status {wc[i].status}")
            got += wc[i].retired
        return got

    return wait


class TcpRig:
    """Our TCP provider: engine A (initiator) -> engine B (target) over loopback."""

    transport = "tcp"

    def __init__(self, args: argparse.Namespace, max_size: int):
        from dualpath._native import ffi
        from dualpath.tcp import TcpConfig, TcpEngine

        self.ffi = ffi
        depth, sockbuf = args.depth, args.sockbuf
        self.depth, self.signal_every = depth, args.signal_every
        self.buf_bytes = max(max_size, min(SLOT_BYTES, max_size * 64))
        self.src = bytearray(os.urandom(1024)) * (self.buf_bytes // 1024 + 1)
        self.dst = bytearray(len(self.src))
        config = TcpConfig(max_send_wr=depth, sockbuf_bytes=sockbuf)
        self.pairs = {}    # "auth" (as deployed) and "open" (no admission), same buffers
        self.connect_us = {}
        try:
            for kind in ("auth", "open"):
                a = TcpEngine("127.0.0.1", 0, sockbuf_bytes=sockbuf, open=kind == "open")
                b = TcpEngine("127.0.0.1", 0, sockbuf_bytes=sockbuf, open=kind == "open",
                              max_conns_per_peer=64)
                cq = a.cq(max(depth, 64))
                dst_mr = b.register(self.dst, scoped=kind == "auth")
                if kind == "auth":      # as deployed: scoped, the writer's grant found
                    for k in range(1, 65):   # in its bucket among 64 other peers' (decoys)
                        b.grant(1 + 256 * k, dst_mr, [(0, len(self.dst))])
                    b.grant(1, dst_mr, [(0, len(self.dst))])
                self.pairs[kind] = (a, b, a.register(self.src), dst_mr, cq)
                self.connect_us[kind] = self._time_connects(a, b, cq, kind)
                conn = a.connection(cq, config)
                conn.connect("127.0.0.1", b.port, credential=self._cred(b, kind))
                self.pairs[kind] += (conn,)
        except BaseException:
            self.close()
            raise
        a, b = self.pairs["auth"][:2]
        self.description = (f"TCP provider over loopback, engine {a.port} -> {b.port} "
                            f"(admitted by credential, scoped; twin without admission for "
                            f"tcp_open), {depth} credits, sockbuf {sockbuf or 'autotuned'}")

    @staticmethod
    def _cred(b, kind):
        return b.admit(1) if kind == "auth" else None

    def _time_connects(self, a, b, cq, kind, n: int = 20) -> float:
        """Median microseconds of connect (+ handshake when admitted), fresh each time."""
        took = []
        for _ in range(n):
            with a.connection(cq) as c:
                cred = self._cred(b, kind)
                t0 = clock.now()
                c.connect("127.0.0.1", b.port, credential=cred)
                took.append((clock.now() - t0) * 1e6)
                c.reset()
        took.sort()
        return round(took[n // 2], 1)

    def run(self, size: int, batch: int, iters: int, kind: str = "auth") -> Point:
        _a, _b, src_mr, dst_mr, cq, conn = self.pairs[kind]
        slots = max(1, min(64, self.buf_bytes // size))
        items = ring_items(self.ffi, src_mr, dst_mr, size, slots, batch)
        se = self.signal_every

        def post(slot, count):
            return conn.post_raw(items + slot, count, se)

        return bw_loop(self.transport, post, retired_waiter(cq), size, batch, iters,
                       self.depth, slots)

    def verify(self, size: int) -> bool:
        n = max(1, min(64, self.buf_bytes // size)) * size
        return self.src[:n] == self.dst[:n]

    def close(self):
        for pair in self.pairs.values():
            pair[0].close()
            pair[1].close()


class VerbsRig:
    """Our verbs data path: an RC QP on ``--device`` writing into a QP on
    ``--peer-device`` (default the same device: rxe loopback, like the perftest figures
    in the guest notes; rxe1 crosses the veth). Posts go straight to dp_qp_post_write
    over a prebuilt item array (QueuePair.post_raw) and completions are polled in C."""

    transport = "verbs"

    def __init__(self, args: argparse.Namespace, max_size: int):
        from dualpath import verbs
        from dualpath._native import ffi, lib

        self.ffi, self.verbs = ffi, verbs
        self.depth, self.max_slots = args.depth, args.slots
        self.unsignalled_last = lib.DP_ITEM_UNSIGNALLED_LAST
        names = verbs.list_devices()
        if not names:
            raise SystemExit("--transport verbs needs an RDMA device (none listed); run it "
                             "in the SoftRoCE guest: tools/vm/run.sh '.venv/bin/python "
                             "bench/dataplane.py --transport verbs ...'")
        self.devices = []
        self.sides = []
        for name in (args.device, args.peer_device or args.device):
            dev = verbs.Device(name)
            self.devices.append(dev)
            gid = dev.pick_gid(args.gid_index)
            cfg = verbs.QpConfig(max_send_wr=args.depth, gid_index=gid.index if gid else -1)
            cq = dev.cq(max(args.depth, 64))
            self.sides.append((dev, gid, dev.pd(), cq, cfg))
        self.buf_bytes = max(max_size, min(VERBS_SLOT_BYTES, max_size * 64))
        self.src = bytearray(os.urandom(1024)) * (self.buf_bytes // 1024 + 1)
        self.dst = bytearray(len(self.src))
        (_, gid_a, pd_a, self.cq, cfg_a), (_, _, pd_b, cq_b, cfg_b) = self.sides
        self.src_mr, self.dst_mr = pd_a.mr(self.src), pd_b.mr(self.dst)
        self.qp, peer = pd_a.qp(self.cq, config=cfg_a), pd_b.qp(cq_b, config=cfg_b)
        ea, eb = self.qp.endpoint(), peer.endpoint()
        self.qp.connect(eb)
        peer.connect(ea)
        self.gid_index = gid_a.index if gid_a else -1
        self.description = (f"verbs {self.devices[0].name} -> {self.devices[1].name} "
                            f"(RC QP {self.qp.qp_num:#x}, gid [{self.gid_index}] {gid_a}, "
                            f"path MTU {ea.mtu} B), {args.depth} credits, signalled like "
                            f"ib_write_bw: every batch-th WRITE, every "
                            f"{min(PERFTEST_CQ_MOD, args.depth)}th at batch 1")

    def slots(self, size: int) -> int:
        return max(1, min(self.max_slots, self.buf_bytes // size))

    def run(self, size: int, batch: int, iters: int) -> Point:
        slots = self.slots(size)
        items = ring_items(self.ffi, self.src_mr, self.dst_mr, size, slots, batch)
        # Signalled like ib_write_bw: with --post_list B its CQ moderation becomes B; with
        # none it is its default cq-mod (100), so single-WR posts ask for no completion of
        # their own (DP_ITEM_UNSIGNALLED_LAST) except the run's last WRITE.
        qp, se = self.qp, batch if batch > 1 else min(PERFTEST_CQ_MOD, self.depth)
        for i in range(slots + batch):
            items[i].flags = self.unsignalled_last
        runs = [items + i for i in range(slots)]    # made once: no cdata per post
        # ib_write_bw's loop, kept lean (under emulation every Python line shows): post
        # while the credits allow, else wait in C; the run's last post is signalled.
        post_raw, flag, depth, now = qp.post_raw, self.unsignalled_last, self.depth, clock.now_ns
        wait = retired_waiter(self.cq)
        posted = retired = posts = post_ns = 0
        t0 = now()
        while retired < iters:
            room = depth - posted + retired
            if room >= batch and posted + batch < iters:
                a = now()
                posted += post_raw(runs[posted % slots], batch, se)
                post_ns += now() - a
                posts += 1
            elif posted < iters and room >= iters - posted:
                count, slot = iters - posted, posted % slots
                last = items[slot + count - 1]
                last.flags = 0
                a = now()
                posted += post_raw(runs[slot], count, se)
                post_ns += now() - a
                last.flags = flag
                posts += 1
            else:
                retired += wait(True)
        seconds = (now() - t0) / 1e9
        return Point(self.transport, size, batch, iters, seconds, size * iters / seconds / MIB,
                     iters / seconds / 1e6, post_ns / 1e3 / max(posted, 1), posts)

    def verify(self, size: int) -> bool:
        n = self.slots(size) * size
        return self.src[:n] == self.dst[:n]

    def close(self):
        for dev in reversed(self.devices):
            dev.close()


RIGS = {"tcp": TcpRig, "verbs": VerbsRig}


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
        reap(server)


def reap(server: subprocess.Popen) -> None:
    """A peer's server exits by itself after one test; stop it if it has not in 10 s."""
    try:
        server.wait(timeout=10)
    except subprocess.TimeoutExpired:
        server.terminate()
        server.wait(timeout=10)


_perftest_ports = iter(range(1 << 16))


def perftest_once(exe: str, base: list[str], port: int, timeout: float) -> str:
    """One ib_write_bw server + client pair on ``port``; the client's stdout."""
    server = subprocess.Popen([exe, *base, "-p", str(port)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    try:
        deadline = clock.now() + 20
        while not listening(port):
            if server.poll() is not None or clock.now() > deadline:
                out = server.communicate(timeout=5)[0] if server.poll() is not None else ""
                raise RuntimeError(f"ib_write_bw server did not listen on {port}: {out[-500:]}")
            time.sleep(0.05)
        client = subprocess.run([exe, *base, "-p", str(port), "127.0.0.1"],
                                capture_output=True, text=True, timeout=timeout, check=False)
        return client.stdout + client.stderr
    finally:
        reap(server)


def parse_perftest(out: str) -> tuple[int, int, float, float] | None:
    """(bytes, iterations, BW average MB/s, MsgRate Mpps) from ib_write_bw's result line
    (the numeric line after the ``#bytes #iterations BW peak ...`` header)."""
    lines = out.splitlines()
    for i, line in enumerate(lines):
        if "#bytes" in line and "#iterations" in line:
            for row in lines[i + 1:]:
                f = row.split()
                if len(f) >= 5 and f[0].isdigit():
                    return int(f[0]), int(f[1]), float(f[3]), float(f[4])
    return None


def run_perftest(size: int, batches: list[int], iters: int, args: argparse.Namespace
                 ) -> list[PeerPoint]:
    """ib_write_bw server and client on --device (rxe loopback, or --peer-device for the
    client), one run per post-list batch at this size: ``-s SIZE -n ITERS -l BATCH``
    (perftest then moderates its CQ to the post list), default tx depth 128 like our
    --depth. perftest sometimes prints no result (too few iterations, or a run right
    after the last one): each try takes a fresh port, up to --perftest-tries tries."""
    exe = shutil.which("ib_write_bw")
    if exe is None:
        raise SystemExit("--vs-perftest needs ib_write_bw (apt install perftest)")
    from dualpath import verbs

    with verbs.Device(args.device) as dev:
        gid = dev.pick_gid(args.gid_index)
        name = dev.name
    out: list[PeerPoint] = []
    for batch in batches:
        n = -(-iters // batch) * batch      # a whole number of post lists
        base = ["-d", name, "-s", str(size), "-n", str(n), "-t", str(args.depth), "-F"]
        if gid is not None:
            base += ["-x", str(gid.index)]
        if batch > 1:
            base += ["-l", str(batch)]
        last = ""
        for _ in range(args.perftest_tries):
            port = args.perftest_port + next(_perftest_ports) % 1000
            last = perftest_once(exe, base, port, timeout=600)
            got = parse_perftest(last)
            if got is not None and got[2] > 0:
                shown = " ".join(["ib_write_bw", *base, "-p", str(port)])
                out.append(PeerPoint("ib_write_bw", size, batch, got[1], got[2], got[3],
                                     f"{shown} (server) + same with 127.0.0.1 (client)"))
                break
            time.sleep(1.0)
        else:
            raise RuntimeError(f"ib_write_bw gave no result at {size} B, post list {batch} "
                               f"after {args.perftest_tries} tries: {last[-1500:]}")
    return out


PEERS = {"ucx": run_ucx, "perftest": run_perftest}
PEER_TRANSPORT = {"ucx": "tcp", "perftest": "verbs"}     # which rig each peer is compared with
PEER_POST_LIST = {"perftest"}   # peers measured per batch (interleaved with ours)


# ------------------------------------------------------------------ report


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def paired_median(ours: list[float], peer: list[float]) -> float | None:
    """The median over rounds of ours/peer, each round's pair run back to back: robust to
    load that comes and goes, where the ratio of bests rewards the luckier side."""
    r = sorted(a / b for a, b in zip(ours, peer) if b)
    return round((r[len(r) // 2] + r[(len(r) - 1) // 2]) / 2, 3) if r else None


def summarise(points: list[Point], peers: list[PeerPoint],
              samples: dict[str, list[float]] | None = None) -> dict:
    by = {(p.size, p.batch): p for p in points}
    batches = sorted({p.batch for p in points})
    summary: dict = {
        "verbs_vs_perftest_min_ratio_ge_64k": None,
        "verbs_vs_perftest_ratio_4k_batch32": None,
        "batch32_vs_batch1_msg_rate_4k": None,
        "tcp_vs_ucx_min_ratio_ge_64k": None,
        "tcp_auth_overhead_max_ge_64k": None,
    }
    twin = {(p.size, p.batch): p for p in peers if p.tool == "tcp_open"}
    over = [round(1 - by[k].bw_mbps / q.bw_mbps, 3) for k, q in twin.items()
            if k[0] >= 64 * KIB and k in by and q.bw_mbps]
    if over:
        # The figure: per size, the median of every back-to-back pair's ratio over rounds
        # and batches; the worst size >= 64 KiB. Beside it the worst single point.
        summary["tcp_auth_overhead_max_point_ge_64k"] = max(over)
        if samples:
            per_size = {}
            for s in sorted({s for s, _ in twin if s >= 64 * KIB}):
                ours, peer = [], []
                for b in sorted(b for s2, b in twin if s2 == s and (s, b) in by):
                    ours += samples.get(f"ours/{s}/{b}", [])
                    peer += samples.get(f"tcp_open/{s}/{b}", [])
                if (r := paired_median(ours, peer)) is not None:
                    per_size[human(s)] = round(1 - r, 3)
            summary["tcp_auth_overhead_by_size"] = per_size
            summary["tcp_auth_overhead_max_ge_64k"] = (max(per_size.values())
                                                       if per_size else None)
        else:
            summary["tcp_auth_overhead_max_ge_64k"] = max(over)
        summary["tcp_auth_overhead_by_point"] = {
            f"{human(s)}/b{b}": round(1 - by[(s, b)].bw_mbps / q.bw_mbps, 3)
            for (s, b), q in sorted(twin.items()) if (s, b) in by and q.bw_mbps}
    if (4 * KIB, 32) in by and (4 * KIB, 1) in by:
        summary["batch32_vs_batch1_msg_rate_4k"] = ratio(by[(4 * KIB, 32)].msg_rate_mpps,
                                                         by[(4 * KIB, 1)].msg_rate_mpps)
    perf = {(p.size, p.batch): p for p in peers if p.tool == "ib_write_bw"}
    if perf and points and points[0].transport == "verbs":
        ratios = {k: ratio(by[k].bw_mbps, q.bw_mbps) for k, q in perf.items() if k in by}
        ge64 = [r for (size, _), r in ratios.items() if size >= 64 * KIB and r is not None]
        summary["verbs_vs_perftest_min_ratio_ge_64k"] = min(ge64, default=None)
        summary["verbs_vs_perftest_ratio_4k_batch32"] = ratios.get((4 * KIB, 32))
        summary["verbs_vs_perftest_ratios"] = {f"{human(s)}/b{b}": r
                                               for (s, b), r in sorted(ratios.items())}
        if samples:
            summary["verbs_vs_perftest_paired_median_ratios"] = {
                f"{human(s)}/b{b}": paired_median(samples.get(f"ours/{s}/{b}", []),
                                                  samples.get(f"ib_write_bw/{s}/{b}", []))
                for (s, b) in sorted(ratios)}
        summary["perftest_post_list_gain_4k"] = ratio(
            perf[(4 * KIB, 32)].msg_rate_mpps, perf[(4 * KIB, 1)].msg_rate_mpps
        ) if (4 * KIB, 32) in perf and (4 * KIB, 1) in perf else None
        summary["verbs_post_us_per_wr_by_batch_4k"] = {
            p.batch: round(p.post_us_per_wr, 3) for p in points if p.size == 4 * KIB}
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
    ap.add_argument("--sizes", default=None,
                    help=f"message sizes, comma-separated (default {DEFAULT_SIZES}; "
                    f"verbs: {VERBS_DEFAULTS['sizes']})")
    ap.add_argument("--batches", default=None,
                    help=f"post-list batch sizes (default {DEFAULT_BATCHES}; verbs: "
                    f"{VERBS_DEFAULTS['batches']})")
    ap.add_argument("--bytes-per-point", type=parse_size, default=None,
                    help="data per point, bounded by --min-iters/--max-iters (default 1G, so "
                    "ucx_perftest's start-up outliers do not dominate its average; "
                    "verbs: 32M)")
    ap.add_argument("--min-iters", type=int, default=None,
                    help="default 200; verbs: 64")
    ap.add_argument("--rounds", type=int, default=None,
                    help="rounds per point, peers and ours alternating, best kept "
                    "(default 1; verbs: 5)")
    ap.add_argument("--max-iters", type=int, default=50000)
    ap.add_argument("--depth", type=int, default=128, help="WRITEs outstanding (credits)")
    ap.add_argument("--signal-every", type=int, default=16)
    ap.add_argument("--sockbuf", type=parse_size, default=0,
                    help="TCP SO_SNDBUF/SO_RCVBUF (default 0 = kernel autotuning)")
    ap.add_argument("--vs-ucx", action="store_true",
                    help="run ucx_perftest -t ucp_put_bw over TCP on loopback alongside")
    ap.add_argument("--ucx-port", type=int, default=0,
                    help="ucx_perftest's exchange port (default: a free one)")
    ap.add_argument("--device", default=os.environ.get("DUALPATH_RDMA_DEV_A"),
                    help="verbs: RDMA device (default $DUALPATH_RDMA_DEV_A, else the first "
                    "with an ACTIVE port)")
    ap.add_argument("--peer-device", default=None,
                    help="verbs: the target's device (default --device: loopback)")
    ap.add_argument("--gid-index", type=int, default=-1,
                    help="verbs: GID index (default: the RoCE v2 IPv4-mapped one)")
    ap.add_argument("--vs-perftest", action="store_true",
                    help="run ib_write_bw on the same device at the same sizes and post "
                    "lists alongside (needs --transport verbs)")
    ap.add_argument("--perftest-port", type=int, default=18600,
                    help="first TCP port for ib_write_bw's exchange; each run takes the next")
    ap.add_argument("--perftest-tries", type=int, default=3)
    ap.add_argument("--slots", type=int, default=64,
                    help="verbs: message slots the WRITEs cycle over (1 = one buffer "
                    "rewritten, as ib_write_bw does; default 64)")
    ap.add_argument("--json", metavar="PATH", help="write the record as JSON here")
    args = ap.parse_args(argv)
    if args.json:      # before the run, not after it: a missing folder is made
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)

    defaults = (VERBS_DEFAULTS if args.transport == "verbs" else
                {"sizes": DEFAULT_SIZES, "batches": DEFAULT_BATCHES, "bytes_per_point": 1024 * MIB,
                 "min_iters": 200, "rounds": 1})
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
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
    samples: dict[str, list[float]] = {}    # "who/size/batch" -> MB/s of every round
    try:
        for size in sizes:
            iters = iterations(size, args.bytes_per_point, args.min_iters, args.max_iters)
            for batch in batches:
                rig.run(size, batch, max(batch, iters // 20))     # warm-up
            # Rounds alternate the peers and ours; each keeps its best round (on a shared
            # or emulated machine noise only slows a run down): the same rule for both.
            best_peer: dict[tuple, PeerPoint] = {}
            best_ours: dict[int, Point] = {}
            # A peer with post lists runs right before ours at each batch.
            for rnd in range(args.rounds):
                runs = [(flag, batches) for flag in enabled if flag not in PEER_POST_LIST]
                for batch in batches:
                    runs += [(flag, [batch]) for flag in enabled if flag in PEER_POST_LIST]
                    pair = [("tcp_open", batch)] if args.transport == "tcp" else []
                    pair.append((None, batch))
                    runs += pair if rnd % 2 == 0 else pair[::-1]   # neither always first
                for flag, which in runs:
                    if flag == "tcp_open":      # the unauthenticated twin, same sizes
                        p = rig.run(size, which, iters, kind="open")
                        q = PeerPoint("tcp_open", size, which, p.iters, p.bw_mbps,
                                      p.msg_rate_mpps, "TcpEngine(open=True) twin")
                        samples.setdefault(f"tcp_open/{size}/{which}", []).append(q.bw_mbps)
                        key = (q.tool, q.size, q.batch)
                        if key not in best_peer or q.bw_mbps > best_peer[key].bw_mbps:
                            best_peer[key] = q
                        continue
                    if flag is None:
                        p = rig.run(size, which, iters)
                        samples.setdefault(f"ours/{size}/{which}", []).append(p.bw_mbps)
                        if which not in best_ours or p.bw_mbps > best_ours[which].bw_mbps:
                            best_ours[which] = p
                        continue
                    for q in PEERS[flag](size, which, iters, args):
                        key = (q.tool, q.size, q.batch)
                        samples.setdefault(f"{q.tool}/{q.size}/{q.batch}", []).append(q.bw_mbps)
                        if key not in best_peer or q.bw_mbps > best_peer[key].bw_mbps:
                            best_peer[key] = q
            peers += best_peer.values()
            points += [best_ours[b] for b in batches]
            if not rig.verify(size):
                raise SystemExit(f"data check failed at {size} bytes: target != source")
        description = rig.description
        connect_us = getattr(rig, "connect_us", {})
    finally:
        rig.close()

    print_table(points, peers)
    summary = summarise(points, peers, samples)
    if connect_us:
        summary["tcp_connect_us_auth"] = connect_us["auth"]
        summary["tcp_connect_us_open"] = connect_us["open"]
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
        "rounds_bw_mbps": {k: [round(x, 2) for x in v] for k, v in samples.items()},
        "summary": summary,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
