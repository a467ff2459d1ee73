"""GPU memory as RDMA memory regions, so a host->GPU copy is an RDMA WRITE through a
local NIC into the GPU's MR (the paper's CNIC-centric copy path; issue 3 item 6). The
paper gives each GPU a NIC of its own; dualpath/topology.py picks it (the nearest on the
PCIe tree, or ``transport.gpu_nics``); here ``device`` names the NIC.

Only where cupy and a CUDA GPU exist; :func:`probe` says why not elsewhere. Registration
tries, in order:

1. dma-buf: the allocation is exported as a dma-buf fd with the CUDA driver's
   ``cuMemGetHandleForAddressRange(CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD)`` (CUDA >= 11.7,
   a kernel and driver with dma-buf support) and registered with ``ibv_reg_dmabuf_mr``
   (``dp_mr_reg_dmabuf``; rdma-core >= 34, ``dp_has_dmabuf()``), iova = the device
   pointer, so peers address GPU memory by its device address.
2. peer memory: ``ibv_reg_mr`` on the device pointer, which the kernel pins through
   nvidia-peermem (the ``nvidia_peermem`` module) when it is loaded.

Ownership: :class:`GpuBuffer` owns its device allocation; :class:`GpuMemoryRegion` owns
the MR and the dma-buf fd and is a child of its PD (closed before it); the buffer must
outlive the region. Threads: as :mod:`dualpath.verbs` (control calls from one thread at
a time per object); CUDA calls use the device current on the calling thread.
"""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Iterable
from dataclasses import dataclass

from dualpath import verbs
from dualpath._native import ffi, lib
from dualpath._owner import RegionOwner, check_range
from dualpath.errors import DualPathError, RdmaError, UsageError, check_ptr

#: ``CUmemRangeHandleType``: CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD.
CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD = 1
#: ``CUdevice_attribute``: CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED.
CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED = 124
PAGE = os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class GpuProbe:
    usable: bool
    reason: str     # "cupy 13.1.0, 1 GPU (NVIDIA H200)" / "cupy is not installed (...)"


def probe() -> GpuProbe:
    """Can this process allocate GPU memory? (cupy importable and a CUDA device.)"""
    try:
        import cupy
    except ImportError as e:
        return GpuProbe(False, f"cupy is not installed ({e}); pip install cupy-cuda12x")
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except (cupy.cuda.runtime.CUDARuntimeError, RuntimeError, OSError) as e:
        # no driver, no device, or a CUDA library missing
        return GpuProbe(False, f"no CUDA device usable by cupy {cupy.__version__}: {e}")
    if n == 0:
        return GpuProbe(False, f"cupy {cupy.__version__} sees no CUDA device")
    name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
    name = name.decode() if isinstance(name, bytes) else name
    return GpuProbe(True, f"cupy {cupy.__version__}, {n} GPU(s), device 0 {name}")


def _cupy():
    p = probe()
    if not p.usable:
        raise UsageError(f"GPU memory is not available: {p.reason}")
    import cupy

    return cupy


