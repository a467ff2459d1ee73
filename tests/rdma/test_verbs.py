"""Real verbs through dualpath.verbs: devices, lifecycle, WRITEs, batching, credits, errors.

Run in the SoftRoCE guest (`make vm CMD='.venv/bin/python -m pytest tests/rdma -q'`):
rxe0 on veth0 (10.99.0.1) and rxe1 on veth1 (10.99.0.2), see tools/vm/guest.sh.
"""

from __future__ import annotations

import errno
import os

import pytest

from dualpath import clock, verbs
from dualpath._native import lib
from dualpath.errors import RdmaError, UsageError
from tests.rdma.conftest import REQUIRED, Side, connect, make_side, wait_retired

KIB = 1024


def pattern(n: int, seed: int) -> bytes:
    return bytes((i * 7 + seed) & 0xFF for i in range(n))


def loopback(dev: verbs.Device, size: int = 1 << 20, **kw) -> tuple[Side, Side]:
    a, b = make_side(dev, size, **kw), make_side(dev, size, **kw)
    connect(a, b)
    return a, b


# ------------------------------------------------------------------ device


def test_device_port_active_and_ipv4_mapped_gid(dev_names):
    assert dev_names[0] in verbs.list_devices()
    with verbs.Device(dev_names[0]) as dev:
        assert dev.name == dev_names[0]
        attrs = dev.port_attrs()
        assert attrs.active, attrs
        assert attrs.active_mtu in (256, 512, 1024, 2048, 4096)
        gid = dev.pick_gid()
        assert gid is not None and gid.roce_v2 and gid.ipv4 is not None, dev.gids()
        if REQUIRED:
            # The guest's addressing (tools/vm/guest.sh) and ../shared/softroce.md: rxe is
            # Ethernet, GID 1 is the IPv4-mapped RoCE v2 one, ::ffff:10.99.0.1 on rxe0.
            assert attrs.is_ethernet
            assert gid.index == 1
            assert gid.ipv4 == os.environ["DUALPATH_RDMA_IP_A"]
            assert str(gid) == "::ffff:" + os.environ["DUALPATH_RDMA_IP_A"]
        assert dev.pick_gid(gid.index) == gid


def test_open_first_active_device_when_no_name(dev_names):
    with verbs.Device() as dev:
        assert dev.name in verbs.list_devices()
        assert dev.port_attrs().active


def test_open_unknown_device_is_enodev():
    with pytest.raises(RdmaError) as ei:
        verbs.Device("no-such-rdma-device")
    assert ei.value.errno == errno.ENODEV   # dp_ctx_open: no device by that name


def test_gid_query_past_table_is_enodata(dev_a):
    n = dev_a.port_attrs().gid_tbl_len
    with pytest.raises(RdmaError) as ei:
        dev_a.gid(n)
    assert ei.value.errno == errno.ENODATA   # dp.h: dp_gid_query past the table


# ------------------------------------------------------------------ lifecycle


def test_close_is_idempotent_and_parent_closes_children_first(dev_names):
    dev = verbs.Device(dev_names[0])
    pd = dev.pd()
    cq = dev.cq(16)
    mr1 = pd.mr(bytearray(4 * KIB))
    qp = pd.qp(cq)
    mr2 = pd.mr(bytearray(4 * KIB))

    # The C layer refuses to free a parent with live children ...
    assert lib.dp_pd_free(pd._handle) == -errno.EBUSY
    assert lib.dp_cq_destroy(cq._handle) == -errno.EBUSY
    assert lib.dp_ctx_close(dev._handle) == -errno.EBUSY

    order = []

    def recorded(name, destroy):
        def run():
            order.append(name)
            return destroy()
        return run

    for name, obj in [("dev", dev), ("pd", pd), ("cq", cq), ("mr1", mr1), ("qp", qp),
                      ("mr2", mr2)]:
        obj._destroy = recorded(name, obj._destroy)
    mr1.close()
    mr1.close()
    assert mr1.closed and order == ["mr1"]
    # ... so the device closes its children newest first, each of them theirs first:
    # the CQ (created after the PD) takes its QP with it, then the PD its MR.
    dev.close()
    assert order == ["mr1", "qp", "cq", "mr2", "pd", "dev"]
    assert all(o.closed for o in (dev, pd, cq, qp, mr2))
    dev.close()
    qp.close()
    assert order == ["mr1", "qp", "cq", "mr2", "pd", "dev"]
    with pytest.raises(UsageError):
        dev.pd()
    with pytest.raises(UsageError):
        _ = qp.state


