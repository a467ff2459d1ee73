"""dualpath.verbs where the host has no RDMA device (our dev and CI hosts: no
CONFIG_INFINIBAND), and the argument checks that need no device at all."""

from __future__ import annotations

import errno

import pytest

from dualpath import verbs
from dualpath._native import ffi, lib
from dualpath.errors import RdmaError, UsageError


def test_unknown_device_name_is_enodev():
    # dp_ctx_open: no device has that name (true on every host).
    with pytest.raises(RdmaError) as ei:
        verbs.Device("no-such-rdma-device")
    assert ei.value.errno == errno.ENODEV


def test_no_devices_means_empty_list_and_enodev():
    if verbs.list_devices():
        pytest.skip(f"this host has RDMA devices {verbs.list_devices()}; "
                    "the no-device path cannot be seen here")
    assert lib.dp_device_list(ffi.NULL, 0, 0) == 0
    with pytest.raises(RdmaError) as ei:
        verbs.Device()
    assert ei.value.errno == errno.ENODEV   # dp_ctx_open: no device with an ACTIVE port


def test_null_handles_are_einval():
    # Mechanism-level guards: a NULL handle never reaches libibverbs.
    assert lib.dp_ctx_close(ffi.NULL) == -errno.EINVAL
    assert lib.dp_pd_free(ffi.NULL) == -errno.EINVAL
    assert lib.dp_cq_destroy(ffi.NULL) == -errno.EINVAL
    assert lib.dp_qp_destroy(ffi.NULL) == -errno.EINVAL
    assert lib.dp_mr_dereg(ffi.NULL) == -errno.EINVAL
    n = ffi.new("uint32_t *", 7)
    assert lib.dp_qp_post_write(ffi.NULL, ffi.NULL, 0, 1, n) == -errno.EINVAL
    assert n[0] == 0
    assert lib.dp_cq_poll(ffi.NULL, ffi.NULL, 0) == -errno.EINVAL
    assert lib.dp_pd_alloc(ffi.NULL) == ffi.NULL and ffi.errno == errno.EINVAL


def test_dmabuf_flag_is_a_build_time_boolean():
    assert lib.dp_has_dmabuf() in (0, 1)


def test_struct_layouts_shared_with_the_tcp_provider():
    # csrc/verbs_ctl.c static_asserts the same sizes; the TCP provider relies on them.
    assert ffi.sizeof("struct dp_item") == 40
    assert ffi.sizeof("struct dp_wc") == 24
    assert verbs.wc_dtype().itemsize == 24


@pytest.mark.parametrize("field,value", [
    ("max_send_wr", 0), ("max_send_wr", 65537), ("path_mtu", 1000), ("service_level", 16),
    ("traffic_class", 256), ("gid_index", -2), ("retry_cnt", 8), ("port", 0),
])
def test_qp_config_rejects_out_of_range(field, value):
    with pytest.raises(UsageError, match=field):
        verbs.QpConfig(**{field: value})


def test_write_batch_rejects_bad_items():
    with pytest.raises(UsageError, match=r"items\[1\].length"):
        verbs.WriteBatch([(0, 0, 1, 0, 0), (0, 0, 0, 0, 0)])
    with pytest.raises(UsageError, match="rkey"):
        verbs.WriteBatch([(0, 0, 1, 0, 1 << 32)])
    assert len(verbs.WriteBatch([verbs.Item(1, 2, 3, 4, 5, 6)])) == 1


def test_gid_ipv4_mapping():
    g = verbs.Gid(1, bytes.fromhex("00000000000000000000ffff0a630001"), 1)
    assert g.ipv4 == "10.99.0.1" and g.roce_v2 and str(g) == "::ffff:10.99.0.1"
    link_local = verbs.Gid(0, bytes.fromhex("fe800000000000000000000000000001"), 1)
    assert link_local.ipv4 is None


def test_memory_range_checks_and_keeps_the_buffer():
    buf = bytearray(b"abcd")
    keep, ptr, n = verbs.memory_range(buf, verbs.ACCESS_RW, addr=None, length=None)
    assert n == 4 and ffi.buffer(ptr, 4)[:] == b"abcd" and keep is not None
    keep, ptr, n = verbs.memory_range(None, verbs.Access.LOCAL_WRITE, addr=0x1000, length=8)
    assert keep is None and int(ffi.cast("uintptr_t", ptr)) == 0x1000 and n == 8
    with pytest.raises(UsageError, match="read-only|writable"):
        verbs.memory_range(b"ro", verbs.Access.REMOTE_WRITE, addr=None, length=None)
    with pytest.raises(UsageError, match="empty"):
        verbs.memory_range(bytearray(), verbs.ACCESS_RW, addr=None, length=None)
    with pytest.raises(UsageError, match="either"):
        verbs.memory_range(buf, verbs.ACCESS_RW, addr=0x1000, length=8)
    with pytest.raises(UsageError, match="access"):
        verbs.memory_range(buf, 0x100, addr=None, length=None)


def test_timeout_ns_saturates_at_the_c_bound():
    from dualpath._owner import MAX_TIMEOUT_NS, timeout_ns

    assert timeout_ns(1.5) == 1_500_000_000 and timeout_ns(0) == 0
    # dp_cq_wait / dp_tcp_cq_wait / dp_tcp_conn_connect take int64 ns (dp.h): anything
    # beyond (1e10 s = 1e19 ns > 2**63 - 1, or inf) is that bound, not an OverflowError.
    assert timeout_ns(1e10) == MAX_TIMEOUT_NS == (1 << 63) - 1
    assert timeout_ns(float("inf")) == MAX_TIMEOUT_NS
    for bad in (-1, float("nan")):
        with pytest.raises(UsageError, match="timeout"):
            timeout_ns(bad)


def test_memory_range_refuses_a_range_that_wraps_past_2_to_the_64():
    # [2**64 - 8, 2**64 + 8) is no range at all; it is refused before any C call.
    with pytest.raises(UsageError, match="length"):
        verbs.memory_range(None, verbs.ACCESS_RW, addr=(1 << 64) - 8, length=16)
    n = verbs.memory_range(None, verbs.ACCESS_RW, addr=(1 << 64) - 8, length=8)[2]
    assert n == 8
