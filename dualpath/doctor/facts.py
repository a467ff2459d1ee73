"""What the host is, for the doctor's checks (dualpath/doctor/checks.py). Every probe
answers, never raises: what it cannot find out it says."""

from __future__ import annotations

import ctypes
import mmap
import os
import resource
import socket
import ssl
import tempfile
import time
from pathlib import Path

from dualpath import topology
from dualpath._libc import LIBC
from dualpath.buffers.region import free_huge_pages
from dualpath.doctor.checks import Facts, Port
from dualpath.errors import UsageError
from dualpath.rpc import parse_listen


def gather(cfg, wanted_ports: list[str]) -> Facts:
    f = memory_facts()
    f.rdma_ports, f.rdma_error = rdma_ports()
    store(cfg.storage.resolved_dir(), f)
    f.clock_synced = clock_synced()
    f.ports_busy = {a: why for a in wanted_ports if (why := busy(a))}
    if not cfg.tls.plaintext:
        f.tls_problems, f.tls_expires_days = tls_files(cfg.tls)
    # NVIDIA GPUs (PCI class 0x03, vendor 0x10de) with their NUMA node, and the RDMA
    # device each one's KV goes through (dualpath/topology.py: one sysfs scan for both).
    found, nics = topology.scan()
    f.gpus = [(i, g.numa) for i, g in enumerate(found)]
    try:
        f.gpu_nics = topology.pair(found, nics, topology.parse_pairs(cfg.transport.gpu_nics))
    except UsageError as e:
        f.gpu_nics = {i: ("?", str(e)) for i, _ in f.gpus}
    return f


def memory_facts() -> Facts:
    """The memlock limit and the free huge pages (what the node checks at start-up)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return Facts(memlock_bytes=None if soft == resource.RLIM_INFINITY else soft,
                 huge_pages_free=free_huge_pages())


CAP_IPC_LOCK = 14


def has_ipc_lock() -> bool:
    """Whether this process may lock memory past RLIMIT_MEMLOCK (CAP_IPC_LOCK in its
    effective set: root, or granted)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> CAP_IPC_LOCK & 1)
    except (OSError, ValueError):
        pass
    return False


def rdma_ports() -> tuple[list[Port], str]:
    try:
        from dualpath import verbs

        names = verbs.list_devices()
    except Exception as e:  # noqa: BLE001 - no rdma-core, no driver: said, not raised
        return [], f"cannot list RDMA devices ({e})"
    out = []
    for name in names:
        try:
            with verbs.Device(name) as d:
                for port in range(1, 3):
                    try:
                        a = d.port_attrs(port)
                    except Exception:  # noqa: BLE001 - past the device's last port
                        break
                    gid = next((g.index for g in d.gids(port) if g.roce_v2 and g.ipv4),
                               None) if a.is_ethernet else None
                    out.append(Port(name, port, a.active, a.is_ethernet, a.active_mtu, gid,
                                    _numa(Path(f"/sys/class/infiniband/{name}/device"))))
        except Exception as e:  # noqa: BLE001
            return out, f"{name}: {e}"
    return out, "" if names else "no RDMA device (no driver loaded)"


def _numa(device: Path) -> int | None:
    try:
        n = int((device / "numa_node").read_text())
    except (OSError, ValueError):
        return None
    return n if n >= 0 else None


def store(d: Path, f: Facts) -> None:
    f.store_dir = str(d)
    try:
        d.mkdir(parents=True, exist_ok=True)
        st = os.statvfs(d)
        f.store_free_bytes, f.store_total_bytes = st.f_bavail * st.f_frsize, \
            st.f_blocks * st.f_frsize
    except OSError as e:
        f.store_error = e.strerror or str(e)
        return
    f.store_fs = _fs_type(d)
    f.o_direct = _o_direct(d)


def _fs_type(d: Path) -> str:
    """The filesystem type of the longest mount point above ``d`` (/proc/mounts)."""
    best, fs = "", ""
    path = str(d.resolve())
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            _, mnt, typ = line.split()[:3]
            if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
                best, fs = mnt, typ
    except OSError:
        return ""
    return fs


