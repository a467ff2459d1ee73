"""What a node daemon hands its paths: a frozen set of the node's resources.

The daemon (dualpath/node/daemon.py) assembles these once at start-up and closes them in
reverse; a path holds this object and nothing of the daemon itself, so a path can be
built in a test from a handful of real or fake parts.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Protocol

from dualpath.config import Config
from dualpath.paths.fence import Fences
from dualpath.paths.metrics import CountingLimiter, NodeMetrics
from dualpath.paths.payload import TokenSource
from dualpath.paths.peers import PeerClient
from dualpath.paths.ranks import EngineRank
from dualpath.roles import CompletionStage
from dualpath.transfer import TransferEngine


class Complete(Protocol):
    """Queue a completion (a CompletionStage) for the leader's next fetch; a FAILED one
    says why and, when known, which engine is to blame ("" = unknown: both sides);
    ``final``: no attempt can succeed (the scheduler ends the request, no retry)."""

    def __call__(self, rid: str, engine: EngineRank, stage: CompletionStage, error: str = "",
                 suspect: str = "", final: bool = False) -> None: ...


Spawn = Callable[[Coroutine], asyncio.Task]


@dataclass(frozen=True)
class NodeResources:
    node_id: str
    role: str
    address: str                    # our control address = our transfer engine's name
    cfg: Config
    transfer: TransferEngine
    peers: PeerClient
    limiter: CountingLimiter
    metrics: NodeMetrics
    tokens: TokenSource             # token ids of payloads that carry none
    spawn: Spawn                    # a task the node cancels at close
    complete: Complete
    fences: Fences                  # memory a peer may still write into (paths/fence.py)