class GpuBuffer:
    """``nbytes`` of device memory from cudaMalloc (not cupy's pool, so the range is
    exactly ours and page-aligned as dma-buf export needs), rounded up to whole pages.
    Idempotent close(); a context manager."""

    def __init__(self, nbytes: int, device: int = 0):
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise UsageError(f"GPU buffer size must be an integer > 0, not {nbytes!r}")
        cupy = _cupy()
        self.device = device
        self.nbytes = -(-nbytes // PAGE) * PAGE
        with cupy.cuda.Device(device):
            self._mem = cupy.cuda.Memory(self.nbytes)
        self.ptr = int(self._mem.ptr)

    @property
    def closed(self) -> bool:
        return self._mem is None

    def array(self):
        """The memory as a cupy uint8 array (a view: valid while the buffer is open)."""
        cupy = _cupy()
        mp = cupy.cuda.MemoryPointer(self._mem, 0)
        return cupy.ndarray((self.nbytes,), dtype=cupy.uint8, memptr=mp)

    def close(self) -> None:
        self._mem = None        # cupy frees it (cudaFree) when the last reference goes

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class CudaDriver:
    """The two driver-API calls dma-buf export needs, over ctypes on libcuda (cupy does
    not wrap cuMemGetHandleForAddressRange)."""

    def __init__(self, path: str = "libcuda.so.1"):
        try:
            self._lib = ctypes.CDLL(path)
        except OSError as e:
            raise RdmaError(errno.EOPNOTSUPP, f"cannot load the CUDA driver {path}: {e}") from e
        self._get_handle = getattr(self._lib, "cuMemGetHandleForAddressRange", None)
        if self._get_handle is not None:
            self._get_handle.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t,
                                         ctypes.c_int, ctypes.c_ulonglong]
        self._lib.cuDeviceGetAttribute.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int,
                                                   ctypes.c_int]

    def _error(self, rc: int) -> str:
        name = ctypes.c_char_p()
        self._lib.cuGetErrorName(rc, ctypes.byref(name))
        return f"{name.value.decode() if name.value else 'CUresult'} ({rc})"

    def dmabuf_supported(self, device: int) -> bool:
        v = ctypes.c_int(0)
        rc = self._lib.cuDeviceGetAttribute(ctypes.byref(v),
                                            CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED, device)
        return rc == 0 and v.value == 1

    def pci_bus_id(self, ordinal: int) -> str:
        """The PCI address (``0000:17:00.0``) of the GPU this process calls ``ordinal``
        (after CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER)."""
        dev, buf = ctypes.c_int(0), ctypes.create_string_buffer(32)
        for rc in (self._lib.cuInit(0), self._lib.cuDeviceGet(ctypes.byref(dev), ordinal),
                   self._lib.cuDeviceGetPCIBusId(buf, len(buf), dev)):
            if rc != 0:
                raise RdmaError(errno.ENODEV, f"GPU {ordinal}'s PCI address: {self._error(rc)}")
        domain, bus, rest = buf.value.decode().lower().split(":")
        return f"{int(domain, 16):04x}:{bus}:{rest}"

    def export_dmabuf(self, ptr: int, nbytes: int) -> int:
        if self._get_handle is None:
            raise RdmaError(errno.EOPNOTSUPP, "this CUDA driver has no "
                            "cuMemGetHandleForAddressRange (CUDA >= 11.7 needed)")
        fd = ctypes.c_int(-1)
        rc = self._get_handle(ctypes.byref(fd), ptr, nbytes,
                              CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0)
        if rc != 0:
            raise RdmaError(errno.EOPNOTSUPP, f"cuMemGetHandleForAddressRange(DMA_BUF_FD) "
                            f"failed: {self._error(rc)}")
        return fd.value


def export_dmabuf(ptr: int, nbytes: int, device: int = 0, driver=None) -> int:
    """A dma-buf fd for device memory ``[ptr, ptr + nbytes)`` (page-aligned, as the
    driver requires); the caller closes it. RdmaError(EOPNOTSUPP) says why not."""
    if ptr % PAGE or nbytes % PAGE or nbytes <= 0:
        raise UsageError(f"dma-buf export needs a page-aligned range ({PAGE} B pages), not "
                         f"{nbytes} bytes at {ptr:#x}")
    driver = driver or CudaDriver()
    if not driver.dmabuf_supported(device):
        raise RdmaError(errno.EOPNOTSUPP, f"GPU {device} does not support dma-buf "
                        "(CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED = 0: driver or kernel too old)")
    return driver.export_dmabuf(ptr, nbytes)


@dataclass(frozen=True)
class DeviceRange:
    """Device memory someone else owns (e.g. an inference engine's KV tensors), borrowed
    for registration: never freed here, and it must outlive its region."""

    ptr: int
    nbytes: int
    device: int = 0
    closed: bool = False


class GpuMemoryRegion(RegionOwner):
    """Device memory (a :class:`GpuBuffer` or a borrowed :class:`DeviceRange`) registered
    on a PD. ``kind``: "dmabuf" or "peermem" (how it was registered). ``addr`` is the
    device pointer (the iova peers WRITE to)."""

    _what = "GPU memory region"

    def __init__(self, pd: verbs.ProtectionDomain, buf: GpuBuffer | DeviceRange,
                 access: int = verbs.ACCESS_RW, *, prefer: str = "auto", driver=None):
        if prefer not in ("auto", "dmabuf", "peermem"):
            raise UsageError(f"prefer must be 'auto', 'dmabuf' or 'peermem', not {prefer!r}")
        if buf.closed:
            raise UsageError("the GPU buffer is closed")
        super().__init__([pd])
        self.buffer, self._fd = buf, -1
        info = ffi.new("struct dp_mr_info *")
        tried: list[str] = []
        handle = ffi.NULL
        if prefer in ("auto", "dmabuf"):
            try:
                handle, self.kind = self._reg_dmabuf(pd, buf, access, info, driver), "dmabuf"
            except DualPathError as e:
                tried.append(f"dma-buf: {e}")
        if handle == ffi.NULL and prefer in ("auto", "peermem"):
            try:
                handle = check_ptr(lib.dp_mr_reg(pd._handle, ffi.cast("void *", buf.ptr),
                                                 buf.nbytes, int(access), info),
                                   "ibv_reg_mr on device memory", ffi)
                self.kind = "peermem"
            except DualPathError as e:
                tried.append(f"peer memory (is nvidia_peermem loaded?): {e}")
        if handle == ffi.NULL:
            raise RdmaError(errno.EOPNOTSUPP, f"cannot register {buf.nbytes} bytes of GPU "
                            f"memory on {pd.device.name}: " + "; ".join(tried))
        self._registered(handle, pd, info, verbs.Access(int(access)))

    def _reg_dmabuf(self, pd, buf: GpuBuffer | DeviceRange, access: int, info, driver):
        if not lib.dp_has_dmabuf():
            raise RdmaError(errno.EOPNOTSUPP, "built against an rdma-core without "
                            "ibv_reg_dmabuf_mr (dp_has_dmabuf() = 0)")
        fd = export_dmabuf(buf.ptr, buf.nbytes, buf.device, driver)
        try:
            handle = check_ptr(lib.dp_mr_reg_dmabuf(pd._handle, fd, 0, buf.nbytes, buf.ptr,
                                                    int(access), info),
                               "ibv_reg_dmabuf_mr", ffi)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        return handle

    def _destroy(self) -> int:
        rc = lib.dp_mr_dereg(self._handle)
        if rc == 0 and self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        return rc

    def __repr__(self) -> str:
        return (f"<GpuMemoryRegion {self.kind} {self.length} B at {self.addr:#x} "
                f"lkey {self.lkey:#x} rkey {self.rkey:#x}>")


