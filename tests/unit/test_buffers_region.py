"""The pinned region: mlock, the memlock error that names the fix, registration order."""

import errno
import mmap
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from dualpath.buffers import region as region_mod
from dualpath.buffers.region import MemlockError, PinnedRegion, RegionError


class FakeRegistration:
    def __init__(self, log, addr, length):
        self.log, self.addr, self.length = log, addr, length
        log.append(("register", addr, length))

    def close(self):
        self.log.append(("deregister", self.addr))


def test_region_is_locked_registered_and_closed_children_first(monkeypatch):
    log = []
    real_munlock = region_mod._munlock
    monkeypatch.setattr(region_mod, "_munlock",
                        lambda a, n: (log.append(("munlock", a)), real_munlock(a, n)))
    r = PinnedRegion(64 << 10, register=lambda a, n: FakeRegistration(log, a, n))
    assert r.locked and r.addr % mmap.PAGESIZE == 0
    assert log == [("register", r.addr, r.nbytes)]
    v = r.view(4096, 100)
    assert np.shares_memory(v, r.array)
    v[:] = 7
    addr = r.addr
    del v
    r.close()
    r.close()                                   # idempotent
    assert log[1:] == [("deregister", addr), ("munlock", addr)]   # MR before munlock
    assert r.closed and not r.locked


def test_memlock_failure_names_the_fix_and_leaks_nothing(monkeypatch):
    # Injected at the mlock call: root (CAP_IPC_LOCK) is never refused for real.
    monkeypatch.setattr(region_mod, "_mlock", lambda a, n: errno.ENOMEM)
    registered = []
    with pytest.raises(MemlockError) as ei:
        # huge pages off: with free huge pages the region would be a 2 MiB one
        PinnedRegion(1 << 20, huge_pages="off", register=lambda a, n: registered.append(a))
    msg = str(ei.value)
    assert ei.value.errno == errno.ENOMEM
    assert "ulimit -l unlimited" in msg and "LimitMEMLOCK=infinity" in msg
    assert "RLIMIT_MEMLOCK" in msg and "1048576 bytes" in msg
    assert registered == []                     # never registered half-built memory


_MEMLOCK_CHILD = """
import resource
from dualpath.buffers.region import MemlockError, PinnedRegion
resource.setrlimit(resource.RLIMIT_MEMLOCK, (65536, 65536))
try:
    PinnedRegion(4 << 20)
    print("LOCKED")
except MemlockError as e:
    print("MEMLOCK", e)
"""


def test_memlock_limit_for_real_in_a_child():
    # A child with RLIMIT_MEMLOCK = 64 KiB; as root it also drops CAP_IPC_LOCK (capsh),
    # since the capability would let it ignore the limit.
    cmd = [sys.executable, "-c", _MEMLOCK_CHILD]
    if os.geteuid() == 0:
        if shutil.which("capsh") is None:
            pytest.skip("root without capsh cannot drop CAP_IPC_LOCK; the injected "
                        "failure test covers the message")
        cmd = ["capsh", "--drop=cap_ipc_lock", "--", "-c", 'exec "$0" "$@"', *cmd]
    r = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=120)
    assert r.stdout.startswith("MEMLOCK"), (r.stdout, r.stderr)
    assert "65536 bytes" in r.stdout and "ulimit -l unlimited" in r.stdout


class _NoHugeMmap:
    """Stands in for the mmap module: MAP_HUGETLB mappings fail as with no reserved pages."""

    def __getattr__(self, name):
        return getattr(mmap, name)

    def mmap(self, fd, size, flags=0, **kw):
        if flags & region_mod.MAP_HUGETLB:
            raise OSError(errno.ENOMEM, "Cannot allocate memory")
        return mmap.mmap(fd, size, flags=flags, **kw)


def test_huge_pages_auto_falls_back_and_on_fails_clearly(monkeypatch):
    monkeypatch.setattr(region_mod, "mmap", _NoHugeMmap())
    with PinnedRegion(1 << 20, huge_pages="auto", lock=False) as r:
        assert not r.huge and r.nbytes == 1 << 20
    with pytest.raises(RegionError, match="vm.nr_hugepages"):
        PinnedRegion(1 << 20, huge_pages="on", lock=False)


def test_close_with_live_views_does_not_fail():
    r = PinnedRegion(8192, lock=False)
    v = r.view(0, 8192)
    r.close()
    v[0] = 1          # the mapping lives until its last view goes
    assert v[0] == 1


def test_memlock_message_reads_once_and_mmap_failure_is_a_region_error(monkeypatch):
    # str() began with OSError's "[Errno 12]"; an ENOMEM from mmap itself was a bare
    # OSError traceback (errno values from errno.h).
    monkeypatch.setattr(region_mod, "_mlock", lambda a, n: errno.ENOMEM)
    with pytest.raises(MemlockError) as ei:
        PinnedRegion(1 << 20, huge_pages="off")
    assert str(ei.value).startswith("cannot pin 1048576 bytes of DualPath buffers")
    monkeypatch.undo()

    def no_memory(*a, **k):
        raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))

    monkeypatch.setattr(region_mod.mmap, "mmap", no_memory)
    with pytest.raises(RegionError, match=r"pe_buffer: cannot map 4096 bytes \(Cannot "
                       r"allocate memory\); make buffers\.pe_buffer_mib"):
        PinnedRegion(4096, huge_pages="off", what="pe_buffer")


def _resident_bytes(addr: int) -> int:
    """Rss of the mapping that starts at ``addr`` (/proc/self/smaps)."""
    with open("/proc/self/smaps") as f:
        lines = f.read().splitlines()
    for i, line in enumerate(lines):
        if line.split("-", 1)[0] == f"{addr:x}":
            for rest in lines[i + 1:]:
                if rest.startswith("Rss:"):
                    return int(rest.split()[1]) * 1024
    raise AssertionError(f"no mapping at {addr:#x}")


@pytest.mark.parametrize("shared", [False, True])
def test_an_unlocked_region_is_prefaulted_so_no_request_pays_first_touch(shared):
    with PinnedRegion(8 << 20, huge_pages="off", lock=False, shared=shared) as r:
        assert _resident_bytes(r.addr) >= 8 << 20
        assert not r.array.any()                  # and still all zero


@pytest.mark.parametrize("shared", [False, True])
def test_a_locked_region_is_resident_before_its_first_use(shared):
    # mlock faults every page in (the registered buffers' default): a request's first
    # touch of a slot never pays a page fault. 4 MiB stays under an 8 MiB memlock limit.
    with PinnedRegion(4 << 20, huge_pages="off", shared=shared) as r:
        assert r.locked
        assert _resident_bytes(r.addr) >= 4 << 20


def test_a_huge_page_shortfall_is_a_warning_naming_the_fix(monkeypatch, caplog):
    def no_huge(*a, **k):
        if k.get("flags", 0) & region_mod.MAP_HUGETLB:
            raise OSError(errno.ENOMEM, "Cannot allocate memory")
        return real(*a, **k)

    real = mmap.mmap
    monkeypatch.setattr(region_mod.mmap, "mmap", no_huge)
    with caplog.at_level("WARNING", "dualpath.buffers"), \
            PinnedRegion(4 << 20, huge_pages="auto", lock=False) as r:
        assert not r.huge
    (rec,) = [x for x in caplog.records if "huge pages" in x.getMessage()]
    assert "of the 2 it needs" in rec.getMessage()
    assert "vm.nr_hugepages=2" in rec.getMessage()
