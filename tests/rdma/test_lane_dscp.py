"""The KV lane: the QPs a transfer engine makes carry the lane of dualpath/lane.py (as
the device holds them), and a QP's GRH traffic class becomes the IPv4 DSCP of its RoCE v2
packets (UDP 4791), captured with tcpdump on the veth between rxe0 and rxe1."""

from __future__ import annotations

import os
import select
import shutil
import signal
import struct
import subprocess
import time
from pathlib import Path

import pytest

from dualpath import clock, lane, verbs
from dualpath.config import load
from dualpath.transfer.transport import TransportChoice, open_provider
from tests.rdma.conftest import connect, make_side, wait_retired

ROCE_V2_PORT = 4791
TRAFFIC_CLASS = lane.KV_TRAFFIC_CLASS   # DSCP 24 (= 96 >> 2), ECN 0: tos 0x60 on the wire


def test_a_transfer_engines_qps_carry_the_default_kv_lane(dev_names):
    """The provider a node opens from a default config: both its active QPs and the
    passive ones it accepts hold the lane's traffic class, and on InfiniBand its SL, as
    the device reports them (ibv_query_qp). A RoCE packet carries no SL (its priority is
    the DSCP, next test, or the VLAN PCP) and rxe keeps none: rxe_av_from_attr copies the
    GRH and port only."""
    cfg = load(None, {"transport.kind": "verbs", "transport.device": dev_names[0]})
    p = open_provider(TransportChoice("verbs", "test"), cfg.transport, cfg.transfer,
                      cfg.kv_lane)
    try:
        c = p.connection(16)
        theirs = p.accept("peer", 0, c.endpoint())
        c.connect(theirs, 5.0)
        assert p.description.endswith(f"sl {lane.KV_SERVICE_LEVEL} tc {TRAFFIC_CLASS}")
        ib = not p.device.port_attrs().is_ethernet
        for qp in (c.qp, p._passive[("peer", 0)]):
            sl, tc = qp.lane
            assert tc == TRAFFIC_CLASS
            # mlx5 keeps a RoCE QP's SL (it becomes the VLAN PCP); rxe reports 0
            assert sl == lane.KV_SERVICE_LEVEL or (not ib and sl == 0), (sl, ib)
    finally:
        p.close()


def read_pcap_roce(path: str) -> list[tuple[int, str, str]]:
    """(tos, source IP, destination IP) of each IPv4 packet to UDP 4791 in an Ethernet
    pcap file."""
    data = Path(path).read_bytes()
    magic, = struct.unpack_from("<I", data, 0)
    assert magic == 0xA1B2C3D4, f"not a little-endian microsecond pcap: {magic:#x}"
    linktype, = struct.unpack_from("<I", data, 20)
    assert linktype == 1, f"link type {linktype} is not Ethernet"
    out, off = [], 24
    while off + 16 <= len(data):
        _, _, incl, _ = struct.unpack_from("<IIII", data, off)
        pkt = data[off + 16:off + 16 + incl]
        off += 16 + incl
        if len(pkt) >= 14 + 20 + 4 and pkt[12:14] == b"\x08\x00" and pkt[14 + 9] == 17:
            ihl = (pkt[14] & 0x0F) * 4
            dport, = struct.unpack_from(">H", pkt, 14 + ihl + 2)
            if dport == ROCE_V2_PORT:
                src, dst = (".".join(map(str, pkt[o:o + 4])) for o in (26, 30))
                out.append((pkt[15], src, dst))
    return out


class Capture:
    """tcpdump on one interface into a pcap file, started before and stopped after."""

    def __init__(self, iface: str, path: str, bpf: str):
        self.path = path
        self.proc = subprocess.Popen(
            ["tcpdump", "-i", iface, "-n", "-U", "--immediate-mode", "-Z", "root", "-w", path,
             bpf],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        # tcpdump says "listening on IFACE" once the capture is armed. -Z root: it would
        # otherwise drop to its own user before opening a file in a root-owned folder.
        ready, _, _ = select.select([self.proc.stderr], [], [], 30)
        line = self.proc.stderr.readline().decode() if ready else ""
        if "listening on" not in line:
            self.stop()
            raise AssertionError(f"tcpdump did not start: {line!r}")

    def stop(self, enough=lambda packets: True, bound: float = 30.0):
        """Stop once the file holds `enough` packets (or `bound` seconds passed): a
        packet can reach the file a moment after the completion that it carried."""
        deadline = clock.now() + bound
        while clock.now() < deadline and not enough(self.packets()):
            time.sleep(0.05)
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait(timeout=30)
        return self.packets()

    def packets(self) -> list[tuple[int, str, str]]:
        try:
            return read_pcap_roce(self.path)
        except (FileNotFoundError, struct.error):
            return []


def split(packets) -> tuple[list[int], list[int]]:
    """The TOS bytes of A->B packets (the WRITEs) and of B->A ones (the ACKs)."""
    ip_a, ip_b = (os.environ.get(k, d) for k, d in (("DUALPATH_RDMA_IP_A", "10.99.0.1"),
                                                    ("DUALPATH_RDMA_IP_B", "10.99.0.2")))
    return ([tos for tos, src, dst in packets if (src, dst) == (ip_a, ip_b)],
            [tos for tos, src, dst in packets if (src, dst) == (ip_b, ip_a)])


def test_traffic_class_reaches_the_wire_as_dscp(dev_names, tmp_path):
    if len(dev_names) < 2:
        pytest.skip("needs rxe0 and rxe1 on the two ends of a veth (loopback never hits "
                    "the wire, ../shared/softroce.md)")
    if shutil.which("tcpdump") is None:
        pytest.skip("tcpdump is not installed (tools/install-system-packages.sh has it)")
    iface = os.environ.get("DUALPATH_RDMA_IFACE_A", "veth0")
    lane = verbs.QpConfig(traffic_class=TRAFFIC_CLASS, service_level=3)
    with verbs.Device(dev_names[0]) as da, verbs.Device(dev_names[1]) as db:
        a = make_side(da, 1 << 16, config=lane)
        b = make_side(db, 1 << 16, config=lane)
        connect(a, b)
        cap = Capture(iface, str(tmp_path / "lane.pcap"), f"udp port {ROCE_V2_PORT}")
        try:
            a.buf[:] = bytes(range(256)) * 256
            items = [a.item(b, i * 4096, 4096, wr_id=i) for i in range(8)]
            assert a.qp.post_write(items, signal_every=8) == 8
            wait_retired(a, 8)
            assert bytes(b.buf[:8 * 4096]) == bytes(a.buf[:8 * 4096])
        finally:
            packets = cap.stop(lambda ps: len(split(ps)[0]) >= 8 and split(ps)[1])
    # The WRITEs to rxe1 (8 x 4 KiB: at least one packet each) and rxe1's ACKs back both
    # cross veth0, and both QPs are on the lane.
    writes, acks = split(packets)
    assert len(writes) >= 8 and acks, f"RoCE v2 packets seen on {iface}: {packets}"
    assert {tos >> 2 for tos in writes + acks} == {TRAFFIC_CLASS >> 2}, packets
    assert {tos & 3 for tos in writes + acks} == {0}
