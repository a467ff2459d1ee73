"""The figures a simulated cluster runs on: its shape and hardware, with two presets —
the paper's (8 GPUs a node, 400 Gbit/s storage and compute NICs) and this repository's
local cluster (`LocalCluster`: one emulated engine a node, the demo profile, the storage
NIC a token bucket, the compute network loopback TCP). Pure."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from dualpath.errors import UsageError
from dualpath.kv.profiles import GiB, ModelProfile, get_profile
from dualpath.storage.ratelimit import UNLIMITED_BYTES_PER_S

MiB = 1 << 20


@dataclass(frozen=True)
class SimHardware:
    """One node type's figures (bytes, bytes/s, seconds). ``snic_bytes_per_s`` is each
    direction of a node's storage NIC (full duplex, as storage/ratelimit.py); 0 =
    unlimited. ``cnic_bytes_per_s`` is one GPU's compute NIC; a node moves
    ``engines_per_node`` times that in and out. ``host_cores`` > 0 models a host CPU
    shared by the whole cluster (a local cluster on one machine): every request costs
    it ``cpu_s_per_request`` plus ``cpu_s_per_byte`` per KV byte it moves, before its
    prefill may start."""

    model: str = "demo"
    speed_scale: float = 1.0
    engines_per_node: int = 1
    snic_bytes_per_s: float = 0.25e9 / 8
    cnic_bytes_per_s: float = 3e9
    pe_buffer_bytes: int = 512 * MiB
    de_buffer_bytes: int = 512 * MiB
    prefill_hbm_bytes: int = 512 * MiB
    decode_hbm_bytes: int = 256 * MiB
    max_prefills_per_engine: int = 16
    fetch_interval_s: float = 0.005
    compute_quota_ms: int = 300
    alpha_window_s: float = 3.0
    beta_window_s: float = 5.0
    host_cores: float = 0.0
    cpu_s_per_request: float = 0.0
    cpu_s_per_byte: float = 0.0
    rpc_s: float = 0.001             # mean round trip of a leader's fetch (s)
    # The replay driver: from a round's DECODE_DONE being recorded to the next round's
    # submission (its result's way to the driver, the driver's loop).
    client_s: float = 0.0
    # One node-to-node control hop (PrepareRequest, a LoadOrder, PrefillDone).
    hop_s: float = 0.0
    # A node's memory bandwidth: only §4.2's analytic range reads it (`dualpath plan`).
    mem_bytes_per_s: float = 20e9

    def __post_init__(self):
        if self.engines_per_node < 1 or self.max_prefills_per_engine < 1:
            raise UsageError("engines_per_node and max_prefills_per_engine must be >= 1")
        for f in ("speed_scale", "fetch_interval_s", "cnic_bytes_per_s", "mem_bytes_per_s"):
            if not getattr(self, f) > 0:
                raise UsageError(f"hardware {f} must be > 0, got {getattr(self, f)!r}")
        for f in ("snic_bytes_per_s", "host_cores", "cpu_s_per_request", "cpu_s_per_byte",
                  "rpc_s", "client_s", "hop_s"):
            if getattr(self, f) < 0:
                raise UsageError(f"hardware {f} must be >= 0, got {getattr(self, f)!r}")
        for f in ("pe_buffer_bytes", "de_buffer_bytes", "prefill_hbm_bytes",
                  "decode_hbm_bytes"):
            if getattr(self, f) < 1:
                raise UsageError(f"hardware {f} must be >= 1 byte")
        get_profile(self.model)            # a known profile, or UsageError

    @property
    def snic_rate(self) -> float:
        """The storage NIC's rate where it must be a number (an unlimited one counts as
        storage/ratelimit.py's UNLIMITED_BYTES_PER_S)."""
        return self.snic_bytes_per_s or UNLIMITED_BYTES_PER_S

    @property
    def profile(self) -> ModelProfile:
        """The model as the engines run it (compute scaled by ``speed_scale``)."""
        return get_profile(self.model).scaled(self.speed_scale)

    def with_(self, **changes) -> SimHardware:
        known = {f.name for f in fields(self)}
        bad = sorted(set(changes) - known)
        if bad:
            raise UsageError(f"unknown hardware figure {bad[0]!r}; known: {sorted(known)}")
        return replace(self, **changes)


#: The local cluster of dualpath/cluster/local.py as dualpath/repro/figures.py runs it:
#: one emulated engine per node (demo profile), 512 MiB PE/DE buffers and PE HBM,
#: 256 MiB DE HBM, 16 prefills per engine, leaders fetching every 5 ms, KV between
#: nodes over loopback TCP (~3 GB/s measured, docs/architecture.md). The fetch round
#: trip and the replay driver's delay are bench/sim_validate.py's calibration on this
#: 2-core host (docs/sim.md: 2.5 ms and 25 ms; the CPU per request and per byte and the
#: node-to-node hop came out 0 there).
LOCAL = SimHardware(rpc_s=0.0025, client_s=0.025)

#: The paper's cluster (§4.2, §7): 8 Hopper GPUs a node, a 400 Gbit/s compute NIC per
#: GPU and one 400 Gbit/s storage NIC per node, ~500 GB/s of memory bandwidth, DS 660B;
#: HBM for KV as the emulated engine's ([engine] prefill_hbm_mib/decode_hbm_mib) 16 GiB a
#: PE engine, 40 GiB a DE engine, and deploy/cluster-multinode.toml's 64 GiB PE and DE
#: buffers a node (the paper gives none).
#: Leaders fetch every 20 ms (the scheduler's default).
PAPER = SimHardware(model="ds660b", engines_per_node=8, snic_bytes_per_s=50e9,
                    cnic_bytes_per_s=50e9, pe_buffer_bytes=64 * GiB,
                    de_buffer_bytes=64 * GiB, prefill_hbm_bytes=16 * GiB,
                    decode_hbm_bytes=40 * GiB, fetch_interval_s=0.020,
                    mem_bytes_per_s=500e9)

PRESETS = {"local": LOCAL, "paper": PAPER}


@dataclass(frozen=True)
class Shape:
    """P prefill and D decode nodes."""

    prefill_nodes: int
    decode_nodes: int

    def __post_init__(self):
        if self.prefill_nodes < 1 or self.decode_nodes < 1:
            raise UsageError(f"a cluster needs >= 1 prefill and >= 1 decode node, got "
                             f"{self.prefill_nodes}P{self.decode_nodes}D")

    def __str__(self) -> str:
        return f"{self.prefill_nodes}P{self.decode_nodes}D"

    @classmethod
    def parse(cls, text: str) -> Shape:
        t = text.strip().upper()
        try:
            p, d = t.rstrip("D").split("P")
            return cls(int(p), int(d))
        except ValueError:
            raise UsageError(f"cluster shape {text!r}: write it as <P>P<D>D, e.g. "
                             "1P2D") from None
