"""The [storage] config section: where and how Full Blocks are stored and read."""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from dualpath.config import key
from dualpath.errors import ConfigError
from dualpath.kv.prefix import MAX_TENANT_CHARS, tenant_tag
from dualpath.storage.evictor import StoreCapacity
from dualpath.storage.format import MIN_KEY_BYTES
from dualpath.storage.lru import Quotas
from dualpath.storage.store import DIRECT_IO_MODES, BlockStore


@dataclass(frozen=True)
class StorageConfig:
    """The KV block store (a POSIX directory) and each node's storage-NIC emulation."""

    dir: str = key("", "Directory of the block store: a local directory, or in a cluster a "
                   "shared mount every node sees (3FS FUSE, CephFS, Lustre, NFS). Empty = "
                   "$XDG_CACHE_HOME/dualpath/kv (~/.cache/dualpath/kv).")
    direct_io: str = key("auto", "Read with O_DIRECT: 'auto' uses it where the filesystem "
                         "supports it and falls back to buffered reads (logged once); 'on' "
                         "fails where unsupported; 'off' never uses it.", choices=DIRECT_IO_MODES)
    read_workers: int = key(8, "Concurrent block reads per node (worker threads; the "
                            "read queue's depth).", min=1, max=256)
    read_batch_depth: int = key(4, "Block reads in flight on each of the store's io_uring rings, "
                                "which one reader thread feeds with every batch the read "
                                "queue hands over (csrc/store_io.c; also the most blocks "
                                "a queue reader takes as one batch); 0 = no batches: one "
                                "read per worker thread. Without io_uring in the kernel, "
                                "threads anyway (logged once).", min=0, max=1024)
    read_rings: int = key(4, "io_uring rings of the store, each fed by a reader thread of "
                          "its own that also checks (hashes) what its reads bring in; the "
                          "read queue's batches take turns. More rings: more cores hashing "
                          "(a keyed read costs ~0.2 CPU s/GB here), read_batch_depth x "
                          "read_rings reads in flight in all. 0 = no ring readers: each "
                          "batch is one C call with a ring of its own on a read-pool "
                          "thread.", min=0, max=64)
    write_workers: int = key(2, "Concurrent block writes per node (worker threads).",
                             min=1, max=64)
    verify_checksum: bool = key(True, "Check each block's payload hash (XXH3-64) on read (a block "
                                "that fails is counted, quarantined and read as a miss). "
                                "With integrity_key_file the keyed tag is checked instead, "
                                "always: it catches what the hash would.")
    fsync: bool = key(True, "fsync each block and its directory before it counts as "
                      "written. Turning it off gives up crash safety; for throwaway benches.")
    snic_gbit_per_s: float = key(0.0, "Emulated storage-NIC bandwidth of each node in Gbit/s "
                                 "(token bucket on its reads); 0 = no limit.", min=0.0)
    snic_burst_bytes: int = key(0, "Token-bucket depth of the storage-NIC emulation in bytes; "
                                "0 = 10 ms at the configured rate.", min=0)
    integrity_key_file: str = key("", "File holding the cluster's block integrity key (at "
                                  "least 32 bytes, e.g. `head -c 32 /dev/urandom`; not "
                                  "readable by every user). Set: blocks are written with a "
                                  "keyed tag (Poly1305 under a per-write one-time key) and "
                                  "only blocks whose tag verifies are "
                                  "read (a writer of the shared mount without the key cannot "
                                  "plant blocks). Empty = no tags.")

    capacity_gib: float = key(0.0, "Bound of the whole store in GiB (the block files' "
                              "bytes on disk, every model namespace together); 0 = "
                              "unbounded. Over high_watermark of it the store's one "
                              "evictor (whichever node holds its lock; docs/storage.md) "
                              "removes the least recently hit blocks down to "
                              "low_watermark, and a write that would pass the bound is "
                              "refused (the block is not cached). Give every process "
                              "of the store the same value.", min=0.0)
    namespace_quota_gib: float = key(0.0, "Bound of each model namespace (a KV format: "
                                     "one model's blocks) within capacity_gib, in GiB; 0 "
                                     "= none. A namespace past it loses its own least "
                                     "recently hit blocks first.", min=0.0)
    high_watermark: float = key(0.9, "Fraction of capacity_gib at which eviction starts.",
                                min=0.01, max=1.0)
    low_watermark: float = key(0.8, "Fraction of capacity_gib eviction brings usage down to "
                               "(at most high_watermark).", min=0.01, max=1.0)
    hit_lease_s: float = key(60.0, "A block a lookup counted as a hit (a request's plan "
                             "names it) or a read returned is not evicted for this long.",
                             min=0.0)
    upkeep_interval_s: float = key(1.0, "How often each process flushes its store ledger and "
                                   "the evictor evicts and publishes usage (with a capacity).",
                                   min=0.05, max=60.0)
    temp_max_age_s: float = key(600.0, "Temp files of writes older than this are removed by "
                                "the stores' upkeep (writers that died); keep it well "
                                "above the longest block write.", min=10.0)
    tenant_quota_gib: float = key(0.0, "Bound of each tenant account's blocks in the "
                                  "store, in GiB (an account: a tenant's name up to "
                                  "its first '/'; docs/storage.md); 0 = none. Past "
                                  "high_watermark of it the evictor removes the account's "
                                  "own least recently hit blocks first, and its writes "
                                  "past the quota are refused. Needs capacity_gib.",
                                  min=0.0)
    # key() gives a dict default a default_factory (a fresh table each time).
    tenant_quotas: dict[str, float] = key({}, "Quota of named tenant accounts in GiB, over "  # noqa: RUF009
                                          "tenant_quota_gib (0 = no quota for it), e.g. "
                                          "{ acme = 50, \"\" = 10 } (\"\" is the default "
                                          "tenant's, whose requests name none).", min=0.0)
    index_max_keys: int = key(1_000_000, "Block keys each process keeps in memory to answer "
                              "lookups without a filesystem call per block (~100 bytes "
                              "each; past it the index starts over); 0 = no index: a "
                              "stat per block per lookup.", min=0, max=1 << 30)

    def __post_init__(self) -> None:
        if self.low_watermark > self.high_watermark:
            raise ConfigError(f"storage.low_watermark = {self.low_watermark} is above "
                              f"storage.high_watermark = {self.high_watermark}")
        for name in self.tenant_quotas:
            if len(name) > MAX_TENANT_CHARS or "/" in name:
                raise ConfigError(f"storage.tenant_quotas: {name[:40]!r} is not an account "
                                  f"name (at most {MAX_TENANT_CHARS} characters, no '/')")
        if (self.quotas() or self.namespace_quota_gib) and self.capacity_gib <= 0:
            raise ConfigError("storage.tenant_quota_gib / tenant_quotas / "
                              "namespace_quota_gib need storage.capacity_gib: the evictor "
                              "that keeps quotas runs only in a bounded store")

    def quotas(self) -> Quotas:
        """Each tenant account's bound in bytes (tags: dualpath/kv/prefix.py)."""
        return Quotas(int(self.tenant_quota_gib * 2**30),
                      {tenant_tag(n): int(g * 2**30) for n, g in self.tenant_quotas.items()})

    def capacity(self) -> StoreCapacity | None:
        if self.capacity_gib <= 0:
            return None
        return StoreCapacity(int(self.capacity_gib * 2**30), self.high_watermark,
                             self.low_watermark, self.hit_lease_s, self.upkeep_interval_s,
                             self.temp_max_age_s, self.quotas(),
                             int(self.namespace_quota_gib * 2**30))

    def integrity_key(self) -> bytes | None:
        """The key of integrity_key_file (None when unset); ConfigError naming the file
        when it is unreadable, too short or readable by every user."""
        if not self.integrity_key_file:
            return None
        path = self.integrity_key_file
        what = f"storage.integrity_key_file = {path!r}"
        try:
            data = Path(path).read_bytes()
            mode = os.stat(path).st_mode
        except OSError as e:
            raise ConfigError(f"{what}: cannot read ({e.strerror})") from None
        if mode & stat.S_IROTH:
            raise ConfigError(f"{what}: readable by every user (mode "
                              f"{stat.S_IMODE(mode):04o}); chmod 600 it")
        if len(data) < MIN_KEY_BYTES:
            raise ConfigError(f"{what}: {len(data)} bytes; the key needs at least "
                              f"{MIN_KEY_BYTES} (head -c 32 /dev/urandom > FILE)")
        return data

    def open_store(self, profile) -> BlockStore:
        """The node's BlockStore of ``profile`` as this section configures it."""
        return BlockStore(self.resolved_dir(), profile, read_workers=self.read_workers,
                          read_batch_depth=self.read_batch_depth,
                          read_rings=self.read_rings,
                          write_workers=self.write_workers, direct_io=self.direct_io,
                          verify_checksum=self.verify_checksum, fsync=self.fsync,
                          integrity_key=self.integrity_key(), capacity=self.capacity(),
                          index_max_keys=self.index_max_keys)

    def resolved_dir(self) -> Path:
        if self.dir:
            return Path(self.dir).expanduser()
        base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
        return Path(base) / "dualpath" / "kv"
