"""Cross-check against an independent verbs implementation: rdma-core's pyverbs.

pyverbs owns one end (its own Context, PD, MR, CQ and RC QP, moved to RTS with its own
calls) and dualpath.verbs the other; an RDMA WRITE goes each way and the bytes are
verified on both sides. pyverbs is Debian's python3-pyverbs, outside the venv.
"""

from __future__ import annotations

import errno
import sys

import pytest

from dualpath import clock, verbs
from tests.rdma.conftest import make_side, wait_retired

if "/usr/lib/python3/dist-packages" not in sys.path:
    sys.path.append("/usr/lib/python3/dist-packages")
pyverbs = pytest.importorskip("pyverbs", reason="python3-pyverbs is not installed")

import pyverbs.enums as e
from pyverbs.addr import GID, AHAttr, GlobalRoute
from pyverbs.cq import CQ
from pyverbs.device import Context
from pyverbs.mr import MR
from pyverbs.pd import PD
from pyverbs.pyverbs_error import PyverbsRDMAError
from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
from pyverbs.wr import SGE, SendWR

SIZE = 64 * 1024
PV_PSN = 0x1234
MTU_ENUM = {256: e.IBV_MTU_256, 512: e.IBV_MTU_512, 1024: e.IBV_MTU_1024,
            2048: e.IBV_MTU_2048, 4096: e.IBV_MTU_4096}


def gid_str(raw: bytes) -> str:
    return ":".join(raw.hex()[i:i + 4] for i in range(0, 32, 4))


class PyverbsEnd:
    """One RC end built entirely by pyverbs."""

    def __init__(self, name: str, gid_index: int):
        self.ctx = Context(name=name)
        self.pd = PD(self.ctx)
        self.mr = MR(self.pd, SIZE, e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE)
        self.cq = CQ(self.ctx, 16)
        cap = QPCap(max_send_wr=16, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
        self.qp = QP(self.pd, QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq,
                                          cap=cap))
        self.gid_index = gid_index
        self.port = self.ctx.query_port(1)

    def endpoint(self) -> verbs.Endpoint:
        raw = bytes.fromhex(str(self.ctx.query_gid(1, self.gid_index)).replace(":", ""))
        mtu = 128 << int(self.port.active_mtu)
        return verbs.Endpoint(self.qp.qp_num, PV_PSN, self.port.lid, mtu, raw)

    def to_rts(self, remote: verbs.Endpoint) -> None:
        attr = QPAttr(port_num=1)
        attr.qp_access_flags = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE
        attr.path_mtu = MTU_ENUM[min(remote.mtu, 128 << int(self.port.active_mtu))]
        attr.dest_qp_num = remote.qpn
        attr.rq_psn = remote.psn
        attr.sq_psn = PV_PSN
        attr.max_dest_rd_atomic = attr.max_rd_atomic = 1
        attr.min_rnr_timer = 12
        attr.timeout, attr.retry_cnt, attr.rnr_retry = 14, 7, 7
        gr = GlobalRoute(dgid=GID(gid_str(remote.gid)), sgid_index=self.gid_index)
        attr.ah_attr = AHAttr(port_num=1, is_global=1, gr=gr, dlid=remote.lid)
        self.qp.to_rts(attr)

    def write(self, length: int, remote_addr: int, rkey: int, wr_id: int) -> None:
        sge = SGE(self.mr.buf, length, self.mr.lkey)
        wr = SendWR(wr_id=wr_id, opcode=e.IBV_WR_RDMA_WRITE, num_sge=1, sg=[sge],
                    send_flags=e.IBV_SEND_SIGNALED)
        wr.set_wr_rdma(rkey, remote_addr)
        self.qp.post_send(wr)

    def wait_one(self, timeout: float = 30.0):
        deadline = clock.now() + timeout
        while clock.now() < deadline:
            n, wcs = self.cq.poll()
            if n:
                return wcs[0]
        raise AssertionError(f"pyverbs: no completion within {timeout} s")

    def close(self) -> None:
        for obj in (self.qp, self.cq, self.mr, self.pd, self.ctx):
            obj.close()


@pytest.fixture
def ends(dev_names):
    """Ours on the first device, pyverbs on the second (across the veth) if present."""
    pv_name = dev_names[1] if len(dev_names) > 1 else dev_names[0]
    with verbs.Device(dev_names[0]) as dev, verbs.Device(pv_name) as pv_dev:
        gid_index = pv_dev.pick_gid().index
        pv = PyverbsEnd(pv_name, gid_index)
        ours = make_side(dev, SIZE)
        try:
            yield ours, pv
        finally:
            ours.qp.close()
            pv.close()


def test_write_each_way_between_dualpath_and_pyverbs(ends):
    ours, pv = ends
    pv.to_rts(ours.qp.endpoint())
    ours.qp.connect(pv.endpoint())
    assert ours.qp.state == verbs.QpState.RTS

    # dualpath -> pyverbs
    data = bytes((i * 13 + 5) & 0xFF for i in range(SIZE // 2))
    ours.buf[:len(data)] = data
    item = verbs.Item(ours.mr.addr, pv.mr.buf, len(data), ours.mr.lkey, pv.mr.rkey, 21)
    assert ours.qp.post_write([item]) == 1
    (wc,) = wait_retired(ours, 1)
    assert wc.ok and wc.wr_id == 21
    assert pv.mr.read(len(data), 0) == data

    # pyverbs -> dualpath, into the second half of our buffer
    back = bytes((i * 3 + 1) & 0xFF for i in range(SIZE // 2))
    pv.mr.write(back, len(back), 0)
    pv.write(len(back), ours.mr.addr + SIZE // 2, ours.mr.rkey, wr_id=22)
    wc = pv.wait_one()
    assert wc.status == e.IBV_WC_SUCCESS and wc.wr_id == 22
    assert bytes(ours.buf[SIZE // 2:]) == back


def test_raw_post_on_reset_qp_errno_matches_ours(dev_names):
    """What ibv_post_send itself answers on rxe for a QP in RESET, beside what
    dp_qp_post_write's guard answers (EINVAL, test_verbs)."""
    pv = PyverbsEnd(dev_names[0], 1)
    try:
        with pytest.raises(PyverbsRDMAError) as ei:
            pv.write(64, pv.mr.buf, pv.mr.rkey, wr_id=1)
        assert ei.value.error_code == errno.EINVAL, ei.value
    finally:
        pv.close()