class LocalRdmaCopier:
    """Host <-> GPU copies as RDMA WRITEs through one local NIC: an RC QP looped back on
    ``device`` (both ends on it), the way the paper's traffic manager moves KV blocks
    through a NIC instead of cudaMemcpyAsync. register_host/register_gpu
    once; copy() posts a batch with one doorbell per chain and waits for it.
    One thread at a time; close() releases everything (the buffers stay the caller's)."""

    def __init__(self, device: str | None = None, *, max_send_wr: int = 256,
                 signal_every: int = 16):
        check_range("max_send_wr", max_send_wr, 1, 65536)
        check_range("signal_every", signal_every, 1, (1 << 32) - 1)
        self.device = verbs.Device(device)
        try:
            gid = self.device.pick_gid()
            cfg = verbs.QpConfig(max_send_wr=max_send_wr, gid_index=gid.index if gid else -1)
            self.pd = self.device.pd()
            self.cq = self.device.cq(max_send_wr)
            self.qp, self._peer = self.pd.qp(self.cq, config=cfg), self.pd.qp(self.cq, config=cfg)
            self._reconnect()
        except BaseException:
            self.device.close()
            raise
        self.signal_every, self.max_send_wr = signal_every, max_send_wr

    def register_host(self, buf) -> verbs.MemoryRegion:
        return self.pd.mr(buf)

    def register_gpu(self, buf: GpuBuffer, *, prefer: str = "auto") -> GpuMemoryRegion:
        return GpuMemoryRegion(self.pd, buf, prefer=prefer)

    def copy(self, src, dst, items: Iterable[tuple[int, int, int]],
             timeout: float = 30.0) -> int:
        """WRITE ``(src_offset, dst_offset, length)`` items from region ``src`` into
        region ``dst`` (host or GPU, either way); return the WRITEs done. RdmaError on an
        error completion, TimeoutError past ``timeout`` seconds without progress."""
        wrs = []
        for i, (so, do, n) in enumerate(items):
            _check_inside(src, so, n, f"items[{i}] source")
            _check_inside(dst, do, n, f"items[{i}] destination")
            wrs.append(verbs.Item(src.addr + so, dst.addr + do, n, src.lkey, dst.rkey, i))
        batch, total = verbs.WriteBatch(wrs), len(wrs)
        posted = retired = 0
        while retired < total:
            if posted < total:
                posted += self.qp.post_raw(batch.items + posted, total - posted,
                                           self.signal_every)
            wcs = self.cq.wait(timeout)
            if not wcs:
                self._reconnect()
                raise TimeoutError(f"copy: no completion within {timeout} s "
                                   f"({retired} of {total} WRITEs done)")
            for wc in wcs:
                if not wc.ok:
                    self._reconnect()
                    raise RdmaError(errno.EIO, f"copy: WRITE {wc.wr_id} failed with "
                                    f"{verbs.WcStatus(wc.status).name}")
                retired += wc.retired
        return retired

    def _reconnect(self) -> None:
        """After an error or a timeout: both ends back to RESET and connected again."""
        self.qp.reset()
        self._peer.reset()
        mine, theirs = self.qp.endpoint(), self._peer.endpoint()
        self.qp.connect(theirs)
        self._peer.connect(mine)

    def close(self) -> None:
        self.device.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _check_inside(region, offset: int, length: int, what: str) -> None:
    if offset < 0 or length <= 0 or offset + length > region.length:
        raise UsageError(f"{what} range [{offset}, {offset + length}) is outside its "
                         f"region ({region.length} bytes)")
