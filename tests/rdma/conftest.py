"""Real-verbs fixtures: the devices under test and connected QP pairs.

Devices come from DUALPATH_RDMA_DEV_A / DUALPATH_RDMA_DEV_B (set by the SoftRoCE guest,
tools/vm/guest.sh: rxe0 on veth0 = 10.99.0.1, rxe1 on veth1 = 10.99.0.2), else the first
two devices listed. With DUALPATH_RDMA_REQUIRED=1 (the guest, CI) a skip anywhere in
this suite is reported as a failure: a skipped RDMA test never counts as a pass.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import pytest

from dualpath import verbs

REQUIRED = os.environ.get("DUALPATH_RDMA_REQUIRED") == "1"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if REQUIRED and report.skipped:
        reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = (f"skipped under DUALPATH_RDMA_REQUIRED=1, which counts as a "
                           f"failure: {reason}")


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    # A module-level skip happens at collection, outside pytest_runtest_makereport.
    outcome = yield
    report = outcome.get_result()
    if REQUIRED and report.skipped:
        report.outcome = "failed"


def _device_names() -> list[str]:
    listed = verbs.list_devices()
    a = os.environ.get("DUALPATH_RDMA_DEV_A") or (listed[0] if listed else None)
    b = os.environ.get("DUALPATH_RDMA_DEV_B") or (listed[1] if len(listed) > 1 else None)
    return [n for n in (a, b) if n]


@pytest.fixture(scope="session")
def dev_names() -> list[str]:
    names = _device_names()
    if not names:
        pytest.skip("no RDMA device (set DUALPATH_RDMA_DEV_A or run in the SoftRoCE guest)")
    return names


@pytest.fixture
def dev_a(dev_names):
    with verbs.Device(dev_names[0]) as d:
        yield d


@pytest.fixture
def dev_b(dev_names):
    if len(dev_names) < 2:
        pytest.skip("a second RDMA device is needed (DUALPATH_RDMA_DEV_B)")
    with verbs.Device(dev_names[1]) as d:
        yield d


@dataclass
class Side:
    """One end of a test connection: its own PD, CQ, QP and a registered buffer."""

    device: verbs.Device
    pd: verbs.ProtectionDomain
    cq: verbs.WorkCompletionQueue
    qp: verbs.QueuePair
    buf: bytearray
    mr: verbs.MemoryRegion

    def item(self, peer: Side, offset: int, length: int, wr_id: int = 0,
             peer_offset: int | None = None) -> verbs.Item:
        """A WRITE of our buf[offset:offset+length] to the same (or peer_offset) place
        in the peer's buffer."""
        po = offset if peer_offset is None else peer_offset
        return verbs.Item(self.mr.addr + offset, peer.mr.addr + po, length,
                          self.mr.lkey, peer.mr.rkey, wr_id)


def make_side(device: verbs.Device, size: int, cq_depth: int = 256,
              config: verbs.QpConfig | None = None) -> Side:
    gid = device.pick_gid()
    config = config or verbs.QpConfig()
    if gid is not None and config.gid_index < 0:
        config = dataclasses.replace(config, gid_index=gid.index)
    pd = device.pd()
    cq = device.cq(cq_depth)
    qp = pd.qp(cq, config=config)
    buf = bytearray(size)
    return Side(device, pd, cq, qp, buf, pd.mr(buf))


def connect(a: Side, b: Side) -> None:
    ea, eb = a.qp.endpoint(), b.qp.endpoint()
    a.qp.connect(eb)
    b.qp.connect(ea)


def wait_retired(side: Side, n: int, timeout: float = 30.0) -> list[verbs.WorkCompletion]:
    """Completions until `n` WRs are retired (a bound, not a timed assertion: rxe under
    emulation is slow, and a lost completion must fail rather than hang)."""
    got: list[verbs.WorkCompletion] = []
    while sum(c.retired for c in got) < n:
        wcs = side.cq.wait(timeout)
        assert wcs, f"no completion within {timeout} s; retired {sum(c.retired for c in got)} of {n}"
        got += wcs
    return got


@pytest.fixture(params=["veth", "loopback"])
def pair(request, dev_names):
    """Two connected sides: rxe0<->rxe1 across the veth, or both ends on rxe0."""
    if request.param == "veth" and len(dev_names) < 2:
        pytest.skip("a second RDMA device is needed for the veth pair")
    name_b = dev_names[1] if request.param == "veth" else dev_names[0]
    with verbs.Device(dev_names[0]) as da, verbs.Device(name_b) as db:
        a, b = make_side(da, 1 << 20), make_side(db, 1 << 20)
        connect(a, b)
        yield a, b
