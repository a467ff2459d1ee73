"""What a node holds, and the idle invariant over it.

Once a cluster is idle (nothing queued, running or backing off at the scheduler, every
write-back drained) every node holds nothing: each pool's free slots equal its capacity,
nobody waits for slots, no memory is fenced, the read queue is empty and no request
keeps state. A node that breaks it leaked: slots a task never gave back (an await in a
clean-up that a cancel skipped), a fence never answered, a read queue entry never
forgotten. Node.Holdings answers a node's :class:`Holdings`; ``dualpath ctl check`` and
the fault tests hold every node to :func:`idle_violations`.

Pure: no I/O; the servicer and the ctl command are the shells.
"""

from __future__ import annotations

from dataclasses import dataclass

from dualpath.v1 import node_pb2


@dataclass(frozen=True)
class PoolHolding:
    name: str
    capacity: int
    free: int
    waiting: int = 0


@dataclass(frozen=True)
class Holdings:
    node_id: str
    pools: tuple[PoolHolding, ...]
    fenced_blocks: int = 0
    read_queue_tokens: int = 0
    requests: int = 0

    def to_pb(self) -> node_pb2.HoldingsResponse:
        return node_pb2.HoldingsResponse(
            node_id=self.node_id, fenced_blocks=self.fenced_blocks,
            read_queue_tokens=self.read_queue_tokens, requests=self.requests,
            pools=[node_pb2.PoolHolding(name=p.name, capacity_blocks=p.capacity,
                                        free_blocks=p.free, waiting_reservations=p.waiting)
                   for p in self.pools])

    @classmethod
    def from_pb(cls, pb: node_pb2.HoldingsResponse) -> Holdings:
        return cls(pb.node_id, tuple(PoolHolding(p.name, p.capacity_blocks, p.free_blocks,
                                                 p.waiting_reservations) for p in pb.pools),
                   pb.fenced_blocks, pb.read_queue_tokens, pb.requests)


def pool_holding(pool) -> PoolHolding:
    """A :class:`~dualpath.buffers.pool.BlockPool`'s figures now."""
    return PoolHolding(pool.name, pool.capacity, pool.free, pool.waiting)


def idle_violations(h: Holdings) -> list[str]:
    """What ``h`` still holds that an idle node must not (empty: the invariant holds)."""
    out = []
    for p in h.pools:
        if p.free != p.capacity:
            out.append(f"{h.node_id}: {p.capacity - p.free} of {p.capacity} {p.name} slots "
                       "taken")
        if p.waiting:
            out.append(f"{h.node_id}: {p.waiting} reservations waiting for {p.name} slots")
    if h.fenced_blocks:
        out.append(f"{h.node_id}: {h.fenced_blocks} blocks fenced")
    if h.read_queue_tokens:
        out.append(f"{h.node_id}: {h.read_queue_tokens} tokens in the read queue")
    if h.requests:
        out.append(f"{h.node_id}: state kept for {h.requests} requests")
    return out
