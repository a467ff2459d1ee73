"""The verbs provider behind the TransferEngine: one device, PD and CQ; RC QPs on the
KV lane (service level + traffic class) for active connections, and passive QPs made by
``accept`` for the peers that connect to us (they only receive WRITEs, so they post
nothing and see no completions: they sit on a CQ of their own that nobody polls).

Threads: dp.h forbids creating, destroying or resetting a QP on a CQ while another
thread polls or posts on it (QP tables, CQ resize, CQ credits). The engine makes, resets
and closes its connections on its data-path thread, the one that posts and polls
(dualpath/transfer/datapath.py, ``DataPath.call``), so nothing here takes a lock. The
passive QPs ``accept`` makes on the loop thread sit on a CQ of their own that nobody
polls.

Endpoints are ``struct dp_qp_endpoint`` packed little-endian: qpn, psn, lid, mtu, gid.
Tested only where a device exists (tests/rdma, the SoftRoCE guest).
"""

from __future__ import annotations

import struct

from dualpath import lane, verbs
from dualpath.dp import WorkCompletion
from dualpath.errors import UsageError
from dualpath.transfer.provider import Admissions, Connection, Provider

_ENDPOINT = struct.Struct("<IIII16s")


def encode_endpoint(e: verbs.Endpoint) -> bytes:
    return _ENDPOINT.pack(e.qpn, e.psn, e.lid, e.mtu, e.gid)


def decode_endpoint(data: bytes) -> verbs.Endpoint:
    if len(data) != _ENDPOINT.size:
        raise UsageError(f"not a verbs endpoint ({_ENDPOINT.size} bytes): {len(data)} bytes")
    return verbs.Endpoint(*_ENDPOINT.unpack(data))


class VerbsProvider(Provider):
    """``device`` "" = the first with an ACTIVE port; ``gid_index`` -1 = pick the RoCE v2
    IPv4-mapped GID (none on InfiniBand).

    ``retry_cnt`` defaults to 6, not the verbs maximum 7: rxe treats 7 as "retry for
    ever" (rxe_comp.c never counts it down), so a peer that went away would never give
    an error completion and only the engine's timeout would end its transfers. With 6,
    a dead peer fails a QP after 7 tries of the ACK timeout (4.096 us << ``ack_timeout``:
    67 ms at 14), about 0.5 s, and the engine recovers or gives up."""

    kind = "verbs"
    poll_slice_s = 0.0002   # dp_cq_wait busy-polls: keep slices short, wake() is a no-op

    def __init__(self, device: str = "", port: int = 1, gid_index: int = -1, *,
                 cq_depth: int = 4096, service_level: int = lane.KV_SERVICE_LEVEL,
                 traffic_class: int = lane.KV_TRAFFIC_CLASS,
                 retry_cnt: int = 6, ack_timeout: int = 14):
        self.device = verbs.Device(device or None, port)
        try:
            gid = self.device.pick_gid(gid_index)
            self.pd = self.device.pd()
            self.cq = self.device.cq(cq_depth)
            self._passive_cq = self.device.cq(1)
        except BaseException:
            self.device.close()
            raise
        self._qp_args = {"gid_index": gid.index if gid else -1, "port": port,
                         "service_level": service_level, "traffic_class": traffic_class,
                         "retry_cnt": retry_cnt, "timeout": ack_timeout}
        self._passive: dict[tuple[str, int], verbs.QueuePair] = {}
        # QPs are made only for peers of the authenticated exchange, bounded per peer.
        self._admissions = Admissions()
        self.description = (f"verbs {self.device.name} port {port} "
                            f"gid {f'[{gid.index}] {gid}' if gid else 'none (LID)'} "
                            f"sl {service_level} tc {traffic_class}")

    def register(self, buf=None, *, addr=None, length=None, scoped=False):
        # Not scoped per request (Provider.scopes is False): see docs/security.md.
        return self.pd.mr(buf, verbs.ACCESS_RW, addr=addr, length=length)

    def register_gpu(self, addr: int, length: int, device: int):
        from dualpath import gpu

        return gpu.GpuMemoryRegion(self.pd, gpu.DeviceRange(addr, length, device))

    def connection(self, max_send_wr: int) -> Connection:
        config = verbs.QpConfig(max_send_wr=max_send_wr, **self._qp_args)
        return _VerbsConnection(self, config)

    def accept(self, peer: str, index: int, remote: bytes) -> bytes:
        self._admissions.admit(peer, index)
        qp = self._passive.get((peer, index))
        if qp is None:
            qp = self.pd.qp(self._passive_cq,
                            config=verbs.QpConfig(max_send_wr=1, **self._qp_args))
            self._passive[(peer, index)] = qp
        else:
            qp.reset()
        ours = qp.endpoint()
        qp.connect(decode_endpoint(remote))
        return encode_endpoint(ours)

    def forget(self, peer: str) -> None:
        for key in [k for k in self._passive if k[0] == peer]:
            self._passive.pop(key).close()
        self._admissions.forget(peer)

    def wait(self, timeout: float) -> list[WorkCompletion]:
        return self.cq.wait(timeout)

    def wake(self) -> None:
        pass

    def close(self) -> None:
        self._passive.clear()
        self.device.close()     # QPs, MRs, CQ and PD first (owners close children)


class _VerbsConnection(Connection):
    def __init__(self, provider: VerbsProvider, config: verbs.QpConfig):
        self.qp = provider.pd.qp(provider.cq, config=config)
        self.conn_id = self.qp.qp_num
        self.max_send_wr = config.max_send_wr
        # Built and validated once; the engine rewrites addresses/keys per post.
        self._batch = verbs.WriteBatch([verbs.Item(0, 0, 1, 0, 0)] * config.max_send_wr)
        self.items = self._batch.items

    def endpoint(self) -> bytes:
        return encode_endpoint(self.qp.endpoint())

    def connect(self, remote: bytes, timeout: float) -> None:
        self.qp.connect(decode_endpoint(remote))

    def reset(self) -> None:
        self.qp.reset()

    def post(self, count: int, signal_every: int) -> int:
        return self.qp.post_raw(self.items, count, signal_every)

    def close(self) -> None:
        self.qp.close()
