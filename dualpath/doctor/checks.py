"""The doctor's checks: pure functions of the configuration and the host's facts, each
giving ok / warn / fail, what was found and, unless ok, the fix."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from dualpath import lane

OK, WARN, FAIL = "ok", "warn", "fail"
RANK = {OK: 0, WARN: 1, FAIL: 2}
MIB = 1 << 20


@dataclass(frozen=True)
class Result:
    check: str
    status: str
    detail: str
    fix: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Port:
    device: str
    port: int
    active: bool
    ethernet: bool
    active_mtu: int
    roce_v2_ipv4_gid: int | None      # its index, None when there is none
    numa_node: int | None


@dataclass
class Facts:
    """What the host is, as :mod:`.facts` found it."""

    memlock_bytes: int | None         # None = unlimited
    huge_pages_free: int
    rdma_ports: list[Port] = field(default_factory=list)
    rdma_error: str = ""              # why no device could be listed
    store_dir: str = ""
    store_fs: str = ""
    store_free_bytes: int = 0
    store_total_bytes: int = 0
    store_error: str = ""             # the store directory cannot be created or written
    o_direct: str = ""                # "" = works, else why not
    clock_synced: bool | None = None  # None = unknown
    ports_busy: dict[str, str] = field(default_factory=dict)    # address -> why
    tls_problems: list[str] = field(default_factory=list)
    tls_expires_days: float | None = None
    gpus: list[tuple[int, int | None]] = field(default_factory=list)   # (index, numa)
    # GPU index -> (its RDMA device, how close: nvidia-smi's word or "set")
    gpu_nics: dict[int, tuple[str, str]] = field(default_factory=dict)


def pinned_bytes(cfg, role: str) -> int:
    """What a node of ``role`` pins: its DRAM buffer, and the emulated engine's host
    "HBM" per engine."""
    b, e = cfg.buffers, cfg.engine
    buf = {"prefill": b.pe_buffer_mib, "decode": b.de_buffer_mib,
           "both": b.pe_buffer_mib}[role]
    hbm = 0
    if e.kind == "emulated" and role != "both":
        hbm = e.engines_per_node * (e.prefill_hbm_mib if role == "prefill"
                                    else e.decode_hbm_mib)
    return (buf + hbm) * MIB


def memlock(cfg, role: str, f: Facts) -> Result:
    need = pinned_bytes(cfg, role)
    if not cfg.buffers.mlock:
        return Result("memlock", WARN, f"buffers.mlock = false: {need >> 20} MiB not pinned "
                      "(an RDMA NIC may read pages that moved)",
                      "set buffers.mlock = true with a memlock limit to match")
    if f.memlock_bytes is None or f.memlock_bytes >= need:
        have = "unlimited" if f.memlock_bytes is None else f"{f.memlock_bytes >> 20} MiB"
        return Result("memlock", OK, f"limit {have} >= {need >> 20} MiB to pin")
    return Result("memlock", FAIL, f"limit {f.memlock_bytes >> 20} MiB < {need >> 20} MiB "
                  f"the {role} node pins", "ulimit -l unlimited, or LimitMEMLOCK=infinity "
                  "in the unit, or --ulimit memlock=-1 for docker; or smaller buffers")


def huge_pages(cfg, role: str, f: Facts) -> Result:
    mode = cfg.buffers.huge_pages
    need = -(-pinned_bytes(cfg, role) // (2 * MIB))
    if mode == "off":
        return Result("huge pages", OK, "buffers.huge_pages = off")
    if f.huge_pages_free >= need:
        return Result("huge pages", OK, f"{f.huge_pages_free} free 2 MiB pages >= {need}")
    status = FAIL if mode == "on" else WARN
    return Result("huge pages", status, f"{f.huge_pages_free} free 2 MiB pages of {need} "
                  f"(buffers.huge_pages = {mode}: "
                  f"{'the node refuses to start' if mode == 'on' else 'normal pages'})",
                  f"sysctl vm.nr_hugepages={need} (plus what else uses them)")


def startup_memory(cfg, role: str, f: Facts, ipc_lock: bool) -> tuple[bool, str]:
    """The node's start-up line on its pinned memory, before it maps any: (short,
    line). ``short`` when the memlock limit or the free huge pages fall short of what
    the configuration pins (memlock() and huge_pages() above); the line names what is
    short and the fix. ``ipc_lock``: the process holds CAP_IPC_LOCK, which lets mlock
    pass any limit (root), so a low limit is stated but is not a shortfall."""
    need = pinned_bytes(cfg, role)
    lock, huge = memlock(cfg, role, f), huge_pages(cfg, role, f)
    exempt = ipc_lock and cfg.buffers.mlock and lock.status != OK   # the limit is not enforced
    short = [r for r in (lock, huge) if r.status != OK and not (r is lock and exempt)]
    parts = [f"{role} node pins {need >> 20} MiB (buffers.mlock = "
             f"{str(cfg.buffers.mlock).lower()}, buffers.huge_pages = "
             f"{cfg.buffers.huge_pages}); memlock: {lock.detail}"
             + (" (CAP_IPC_LOCK: not enforced)" if exempt else ""),
             f"huge pages: {huge.detail}"]
    fixes = [f"{r.check}: {r.fix}" for r in short if r.fix]
    return bool(short), "; ".join(parts) + (". Short: " + "; ".join(fixes) if fixes else "")


def rdma(cfg, f: Facts) -> list[Result]:
    kind = cfg.transport.kind
    want = cfg.transport.device
    ports = [p for p in f.rdma_ports if not want or p.device == want]
    active = [p for p in ports if p.active]
    out = []
    if not active:
        why = f.rdma_error or (f"no port of {want}" if want else "no RDMA device") + \
            " is ACTIVE"
        status = FAIL if kind == "verbs" else (WARN if kind == "auto" else OK)
        fix = ("load the driver and bring the port up (ibv_devinfo); SoftRoCE: modprobe "
               "rdma_rxe && rdma link add rxe0 type rxe netdev IFACE"
               if status != OK else "")
        note = {"verbs": "transport.kind = verbs fails", "auto": "transport auto falls back "
                "to TCP", "tcp": "transport.kind = tcp: not needed"}[kind]
        return [Result("rdma devices", status, f"{why}; {note}", fix)]
    out.append(Result("rdma devices", OK, ", ".join(
        f"{p.device} port {p.port} ACTIVE ({'RoCE' if p.ethernet else 'InfiniBand'}, "
        f"MTU {p.active_mtu})" for p in active)))
    for p in active:
        if p.ethernet:
            if cfg.transport.gid_index >= 0:
                out.append(Result(f"gid {p.device}", OK,
                                  f"transport.gid_index = {cfg.transport.gid_index} (fixed)"))
            elif p.roce_v2_ipv4_gid is None:
                out.append(Result(f"gid {p.device}", FAIL, "no RoCE v2 GID with an IPv4 "
                                  "address (::ffff:a.b.c.d)", "give the netdev an IPv4 "
                                  "address, or set transport.gid_index"))
            else:
                out.append(Result(f"gid {p.device}", OK,
                                  f"RoCE v2 IPv4 GID at index {p.roce_v2_ipv4_gid}"))
        if p.active_mtu < 4096:
            out.append(Result(f"mtu {p.device}", WARN, f"active MTU {p.active_mtu} bytes: "
                              "every Layer Block WRITE is cut into that many packets",
                              "raise the port (and netdev) MTU: 4096 on InfiniBand, a "
                              "jumbo netdev MTU (9000) for RoCE's 4096"))
        else:
            out.append(Result(f"mtu {p.device}", OK, f"active MTU {p.active_mtu} bytes"))
        out.append(Result(f"numa {p.device}", OK, "NUMA node "
                          f"{p.numa_node if p.numa_node is not None else 'unknown'} (pin "
                          "the node daemon and its buffers there)"))
    return out


def kv_lane(cfg) -> Result:
    sl, tc = cfg.kv_lane.service_level, cfg.kv_lane.traffic_class
    text = lane.describe(sl, tc)
    if (sl, tc) == (lane.KV_SERVICE_LEVEL, lane.KV_TRAFFIC_CLASS):
        return Result("kv lane", OK, text + "; deploy/qos configures the fabric for it")
    return Result("kv lane", WARN, text + ": not the lane deploy/qos configures "
                  f"(SL {lane.KV_SERVICE_LEVEL} -> VL {lane.KV_VIRTUAL_LANE}, DSCP "
                  f"{lane.KV_DSCP})", "configure the fabric for this lane, or use the "
                  "defaults of [kv_lane]")


def store(cfg, f: Facts) -> list[Result]:
    if f.store_error:
        return [Result("store", FAIL, f"{f.store_dir}: {f.store_error}",
                       "create the directory (or mount the shared store) writable by the "
                       "daemon's user")]
    out = [Result("store", OK, f"{f.store_dir} on {f.store_fs or 'an unknown filesystem'}")]
    mode = cfg.storage.direct_io
    if f.o_direct:
        status = FAIL if mode == "on" else (OK if mode == "off" else WARN)
        out.append(Result("o_direct", status, f"O_DIRECT does not work there: {f.o_direct}"
                          f" (storage.direct_io = {mode})", "" if status == OK else
                          "use a filesystem with O_DIRECT (ext4, xfs, 3FS), or set "
                          "storage.direct_io = off (reads then go through the page cache)"))
    else:
        out.append(Result("o_direct", OK, "O_DIRECT reads and writes work"))
    if f.store_total_bytes:
        frac = f.store_free_bytes / f.store_total_bytes
        status = OK if frac >= 0.10 else WARN
        out.append(Result("free space", status, f"{f.store_free_bytes / 1e9:.1f} GB free "
                          f"({frac:.0%})", "" if status == OK else "free space or point "
                          "storage.dir at a larger filesystem (blocks are not evicted)"))
    return out


def clock(f: Facts) -> Result:
    if f.clock_synced is None:
        return Result("clock", WARN, "cannot tell whether the clock is synchronised",
                      "run chrony or systemd-timesyncd (leases and logs compare times)")
    if f.clock_synced:
        return Result("clock", OK, "synchronised (kernel NTP status)")
    return Result("clock", WARN, "not synchronised", "start chrony or systemd-timesyncd")


def ports(f: Facts, wanted: list[str]) -> Result:
    if not wanted:
        return Result("ports", OK, "every configured port is 0 (any free one)")
    busy = {a: w for a, w in f.ports_busy.items() if a in wanted}
    if busy:
        return Result("ports", FAIL, "; ".join(f"{a}: {w}" for a, w in busy.items()),
                      "stop what holds them, or change the configured addresses")
    return Result("ports", OK, "free: " + ", ".join(wanted))


def tls(cfg, f: Facts) -> Result:
    if cfg.tls.plaintext:
        return Result("tls", WARN, "plaintext gRPC: loopback only, no identities",
                      "give [tls] ca_file, cert_file, key_file (docs/security.md)")
    if f.tls_problems:
        return Result("tls", FAIL, "; ".join(f.tls_problems),
                      "fix the files named (docs/security.md: Running with your own PKI)")
    days = f.tls_expires_days
    if days is not None and days < 14:
        return Result("tls", WARN, f"the certificate expires in {days:.1f} days",
                      "renew it (the daemons reload it without a restart)")
    return Result("tls", OK, "CA, certificate and key readable and matching"
                  + (f"; certificate valid {days:.0f} more days" if days is not None else ""))


def gpus(f: Facts) -> Result:
    if not f.gpus:
        return Result("gpus", OK, "none seen (host-memory engines)")
    def nic(i: int) -> str:
        pair = f.gpu_nics.get(i)
        if pair is None:
            return ", no RDMA device to pair"
        return f", its KV through {pair[0]} ({pair[1]})"
    return Result("gpus", OK, "; ".join(
        f"GPU {i} on NUMA node {n if n is not None else 'unknown'}{nic(i)}"
        for i, n in f.gpus))


def run_all(cfg, role: str, f: Facts, wanted_ports: list[str]) -> list[Result]:
    return [memlock(cfg, role, f), huge_pages(cfg, role, f), *rdma(cfg, f), kv_lane(cfg),
            *store(cfg, f), clock(f), ports(f, wanted_ports), tls(cfg, f), gpus(f)]


def worst(results: list[Result]) -> int:
    return max((RANK[r.status] for r in results), default=0)
