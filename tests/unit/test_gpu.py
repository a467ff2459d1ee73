"""dualpath.gpu: GPU memory registered as RDMA MRs (dma-buf first, peer memory second).

The pure parts (probe's reason, dma-buf export arguments and driver errors) run
everywhere against a recording fake driver. The ``gpu`` tests need cupy and a GPU (and,
for the RDMA WRITE into GPU memory, an RDMA device): elsewhere they skip naming what is
missing. They live outside tests/rdma so the SoftRoCE guest, which has no GPU, never
counts their skips as failures.
"""

from __future__ import annotations

import errno
import os

import pytest

from dualpath import gpu, verbs
from dualpath.errors import RdmaError, UsageError

PAGE = os.sysconf("SC_PAGE_SIZE")


class FakeDriver:
    """Records export calls; answers like a driver with or without dma-buf support."""

    def __init__(self, supported: bool = True, fd: int = 42):
        self.supported, self.fd, self.calls = supported, fd, []

    def dmabuf_supported(self, device: int) -> bool:
        self.calls.append(("supported", device))
        return self.supported

    def export_dmabuf(self, ptr: int, nbytes: int) -> int:
        self.calls.append(("export", ptr, nbytes))
        return self.fd


def test_probe_says_why_gpu_memory_is_unavailable():
    p = gpu.probe()
    try:
        import cupy  # noqa: F401
    except ImportError:
        assert not p.usable and "cupy is not installed" in p.reason
        with pytest.raises(UsageError, match="GPU memory is not available: cupy is not"):
            gpu.GpuBuffer(PAGE)
        return
    assert p.reason     # usable or not, it says which device or why not


def test_export_dmabuf_asks_the_driver_for_the_exact_page_aligned_range():
    d = FakeDriver()
    assert gpu.export_dmabuf(0x7F0000000000, 4 * PAGE, device=1, driver=d) == 42
    assert d.calls == [("supported", 1), ("export", 0x7F0000000000, 4 * PAGE)]


@pytest.mark.parametrize("ptr,nbytes", [(0x7F0000000000 + 512, PAGE), (0x7F0000000000, 100),
                                        (0x7F0000000000, 0)])
def test_export_dmabuf_refuses_unaligned_ranges_before_calling_the_driver(ptr, nbytes):
    d = FakeDriver()
    with pytest.raises(UsageError, match="page-aligned"):
        gpu.export_dmabuf(ptr, nbytes, driver=d)
    assert d.calls == []


def test_export_dmabuf_without_driver_support_is_eopnotsupp_with_reason():
    with pytest.raises(RdmaError) as ei:
        gpu.export_dmabuf(0x7F0000000000, PAGE, driver=FakeDriver(supported=False))
    assert ei.value.errno == errno.EOPNOTSUPP
    assert "DMA_BUF_SUPPORTED" in str(ei.value)


@pytest.mark.parametrize("kw", [{"signal_every": 0}, {"max_send_wr": 0}])
def test_local_copier_checks_its_arguments_before_opening_a_device(kw):
    # signal_every 0 used to open the device and fail only at the first copy's post
    # (dp_qp_post_write's EINVAL); no device is needed to refuse it.
    with pytest.raises(UsageError, match=next(iter(kw))):
        gpu.LocalRdmaCopier(**kw)


def test_gpu_memory_region_rejects_an_unknown_registration_method():
    class Closed:
        closed = False
    with pytest.raises(UsageError, match="prefer must be"):
        gpu.GpuMemoryRegion(None, Closed(), prefer="nvlink")


# ------------------------------------------------------------------ real GPU


def _need_gpu():
    p = gpu.probe()
    if not p.usable:
        pytest.skip(f"needs cupy and a GPU: {p.reason}")


def _need_rdma() -> str:
    names = verbs.list_devices()
    if not names:
        pytest.skip("needs an RDMA device (none listed): GPU memory is registered on a NIC")
    return os.environ.get("DUALPATH_RDMA_DEV_A") or names[0]


@pytest.mark.gpu
def test_gpu_buffer_is_page_aligned_and_round_trips_through_cupy():
    _need_gpu()
    import cupy

    with gpu.GpuBuffer(PAGE + 1) as buf:
        assert buf.nbytes == 2 * PAGE and buf.ptr % PAGE == 0
        data = os.urandom(buf.nbytes)
        buf.array()[:] = cupy.frombuffer(data, dtype=cupy.uint8)
        assert cupy.asnumpy(buf.array()).tobytes() == data
    assert buf.closed


@pytest.mark.gpu
def test_dmabuf_export_of_a_real_allocation_gives_an_fd_or_says_why_not():
    _need_gpu()
    with gpu.GpuBuffer(1 << 20) as buf:
        try:
            fd = gpu.export_dmabuf(buf.ptr, buf.nbytes)
        except RdmaError as e:
            assert e.errno == errno.EOPNOTSUPP and str(e)
            pytest.skip(f"this GPU/driver cannot export dma-buf: {e}")
        try:
            assert fd >= 0 and os.fstat(fd).st_size in (0, buf.nbytes)
        finally:
            os.close(fd)


@pytest.mark.gpu
def test_host_to_gpu_copy_is_an_rdma_write_into_the_gpus_mr():
    _need_gpu()
    dev = _need_rdma()
    import cupy

    size = 1 << 20
    host = bytearray(os.urandom(size))
    with gpu.GpuBuffer(size) as buf, gpu.LocalRdmaCopier(dev) as copier:
        try:
            gmr = copier.register_gpu(buf)
        except RdmaError as e:
            pytest.skip(f"{dev} cannot register GPU memory (dma-buf or peer memory): {e}")
        hmr = copier.register_host(host)
        assert gmr.kind in ("dmabuf", "peermem") and gmr.addr == buf.ptr
        # 64 blocks of 16 KiB, host block i -> GPU block 63 - i: one batch of WRITEs.
        blk = size // 64
        done = copier.copy(hmr, gmr, [(i * blk, (63 - i) * blk, blk) for i in range(64)])
        assert done == 64
        out = cupy.asnumpy(buf.array()).tobytes()
        for i in range(64):
            assert out[(63 - i) * blk:(64 - i) * blk] == bytes(host[i * blk:(i + 1) * blk])
        # And back: GPU -> host, through the same NIC.
        back = bytearray(size)
        copier.copy(gmr, copier.register_host(back), [(0, 0, size)])
        assert back == bytearray(out)
