"""The engines of a node's group as the paths and the scheduler see them.

One :class:`EngineRank` per engine (one GPU): its identity, the scheduler-facing counts
(its requests' prompt tokens, the HBM promised to them, its concurrent prefills) and the
memory its KV lives in. An emulated engine's is an "HBM" region of the node's own
(dualpath/engines/emulated/engine.py); a vLLM instance's KV belongs to its workers, and
its rank's pool only counts its blocks (dualpath/engines/vllm/kind.py).

Threads: the node's event loop.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from dualpath.buffers.pool import BlockPool, Reservation
from dualpath.kv.placement import KvFormat, KvPlacement


@dataclass
class EngineRank:
    """One engine (one GPU) of a node's group: what the scheduler sees of it (its
    requests and the HBM promised to them) and where its KV lives."""

    engine_id: str
    rank: int
    region: str                          # its KV memory's registered region
    hbm: BlockPool
    tokens: dict[str, int] = field(default_factory=dict)           # request -> prompt tokens
    reserved_blocks: dict[str, int] = field(default_factory=dict)  # DE: HBM promised
    slots: asyncio.Semaphore | None = None                         # PE: concurrent prefills

    def placement(self, fmt: KvFormat) -> KvPlacement:
        """Its HBM slots as a placement: Full Block slots (a DE's), or Layer Block slots
        (a PE's, allocated a layer at a time: engines/emulated/forward.py)."""
        if self.hbm.layout.layers == 1 < fmt.layers:
            return KvPlacement.layer_slots(fmt, self.region, self.hbm.stride,
                                           self.hbm.capacity)
        return KvPlacement.full_blocks(fmt, self.region, self.hbm.stride, self.hbm.capacity)

    def units(self, fmt: KvFormat, res: Reservation) -> list[int]:
        return self.placement(fmt).units_of_slots(res.slots)