def _o_direct(d: Path) -> str:
    """"" when a 4 KiB O_DIRECT write and read work in ``d``, else why not."""
    buf = mmap.mmap(-1, 4096)
    buf.write(b"\xa5" * 4096)
    try:
        fd, path = tempfile.mkstemp(dir=d, prefix=".doctor-")
        os.close(fd)
    except OSError as e:
        return f"cannot create a file ({e.strerror})"
    try:
        fd = os.open(path, os.O_RDWR | os.O_DIRECT)
        try:
            os.pwrite(fd, buf, 0)
            back = mmap.mmap(-1, 4096)
            n = os.preadv(fd, [back], 0)
            if n != 4096 or back[:] != buf[:]:
                return f"a 4 KiB read gave {n} bytes back, not what was written"
        finally:
            os.close(fd)
    except OSError as e:
        return e.strerror or str(e)
    finally:
        os.unlink(path)
    return ""


class _Timex(ctypes.Structure):
    _fields_ = [("modes", ctypes.c_uint), ("rest", ctypes.c_long * 25)]


def clock_synced() -> bool | None:
    """The kernel's NTP status (adjtimex): TIME_ERROR (5) = not synchronised."""
    try:
        t = _Timex()
        state = LIBC.adjtimex(ctypes.byref(t))
    except (OSError, AttributeError):
        return None
    return None if state < 0 else state != 5


def busy(address: str) -> str:
    """Why ``address`` (host:port, port != 0) cannot be bound now; "" when it can."""
    host, port = parse_listen(address, "port")
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(fam, socket.SOCK_STREAM)
    try:
        s.bind((host.strip("[]"), port))
    except OSError as e:
        return e.strerror or str(e)
    finally:
        s.close()
    return ""


def tls_files(cfg) -> tuple[list[str], float | None]:
    """Problems with [tls]'s files (unreadable, a key that is not the certificate's, a
    certificate the CA does not verify) and the certificate's days left."""
    problems = []
    for key, path in (("ca_file", cfg.ca_file), ("cert_file", cfg.cert_file),
                      ("key_file", cfg.key_file)):
        if not path:
            problems.append(f"tls.{key} is not set")
        elif not os.access(path, os.R_OK):
            problems.append(f"tls.{key} = {path}: not readable")
    if problems:
        return problems, None
    days = None
    try:
        server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        server.load_cert_chain(cfg.cert_file, cfg.key_file)
        not_after = ssl._ssl._test_decode_cert(cfg.cert_file)["notAfter"]
        days = (ssl.cert_time_to_seconds(not_after) - time.time()) / 86400
    except (ssl.SSLError, OSError, KeyError, ValueError) as e:
        return [f"tls.key_file does not go with tls.cert_file ({e})"], None
    if days <= 0:
        problems.append(f"tls.cert_file = {cfg.cert_file}: expired {-days:.0f} days ago")
    why = _handshake(server, cfg.ca_file)
    if why:
        problems.append(f"tls.ca_file = {cfg.ca_file} does not verify tls.cert_file: {why}")
    return problems, days


def _handshake(server: ssl.SSLContext, ca_file: str) -> str:
    """A TLS handshake in memory: the server with our certificate, a client trusting
    only ``ca_file``; "" when it verifies."""
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.check_hostname = False
    try:
        client.load_verify_locations(ca_file)
    except (ssl.SSLError, OSError) as e:
        return f"not a CA bundle ({e})"
    bios = [ssl.MemoryBIO() for _ in range(4)]
    c = client.wrap_bio(bios[0], bios[1], server_side=False)
    s = server.wrap_bio(bios[2], bios[3], server_side=True)
    for _ in range(20):
        done = 0
        for end in (c, s):
            try:
                end.do_handshake()
                done += 1
            except ssl.SSLWantReadError:
                pass
            except ssl.SSLError as e:
                return e.reason or str(e)
        bios[2].write(bios[1].read())
        bios[0].write(bios[3].read())
        if done == 2:
            return ""
    return "the handshake did not finish"