def test_with_blocks_and_closed_state(dev_a):
    with dev_a.pd() as pd, dev_a.cq(8) as cq, pd.qp(cq) as qp, pd.mr(bytearray(64)) as mr:
        assert qp.state == verbs.QpState.RESET
        assert mr.length == 64 and mr.lkey != 0
    assert pd.closed and cq.closed and qp.closed and mr.closed


# ------------------------------------------------------------------ WRITE


def test_one_write_each_way_bytes_verified(pair):
    a, b = pair
    data = pattern(4 * KIB, seed=1)
    a.buf[:len(data)] = data
    assert a.qp.post_write([a.item(b, 0, len(data), wr_id=11)]) == 1
    (wc,) = wait_retired(a, 1)
    assert wc.ok and wc.wr_id == 11 and wc.retired == 1 and wc.qp_num == a.qp.qp_num
    assert bytes(b.buf[:len(data)]) == data

    back = pattern(4 * KIB, seed=2)
    b.buf[8 * KIB:8 * KIB + len(back)] = back
    assert b.qp.post_write([b.item(a, 8 * KIB, len(back), wr_id=12)]) == 1
    (wc,) = wait_retired(b, 1)
    assert wc.ok and wc.wr_id == 12
    assert bytes(a.buf[8 * KIB:8 * KIB + len(back)]) == back
    assert a.qp.outstanding == 0 and b.qp.outstanding == 0


def test_batch_of_64_signal_every_16_retires_exactly_64(pair):
    a, b = pair
    size = 4 * KIB
    a.buf[:64 * size] = pattern(64 * size, seed=3)
    batch = verbs.WriteBatch([a.item(b, i * size, size, wr_id=i) for i in range(64)])
    assert a.qp.post_write(batch, signal_every=16) == 64
    assert a.qp.outstanding == 64
    wcs = wait_retired(a, 64)
    # Every 16th WR is signalled (and the batch's last, here also the 64th): items 15,
    # 31, 47, 63, each retiring itself and the 15 unsignalled ones before it.
    assert [w.wr_id for w in wcs] == [15, 31, 47, 63]
    assert [w.retired for w in wcs] == [16] * 4 and all(w.ok for w in wcs)
    assert a.qp.outstanding == 0
    assert bytes(b.buf[:64 * size]) == bytes(a.buf[:64 * size])


def test_signal_count_carries_across_posts_and_last_is_signalled(dev_a):
    a, b = loopback(dev_a)
    items = [a.item(b, i * 64, 64, wr_id=i) for i in range(10)]
    # signal_every=4 counts across posts and restarts after every signal: the first post
    # of 3 ends signalled (its last), then WR 6 is the 4th after it and WR 9 the last.
    assert a.qp.post_write(items, signal_every=4, count=3) == 3
    assert a.qp.post_write(items, signal_every=4, start=3) == 7
    wcs = wait_retired(a, 10)
    assert [(w.wr_id, w.retired) for w in wcs] == [(2, 3), (6, 4), (9, 3)]


def test_unsignalled_last_streams_single_posts_until_the_count_or_a_full_qp(dev_a):
    a, b = loopback(dev_a, config=verbs.QpConfig(max_send_wr=8))
    batch = verbs.WriteBatch([a.item(b, i * 64, 64, wr_id=i) for i in range(16)])
    for i in range(16):
        batch.items[i].flags = lib.DP_ITEM_UNSIGNALLED_LAST
    # Single-WR posts, signal_every 4, no forced signal on each post's last: only the 4th
    # is signalled; then one post without the flag ends signalled (dp.h).
    for i in range(6):
        assert a.qp.post_write(batch, signal_every=4, start=i, count=1) == 1
    batch.items[6].flags = 0
    assert a.qp.post_write(batch, signal_every=4, start=6, count=1) == 1
    wcs = wait_retired(a, 7)
    assert [(w.wr_id, w.retired) for w in wcs] == [(3, 4), (6, 3)]
    # signal_every 100 > max_send_wr 8: the post that fills the QP is signalled anyway,
    # or nothing could ever retire the other seven.
    for i in range(8):
        assert a.qp.post_write(batch, signal_every=100, start=8 + i, count=1) == 1
    assert a.qp.outstanding == 8
    wcs = wait_retired(a, 8)
    assert [(w.wr_id, w.retired) for w in wcs] == [(15, 8)]
    assert a.qp.outstanding == 0


