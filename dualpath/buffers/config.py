"""The [buffers] config section: the pinned DRAM region that holds the PE and DE buffers."""

from __future__ import annotations

from dataclasses import dataclass

from dualpath.buffers.region import HUGE_PAGE_MODES
from dualpath.config import key


@dataclass(frozen=True)
class BuffersConfig:
    """Per-process registered DRAM: PE buffer + DE buffer, carved from one pinned region."""

    pe_buffer_mib: int = key(256, "PE buffer (Full Blocks read from storage, staged for "
                             "layerwise transfer to HBM) in MiB.", min=0, max=1 << 24)
    de_buffer_mib: int = key(256, "DE buffer (Full Blocks read from storage or assembled from "
                             "prefill, and new blocks being persisted) in MiB.", min=0,
                             max=1 << 24)
    huge_pages: str = key("auto", "Back the region with 2 MiB huge pages: 'auto' uses them when "
                          "reserved (vm.nr_hugepages) else normal pages; 'on' requires them; "
                          "'off' never.", choices=HUGE_PAGE_MODES)
    mlock: bool = key(True, "Pin the region with mlock (needs RLIMIT_MEMLOCK >= its size: "
                      "`ulimit -l unlimited` or systemd LimitMEMLOCK=infinity).")
