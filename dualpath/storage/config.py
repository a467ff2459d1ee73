"""The [storage] config section: where and how Full Blocks are stored and read."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from dualpath.config import key
from dualpath.storage.store import DIRECT_IO_MODES


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
    write_workers: int = key(2, "Concurrent block writes per node (worker threads).",
                             min=1, max=64)
    verify_checksum: bool = key(True, "Check each block's payload hash (XXH3-64) on read (a block "
                                "that fails is counted, quarantined and read as a miss).")
    fsync: bool = key(True, "fsync each block and its directory before it counts as "
                      "written. Turning it off gives up crash safety; for throwaway benches.")
    snic_gbit_per_s: float = key(0.0, "Emulated storage-NIC bandwidth of each node in Gbit/s "
                                 "(token bucket on its reads); 0 = no limit.", min=0.0)
    snic_burst_bytes: int = key(0, "Token-bucket depth of the storage-NIC emulation in bytes; "
                                "0 = 10 ms at the configured rate.", min=0)

    def resolved_dir(self) -> Path:
        if self.dir:
            return Path(self.dir).expanduser()
        base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
        return Path(base) / "dualpath" / "kv"