def test_poll_array_is_numpy_structured(dev_a):
    a, b = loopback(dev_a)
    assert a.qp.post_write([a.item(b, i * 64, 64, wr_id=40 + i) for i in range(8)],
                           signal_every=4) == 8
    got = []
    deadline = clock.now() + 30     # a bound against a hang, not a timing assertion
    while sum(int(r) for arr in got for r in arr["retired"]) < 8 and clock.now() < deadline:
        got.append(a.cq.poll_array())
    rows = [tuple(int(x) for x in row) for arr in got for row in arr]
    # Signalled: the 4th (wr_id 43) and the 8th, also the batch's last (47).
    assert rows == [(43, 0, a.qp.qp_num, 4, 0), (47, 0, a.qp.qp_num, 4, 0)]
    assert got[0].dtype == verbs.wc_dtype()


# ------------------------------------------------------------------ credits


def test_qp_credit_partial_post_then_rest_after_polling(dev_a):
    a, b = loopback(dev_a, config=verbs.QpConfig(max_send_wr=16))
    size = 1 * KIB
    a.buf[:40 * size] = pattern(40 * size, seed=4)
    batch = verbs.WriteBatch([a.item(b, i * size, size, wr_id=i) for i in range(40)])
    sent = a.qp.post_write(batch, signal_every=4)
    assert sent == 16                  # max_send_wr: the -EAGAIN partial result
    assert a.qp.outstanding == 16
    assert a.qp.post_write(batch, signal_every=4, start=sent) == 0   # still no credit
    retired = 0
    while sent < 40:
        wcs = wait_retired(a, 1)
        retired += sum(w.retired for w in wcs)
        assert a.qp.outstanding == sent - retired
        sent += a.qp.post_write(batch, signal_every=4, start=sent)
        assert a.qp.outstanding <= 16
    wait_retired(a, 40 - retired)
    assert a.qp.outstanding == 0
    assert bytes(b.buf[:40 * size]) == bytes(a.buf[:40 * size])


def test_cq_depth_bounds_signalled_wrs(dev_a):
    a, b = loopback(dev_a, cq_depth=2, config=verbs.QpConfig(max_send_wr=64))
    items = verbs.WriteBatch([a.item(b, i * 64, 64, wr_id=i) for i in range(40)])
    # CQ depth 2 = two signalled WRs outstanding; signal_every=4 -> 2 * 4 = 8 WRs.
    assert a.qp.post_write(items, signal_every=4) == 8
    assert a.qp.post_write(items, signal_every=4, start=8) == 0
    wcs = wait_retired(a, 8)
    assert [(w.wr_id, w.retired) for w in wcs] == [(3, 4), (7, 4)]
    assert a.qp.post_write(items, signal_every=4, start=8) == 8


def test_signal_count_left_by_a_larger_signal_every_still_bounds_the_cq(dev_a):
    a, b = loopback(dev_a, cq_depth=2, config=verbs.QpConfig(max_send_wr=16))
    batch = verbs.WriteBatch([a.item(b, i * 64, 64, wr_id=i) for i in range(16)])
    for i in range(3):
        batch.items[i].flags = lib.DP_ITEM_UNSIGNALLED_LAST
    # Three unsignalled WRs under signal_every 100, then signal_every 1: every WR of the
    # next post signals, so CQ depth 2 admits exactly 2 of them (dp.h credits); the
    # count of 3 carried over must not wrap the CQ bound into "no bound".
    for i in range(3):
        assert a.qp.post_write(batch, signal_every=100, start=i, count=1) == 1
    assert a.qp.post_write(batch, signal_every=1, start=3) == 2
    wcs = wait_retired(a, 5)
    assert [(w.wr_id, w.retired) for w in wcs] == [(3, 4), (4, 1)]


def test_wait_with_an_endless_timeout_waits(dev_a):
    a, b = loopback(dev_a, size=32 << 20)
    # One 32 MiB WRITE: rxe needs far longer than one poll for it, so the wait's first
    # poll finds nothing. INT64_MAX ns ("for ever") must not wrap the deadline into the
    # past and return 0 then; dp_cq_wait returns once the completion is there.
    assert a.qp.post_write([a.item(b, 0, 32 << 20, wr_id=7)]) == 1
    n = lib.dp_cq_wait(a.cq._handle, a.cq.wc, 1, (1 << 63) - 1)
    assert n == 1 and a.cq.completions(1)[0].wr_id == 7
    # The Python layer takes a timeout beyond int64 ns (or inf) as that same bound.
    assert a.qp.post_write([a.item(b, 64, 64, wr_id=8)]) == 1
    assert [w.wr_id for w in a.cq.wait(float("inf"))] == [8]


# ------------------------------------------------------------------ forced errors


