"""The vLLM tier: real vLLM (the CPU build) with real models, DualPath's connector and a
real node daemon, against vLLM's own prefix cache.

Each rig is a node daemon (``dualpath node --role both --engine vllm``) and two engines
in child processes: ``dp`` (DualPath's connector, vLLM's prefix cache off, so every hit
comes through DualPath) and ``oracle`` (vLLM's prefix cache on, no connector). The
oracle answers a turn from KV it computed itself; the dp engine from KV it loaded from
the block store: equal outputs mean the loaded KV is the KV.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from dualpath.cluster.vllm_node import ENGINE_ENV, NodeProcess, engine_args
from dualpath.vllm import models
from dualpath.vllm.driver import EngineProcess


@pytest.fixture(scope="session")
def model_dirs() -> dict[str, Path]:
    """Prepared by `make install`; prepared here (once) when missing."""
    return models.prepare(models.default_dir())


@dataclass
class Rig:
    node: NodeProcess
    dp: EngineProcess
    oracle: EngineProcess

    def close(self) -> None:
        for e in (self.dp, self.oracle):
            e.close()
        self.node.stop()


def make_rig(tmp: Path, model: Path, max_model_len: int, node_settings: dict | None = None,
             engine_extra: dict | None = None, env: dict | None = None) -> Rig:
    node = NodeProcess(tmp / "node", settings=node_settings).start()
    extra = engine_extra or {}
    env = env or ENGINE_ENV
    try:
        dp = EngineProcess(engine_args(model, node=node, prefix_caching=False,
                                       max_model_len=max_model_len, **extra),
                           tmp / "dp.log", env=env)
        oracle = EngineProcess(engine_args(model, prefix_caching=True,
                                           max_model_len=max_model_len, **extra),
                               tmp / "oracle.log", env=env)
    except BaseException:
        node.stop()
        raise
    return Rig(node, dp, oracle)


@dataclass
class Conversation:
    """An agentic conversation as token ids: each turn's prompt is the previous
    context + the tokens generated for it + ``append`` new tokens (ids within the
    model's vocabulary, from a seeded generator)."""

    seed: int
    first: int = 300
    append: int = 200
    gen: int = 16
    vocab: int = 49152
    context: list[int] = field(default_factory=list)

    def __post_init__(self):
        self.rng = random.Random(self.seed)
        self.context = self._new(self.first)

    def _new(self, n: int) -> list[int]:
        return [self.rng.randrange(self.vocab) for _ in range(n)]

    def advance(self, generated: list[int]) -> list[int]:
        self.context = self.context + list(generated) + self._new(self.append)
        return self.context


def same(a: dict, b: dict) -> bool:
    """Bitwise: the same greedy tokens and the same logprob floats."""
    return a["token_ids"] == b["token_ids"] and a["logprobs"] == b["logprobs"]


def max_diff(a: dict, b: dict) -> float:
    return max(abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"]))


#: vLLM's CPU numerics are not bitwise stable between computation splits of the same
#: tokens (a prefix-cache hit vs a recompute from a block on; a P/D decode instance
#: recomputing the prompt's partial last block): identical floats on the AVX-512 hosts
#: of earlier runs, up to ~3e-6 on an AVX2-only one. Where DualPath's run computes
#: another span than its reference, outputs are compared within TOL; a wrong byte is far
#: outside it (the negative controls assert that).
TOL = 1e-4


def close(a: dict, b: dict, tol: float = TOL) -> bool:
    """The same greedy tokens and logprobs within ``tol``."""
    return a["token_ids"] == b["token_ids"] and max_diff(a, b) <= tol
