"""One large pinned, registered DRAM region per process: the PE and DE buffers' backing.

Life cycle: ``PinnedRegion(...)`` maps anonymous memory (2 MiB huge pages when the
system has them reserved, plain pages otherwise, with transparent huge pages advised;
a fallback from huge pages is logged as a warning naming the shortfall), locks it with
``mlock`` so it can never be paged out under an RDMA NIC (which also faults every page
in; an unlocked region is pre-faulted instead, so no request pays first touch), then
registers it through the caller's ``register(addr, length)`` callback (an RDMA memory
region in the engines, nothing in unit tests). ``close()`` undoes this in reverse: deregister,
munlock, unmap. It is idempotent; the registration is a child and closes first.

Pinning counts against RLIMIT_MEMLOCK (so does ``ibv_reg_mr``); when the limit is too
low we fail at start-up with :class:`MemlockError`, naming the fix, instead of failing
later in the middle of a transfer.

Threads: create and close on one thread; views may be used from any thread.
"""

from __future__ import annotations

import ctypes
import errno as _errno
import logging
import mmap
import os
import resource
from collections.abc import Callable
from typing import Protocol, Self

import numpy as np

from dualpath._libc import LIBC
from dualpath.errors import DualPathError, UsageError

log = logging.getLogger("dualpath.buffers")

MAP_HUGETLB = getattr(mmap, "MAP_HUGETLB", 0x40000)   # Linux generic value
HUGE_PAGE = 2 << 20
HUGE_PAGE_MODES = ("auto", "on", "off")


class Registration(Protocol):
    """What ``register`` returns: a handle (e.g. dualpath.verbs.MemoryRegion) to close."""

    def close(self) -> None: ...


Register = Callable[[int, int], Registration]   # (address, length) -> registration


class MemlockError(DualPathError, OSError):
    """The region could not be pinned: RLIMIT_MEMLOCK too low (the message names the fix)."""

    def __str__(self) -> str:
        # OSError's own str() prefixes "[Errno N]"; the message already names the errno.
        return self.strerror


class RegionError(DualPathError):
    """The region could not be created as configured (e.g. huge pages demanded, none free)."""


MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)   # Linux >= 5.14