def test_post_on_unconnected_qp_is_einval(dev_a):
    side = make_side(dev_a, 4 * KIB)
    assert side.qp.state == verbs.QpState.RESET
    with pytest.raises(verbs.PostError) as ei:
        side.qp.post_write([side.item(side, 0, 64)])
    # dp_qp_post_write's own guard (a QP not in RTS): EINVAL, what rxe's kernel
    # rxe_post_send answers for a QP not yet ready (see test_pyverbs_crosscheck).
    assert ei.value.errno == errno.EINVAL
    assert isinstance(ei.value, RdmaError)
    assert ei.value.posted == 0 and ei.value.not_posted == 1
    assert side.qp.outstanding == 0


def test_register_unmapped_range_is_efault(dev_a):
    with dev_a.pd() as pd:
        with pytest.raises(RdmaError) as ei:
            pd.mr(addr=0x1000, length=1 << 20)   # page 1: never mapped in a process
        # ib_umem_get cannot pin the pages: the kernel's EFAULT, through ibv_reg_mr.
        assert ei.value.errno == errno.EFAULT, ei.value
        with pytest.raises(RdmaError) as ei:
            pd.mr(addr=1 << 63, length=1 << 63)   # addr + length wraps around
        assert ei.value.errno == errno.EINVAL, ei.value


def test_usage_errors_before_any_call(dev_a):
    with dev_a.pd() as pd, dev_a.cq(4) as cq, pd.qp(cq) as qp:
        with pytest.raises(UsageError):
            qp.post_write([(0, 0, 0, 0, 0)])             # length 0
        with pytest.raises(UsageError):
            qp.post_write([(0, 0, 1, 0, 0)], signal_every=0)
        with pytest.raises(UsageError):
            pd.mr(bytearray())
        with pytest.raises(UsageError):
            pd.mr(b"read-only", verbs.Access.REMOTE_WRITE)
        with pytest.raises(UsageError):
            cq.poll(5)                                   # more than the CQ's array
        # Each of these reached cffi (OverflowError), not a UsageError, before the checks.
        with pytest.raises(UsageError, match="port"):
            dev_a.gid(0, port=256)                       # dp_gid_query's port is uint8_t
        with pytest.raises(UsageError, match="mtu"):
            qp.connect(verbs.Endpoint(1, 1, 0, 1 << 32))  # dp_qp_endpoint.mtu is uint32_t
        with pytest.raises(UsageError, match="length"):
            pd.mr(addr=(1 << 64) - 8, length=16)         # addr + length past 2**64


def test_remote_access_error_then_reset_and_reconnect(dev_a):
    a, b = loopback(dev_a)
    good = a.item(b, 0, 64, wr_id=1)
    bad = good._replace(rkey=b.mr.rkey ^ 0x5A5A00, wr_id=0)
    items = [bad] + [good._replace(wr_id=i) for i in (1, 2, 3)]
    assert a.qp.post_write(items, signal_every=8) == 4
    wcs = wait_retired(a, 4)
    # rxe completes the failed WR with REM_ACCESS_ERR and flushes the rest, signalled or
    # not, with WR_FLUSH_ERR; each retires exactly itself.
    assert wcs[0].status == verbs.WcStatus.REM_ACCESS_ERR and wcs[0].wr_id == 0
    assert wcs[0].retired == 1
    assert all(w.status == verbs.WcStatus.WR_FLUSH_ERR for w in wcs[1:])
    assert sum(w.retired for w in wcs) == 4 and a.qp.outstanding == 0
    assert a.qp.state == verbs.QpState.ERR

    for s in (a, b):
        s.qp.reset()
        assert s.qp.state == verbs.QpState.RESET
    connect(a, b)
    a.buf[:64] = pattern(64, seed=5)
    assert a.qp.post_write([good._replace(wr_id=99)]) == 1
    (wc,) = wait_retired(a, 1)
    assert wc.ok and wc.wr_id == 99
    assert bytes(b.buf[:64]) == bytes(a.buf[:64])


def test_reset_discards_completions_posted_before_it(dev_a):
    a, b = loopback(dev_a)
    old = verbs.WriteBatch([a.item(b, i * 64, 64, wr_id=i) for i in range(32)])
    assert a.qp.post_write(old, signal_every=8) == 32
    a.qp.reset()                       # no poll: their completions may sit in the CQ
    b.qp.reset()
    assert a.qp.outstanding == 0
    connect(a, b)
    new = verbs.WriteBatch([a.item(b, i * 64, 64, wr_id=100 + i) for i in range(8)])
    assert a.qp.post_write(new, signal_every=8) == 8
    wcs = wait_retired(a, 8)
    assert [(w.wr_id, w.retired, w.status) for w in wcs] == [(107, 8, 0)]
    assert a.cq.poll() == [] and a.qp.outstanding == 0
