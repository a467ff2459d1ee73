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

Scope (docs/security.md, "The data plane's scope"): once a region is registered
``scoped``, every peer that is not trusted gets a protection domain of its own, and its
passive QPs live there. A WRITE on one of them is checked by the NIC against that PD's
memory regions only: the region's own MR (our PD) is out of its reach, and each grant
registers an MR per merged run of the granted ranges in the peer's PD, whose rkeys the
peer learns from :meth:`VerbsProvider.view` (the out-of-band exchange) and uses row by
row (``dp_items_fill_keyed``). Ungrant deregisters them: from its return the NIC refuses
that peer's WRITEs into those runs (REM_ACCESS_ERR at the writer). An unscoped region is
reached by such a peer through a whole-region MR of its PD, made when first shown to it.

Endpoints are ``struct dp_qp_endpoint`` packed little-endian: qpn, psn, lid, mtu, gid.
Tested only where a device exists (tests/rdma, the SoftRoCE guest).
"""

from __future__ import annotations

import errno
import struct

from dualpath import lane, verbs
from dualpath.dp import Access, WorkCompletion
from dualpath.errors import TransferError, UsageError
from dualpath.transfer.provider import Admissions, Connection, Provider, RegionInfo

_ENDPOINT = struct.Struct("<IIII16s")
# What a peer's MR lets it do: WRITE only (a READ would show a granted slot's earlier
# contents, another request's KV).
WINDOW = Access.LOCAL_WRITE | Access.REMOTE_WRITE


def encode_endpoint(e: verbs.Endpoint) -> bytes:
    return _ENDPOINT.pack(e.qpn, e.psn, e.lid, e.mtu, e.gid)


def decode_endpoint(data: bytes) -> verbs.Endpoint:
    if len(data) != _ENDPOINT.size:
        raise UsageError(f"not a verbs endpoint ({_ENDPOINT.size} bytes): {len(data)} bytes")
    return verbs.Endpoint(*_ENDPOINT.unpack(data))


def merge_runs(ranges, length: int) -> list[tuple[int, int]]:
    """``(offset, length)`` rows inside ``[0, length)`` as sorted, merged runs."""
    runs: list[list[int]] = []
    for off, n in sorted((int(o), int(n)) for o, n in ranges):
        if n <= 0 or off < 0 or off + n > length:
            raise UsageError(f"grant window ({off}, {n}) is not inside a region of "
                             f"{length} bytes")
        if runs and off <= runs[-1][0] + runs[-1][1]:
            runs[-1][1] = max(runs[-1][1], off + n - runs[-1][0])
        else:
            runs.append([off, n])
    return [(o, n) for o, n in runs]


class _Grant:
    """One grant: an MR per run in the peer's PD; closed by ``ungrant`` or its region."""

    __slots__ = ("mrs", "peer", "provider", "region", "runs")

    def __init__(self, provider: VerbsProvider, peer: str, region: _VerbsRegion, runs,
                 mrs):
        self.provider, self.peer, self.region = provider, peer, region
        self.runs, self.mrs = runs, mrs

    def windows(self):
        return [(o, n, mr.rkey) for (o, n), mr in zip(self.runs, self.mrs)]

    def close(self) -> None:
        mrs, self.mrs = self.mrs, []
        if not mrs:
            return
        self.region.grants.discard(self)
        self.provider._grants -= 1
        for mr in mrs:
            mr.close()


class _VerbsRegion:
    """A registered range (our PD's MR) and what other PDs hold of it: the grants' MRs
    (scoped) or whole-region MRs of scoped peers (unscoped); closing it closes them."""

    def __init__(self, mr: verbs.MemoryRegion, scoped: bool):
        self.mr, self.scoped = mr, scoped
        self.addr, self.length, self.lkey, self.rkey = mr.addr, mr.length, mr.lkey, mr.rkey
        self.grants: set[_Grant] = set()
        self.whole: dict[str, verbs.MemoryRegion] = {}      # peer -> MR in its PD

    def close(self) -> None:
        for g in list(self.grants):
            g.close()
        whole, self.whole = self.whole, {}
        for mr in whole.values():
            mr.close()
        self.mr.close()

    def __repr__(self) -> str:
        return f"<{'scoped ' if self.scoped else ''}verbs region {self.mr!r}>"


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
    scopes = True
    max_grants = 4096       # live grants (each an MR per run: NIC memory-key space)

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
        self._trusted: set[str] = set()
        self._scoping = False                       # a scoped region was registered
        self._pds: dict[str, verbs.ProtectionDomain] = {}   # untrusted peer -> its PD
        self._grants = 0
        # QPs are made only for peers of the authenticated exchange, bounded per peer.
        self._admissions = Admissions()
        self.description = (f"verbs {self.device.name} port {port} "
                            f"gid {f'[{gid.index}] {gid}' if gid else 'none (LID)'} "
                            f"sl {service_level} tc {traffic_class}")

    def register(self, buf=None, *, addr=None, length=None, scoped=False):
        if scoped and not self._scoping:
            early = sorted({p for p, _ in self._passive if p not in self._trusted})
            if early:
                raise UsageError("register scoped regions before peers connect: "
                                 f"{', '.join(early)} already write through our PD")
            self._scoping = True
        return _VerbsRegion(self.pd.mr(buf, verbs.ACCESS_RW, addr=addr, length=length),
                            scoped)

    def _pd(self, peer: str) -> verbs.ProtectionDomain:
        """The PD ``peer``'s passive QPs and windows live in: ours for a trusted peer
        or while nothing is scoped, else one of its own."""
        if peer in self._trusted or not self._scoping:
            return self.pd
        pd = self._pds.get(peer)
        if pd is None:
            self._admissions.tag(peer)              # bounded like the admissions
            pd = self._pds[peer] = self.device.pd()
        return pd

    def grant(self, peer: str, region, ranges):
        if not isinstance(region, _VerbsRegion) or not region.scoped:
            return None
        runs = merge_runs(ranges, region.length)
        pd = self._pd(peer)
        if pd is self.pd or not runs:
            return None                             # trusted: it reaches every byte
        if self._grants >= self.max_grants:
            raise TransferError(f"{self._grants} grants live (at most {self.max_grants}); "
                                f"refusing one for {peer!r}", errno=errno.ENOSPC)
        mrs: list[verbs.MemoryRegion] = []
        try:
            for off, n in runs:
                mrs.append(pd.mr(None, WINDOW, addr=region.addr + off, length=n))
        except BaseException:
            for mr in mrs:
                mr.close()
            raise
        g = _Grant(self, peer, region, runs, mrs)
        region.grants.add(g)
        self._grants += 1
        return g

    def ungrant(self, grant) -> None:
        if grant is not None:
            grant.close()

    def view(self, peer: str, region) -> RegionInfo:
        pd = self._pd(peer)
        if pd is self.pd or not isinstance(region, _VerbsRegion):
            # Trusted, nothing scoped, or device memory (reached from our PD only).
            return RegionInfo(region.addr, region.length, region.rkey)
        if region.scoped:
            windows = sorted(w for g in region.grants if g.peer == peer
                             for w in g.windows())
            return RegionInfo(region.addr, region.length, region.rkey, tuple(windows), True)
        mr = region.whole.get(peer)
        if mr is None:
            mr = region.whole[peer] = pd.mr(None, WINDOW, addr=region.addr,
                                            length=region.length)
        return RegionInfo(region.addr, region.length, mr.rkey)

    def trust(self, peer: str) -> None:
        self._trusted.add(peer)

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
            qp = self._pd(peer).qp(self._passive_cq,
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