def free_huge_pages() -> int:
    """2 MiB huge pages free on this host (HugePages_Free), 0 when unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("HugePages_Free:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def prefault(m: mmap.mmap, array: np.ndarray) -> None:
    """Fault every page of a fresh mapping in now (writable), not on a request's first
    touch: MADV_POPULATE_WRITE, or one write per page where the kernel lacks it."""
    try:
        m.madvise(MADV_POPULATE_WRITE)
    except (OSError, AttributeError, ValueError):
        array[::mmap.PAGESIZE] = 0        # a fresh mapping is zero: the write keeps it so


LIBC.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
LIBC.munlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def _mlock(addr: int, length: int) -> int:
    """0 or the errno of mlock(2) (indirection so tests can inject a failure)."""
    return 0 if LIBC.mlock(addr, length) == 0 else ctypes.get_errno()


def _munlock(addr: int, length: int) -> None:
    LIBC.munlock(addr, length)


def memlock_fix_message(nbytes: int, err: int, what: str) -> str:
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    limit = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft} bytes"
    return (f"cannot pin {nbytes} bytes of {what} in memory: mlock failed with "
            f"{_errno.errorcode.get(err, err)} ({os.strerror(err)}); this process's locked-"
            f"memory limit (RLIMIT_MEMLOCK) is {limit}. Raise it: run `ulimit -l unlimited` "
            f"in the shell that starts dualpath, set LimitMEMLOCK=infinity in its systemd "
            f"unit, or pass `--ulimit memlock=-1` to docker; or make buffers.pe_buffer_mib "
            f"and buffers.de_buffer_mib smaller.")


class PinnedRegion:
    """A page-aligned anonymous mapping, mlocked and optionally registered.

    ``shared``: backed by a memfd (MAP_SHARED) instead of private anonymous memory, so
    another process can map the same pages from :attr:`fd` (handed over a Unix socket:
    dualpath/buffers/shm.py). The descriptor is owned here and closed with the region."""

    def __init__(self, nbytes: int, *, huge_pages: str = "auto", lock: bool = True,
                 register: Register | None = None, what: str = "DualPath buffers",
                 shared: bool = False):
        if nbytes <= 0:
            raise UsageError(f"region size must be > 0, got {nbytes}")
        if huge_pages not in HUGE_PAGE_MODES:
            raise UsageError(f"huge_pages={huge_pages!r}; allowed: {', '.join(HUGE_PAGE_MODES)}")
        self.what = what
        self.huge = False
        self.locked = False
        self.registration: Registration | None = None
        self._closed = False
        self.fd = -1
        self._map = (self._map_shared(nbytes, huge_pages) if shared
                     else self._map_memory(nbytes, huge_pages))
        self.nbytes = len(self._map)
        self.array = np.frombuffer(self._map, dtype=np.uint8)
        self.addr = self.array.ctypes.data
        try:
            if lock:
                err = _mlock(self.addr, self.nbytes)
                if err:
                    raise MemlockError(err, memlock_fix_message(self.nbytes, err, what))
                self.locked = True
            else:
                prefault(self._map, self.array)
            if register is not None:
                self.registration = register(self.addr, self.nbytes)
        except BaseException:
            self.close()
            raise
        log.info("%s: %d MiB, %s pages, %s, %s", what, self.nbytes >> 20,
                 "2 MiB huge" if self.huge else "normal",
                 "mlocked" if self.locked else "not locked, pre-faulted",
                 "registered" if self.registration is not None else "not registered")
        log.debug("%s at %#x", what, self.addr)   # addresses aim WRITEs: never at INFO

    def _short_of_huge_pages(self, size: int, e: OSError) -> None:
        need = size // HUGE_PAGE
        log.warning("%s: %d free 2 MiB huge pages of the %d it needs (%s); using normal "
                    "pages (more TLB misses). Reserve them: sysctl vm.nr_hugepages=%d (plus "
                    "what else uses them), or set buffers.huge_pages = 'off' to silence this",
                    self.what, free_huge_pages(), need, e.strerror, need)

    def _map_shared(self, nbytes: int, huge_pages: str) -> mmap.mmap:
        """A memfd of ``nbytes`` (2 MiB huge pages when asked and available), mapped
        shared."""
        name = self.what.replace(" ", "-")[:200]
        if huge_pages != "off":
            size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
            try:
                fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_HUGETLB)
                try:
                    os.ftruncate(fd, size)
                    m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
                except OSError:
                    os.close(fd)
                    raise
                self.fd, self.huge = fd, True
                return m
            except OSError as e:
                if huge_pages == "on":
                    raise RegionError(f"{self.what}: no 2 MiB huge pages for a shared "
                                      f"{size}-byte buffer ({e.strerror})") from None
                self._short_of_huge_pages(size, e)
        size = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        except OSError as e:
            os.close(fd)
            raise RegionError(f"{self.what}: cannot map {size} shared bytes ({e.strerror})"
                              ) from None
        self.fd = fd
        if hasattr(m, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                m.madvise(mmap.MADV_HUGEPAGE)
            except OSError:
                pass
        return m

    def _map_memory(self, nbytes: int, huge_pages: str) -> mmap.mmap:
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        if huge_pages != "off":
            size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
            try:
                m = mmap.mmap(-1, size, flags=flags | MAP_HUGETLB)
                self.huge = True
                return m
            except OSError as e:
                if huge_pages == "on":
                    raise RegionError(
                        f"{self.what}: no 2 MiB huge pages for {size} bytes ({e.strerror}); "
                        f"reserve them (sysctl vm.nr_hugepages={size // HUGE_PAGE}) or set "
                        f"buffers.huge_pages = 'auto'") from None
                self._short_of_huge_pages(size, e)
        size = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
        try:
            m = mmap.mmap(-1, size, flags=flags)
        except OSError as e:   # ENOMEM (overcommit, cgroup limit): was a bare traceback
            raise RegionError(f"{self.what}: cannot map {size} bytes ({e.strerror}); make "
                              "buffers.pe_buffer_mib / de_buffer_mib (or the engine's "
                              "*_hbm_mib) smaller or free memory") from None
        if hasattr(m, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                m.madvise(mmap.MADV_HUGEPAGE)   # transparent huge pages: fewer TLB misses
            except OSError:
                pass
        return m

    def view(self, offset: int, length: int) -> np.ndarray:
        """A zero-copy uint8 view of ``[offset, offset + length)``."""
        if offset < 0 or length < 0 or offset + length > self.nbytes:
            raise UsageError(f"range {offset}+{length} outside the {self.nbytes}-byte region")
        return self.array[offset:offset + length]

    def close(self) -> None:
        """Deregister, unlock, unmap (idempotent). Views still held keep the mapping alive."""
        if self._closed:
            return
        self._closed = True
        if self.registration is not None:
            reg, self.registration = self.registration, None
            reg.close()
        if self.locked:
            _munlock(self.addr, self.nbytes)
            self.locked = False
        self.array = None  # type: ignore[assignment]
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        try:
            self._map.close()
        except BufferError:   # someone still holds a view: unmapped when the last one goes
            log.debug("%s: views still alive at close; unmapping when they are freed", self.what)

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
