"""Each side's read queue counts the part of a hit it will read, from the moment it knows.

The scheduler picks the reading side by the read_q each node reports (paper §6.1). A
node that does not count a read it is about to do looks idle and gets more: the PE
counts its part from the assignment on, the DE from the PE's PrepareRequest on (its
``decode_read_tokens``: all of a DE read, its part of a split read), until the reads
themselves are queued.

The DE is a real node daemon in process (emulated engine, TCP, plaintext) called over
its gRPC surface; the PE side is the path's own accounting (no engine behind it).
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from dualpath import tls
from dualpath.engines.emulated.prefill import EmulatedPrefillPath
from dualpath.engines.vllm.prefill import VllmPrefillPath
from dualpath.errors import DualPathError
from dualpath.paths.assignment import Assignment
from dualpath.paths.payload import Payload
from dualpath.paths.peers import PeerClient, PrepareJob
from dualpath.paths.prefill import PrefillPath
from dualpath.roles import ReadSide
from dualpath.storage.read_queue import ReadQueue
from dualpath.trace.model import trajectory_token_ids
from dualpath.transfer.oob_grpc import GrpcChannels
from tests.integration.de_node import decode_node

BOUND_S = 60.0          # an outer bound against hangs, never a timing assertion
PROMPT, HIT = 256, 192  # the demo profile's 64-token blocks: 3 hit blocks of 4


def test_the_de_counts_its_part_of_a_split_read_from_prepare_on(tmp_path):
    async def main():
        async with decode_node(tmp_path) as (de, _):
            channels = GrpcChannels(tls.PLAINTEXT)
            try:
                await _prepares(de, PeerClient(channels))
            finally:
                await channels.close()

    asyncio.run(asyncio.wait_for(main(), BOUND_S))


async def _prepares(de, peers: PeerClient) -> None:
    def job(rid, part):
        payload = Payload("t0", 0, PROMPT, HIT, 1).encode()
        return PrepareJob(rid, "d0/e0", "127.0.0.1:9", PROMPT, HIT, payload,
                          1, part)
    assert de.read_q_tokens() == 0
    await peers.prepare(de.address, job("split", 64))
    assert de.read_q_tokens() == 64              # its part, not 0 nor the hit
    await peers.prepare(de.address, job("whole", HIT))
    assert de.read_q_tokens() == 64 + HIT
    await peers.prepare(de.address, job("pe", 0))
    assert de.read_q_tokens() == 64 + HIT
    with pytest.raises(DualPathError, match="INVALID_ARGUMENT.*decode_read_tokens"):
        await peers.prepare(de.address, job("big", HIT + 64))
    assert de.read_q_tokens() == 64 + HIT        # a refused one counts nothing


def _assignment(side: int, pe: int, de: int, policy: str = "scheduler") -> Assignment:
    payload = Payload("t0", 0, PROMPT, HIT, 1, read_policy=policy)
    return Assignment("r1", "p0/e0", "d0/e0", side, PROMPT, HIT, 1, pe, de, "d0:1",
                      payload, payload.encode(), 1)


def _path(cls, block_tokens: int = 64):
    """A prefill path whose assignments count on a real ReadQueue; prefills not run."""
    spawned = []

    def spawn(coro):
        coro.close()
        spawned.append(coro)
        return SimpleNamespace(done=lambda: False)
    node = SimpleNamespace(spawn=spawn, tokens=trajectory_token_ids,
                           peers=SimpleNamespace(expect=lambda peer, identity: None))
    path = cls.__new__(cls)
    PrefillPath.__init__(path, node, SimpleNamespace(
        read_queue=ReadQueue(store=SimpleNamespace(
        read_workers=1, profile=SimpleNamespace(block_tokens=block_tokens),
        layout=SimpleNamespace(full_bytes=1))), fmt=SimpleNamespace(block_tokens=block_tokens)))
    return path


@pytest.mark.parametrize("cls, side, pe, de, want", [
    (EmulatedPrefillPath, ReadSide.PREFILL, HIT, 0, HIT),
    (EmulatedPrefillPath, ReadSide.DECODE, 0, HIT, 0),
    (EmulatedPrefillPath, ReadSide.SPLIT, 128, 64, 128),    # a PE reads its part of a split only
    (EmulatedPrefillPath, ReadSide.SPLIT, 64, 128, 64),
    (VllmPrefillPath, ReadSide.PREFILL, HIT, 0, HIT),
    (VllmPrefillPath, ReadSide.DECODE, 0, HIT, 0),
    (VllmPrefillPath, ReadSide.SPLIT, 128, 64, 128),
    (VllmPrefillPath, ReadSide.SPLIT, 64, 128, 64),
])
def test_the_pe_counts_its_part_from_the_assignment_on(cls, side, pe, de, want):
    path = _path(cls)
    path.assign(SimpleNamespace(tokens={}), _assignment(side, pe, de))
    assert path.space.read_queue.read_q_tokens == want
