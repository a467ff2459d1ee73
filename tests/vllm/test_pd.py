"""Prefill/decode disaggregation with vLLM: a scheduler, a prefill node and a decode node
(each beside its own `vllm serve`), both read paths and a real split read into vLLM's
KV cache, against the single-instance oracle (vLLM's own prefix cache).

Every turn goes through the scheduler: the prefill node stages the hit (its own reads,
the decode node's, or both), drives its instance for the prompt, and sends every prompt
block to the decode node's buffer; the decode node's instance loads them and generates.
Equal greedy tokens and logprobs mean the KV that crossed both nodes is the KV.
"""

from __future__ import annotations

import asyncio

import pytest

from dualpath.cluster.generate import Generator
from dualpath.vllm.driver import EngineProcess
from dualpath.vllm.local import ENGINE_ENV, engine_args
from dualpath.vllm.pd import VllmPdCluster
from tests.vllm.conftest import Conversation

T = 128
BLOCK_BYTES = 4 * T * 256          # a Full Block of the tiny model


class Rig:
    def __init__(self, pd: VllmPdCluster, oracle: EngineProcess):
        self.pd, self.oracle = pd, oracle
        self.loop = asyncio.new_event_loop()
        c = pd.cluster
        self.gen = self.loop.run_until_complete(
            Generator(c.scheduler_address, c.client_tls, c.node_tls).start())
        self.n = 0

    def turn(self, prompt: list[int], gen: int, hit: int, policy: str) -> dict:
        self.n += 1
        g = self.loop.run_until_complete(self.gen.generate(
            f"pd-{self.n}", prompt, gen, hit_tokens=hit, block_tokens=T,
            read_policy=policy, timeout_s=300))
        return {"token_ids": g.token_ids, "logprobs": g.logprobs, "g": g}

    def close(self) -> None:
        self.loop.run_until_complete(self.gen.close())
        self.loop.close()
        self.oracle.close()
        self.pd.stop()
        self.pd.cleanup()


@pytest.fixture(scope="module")
def rig(tmp_path_factory, model_dirs):
    tmp = tmp_path_factory.mktemp("pd")
    pd = VllmPdCluster(model_dirs["tiny"], work_dir=str(tmp / "cluster")).start()
    try:
        oracle = EngineProcess(engine_args(model_dirs["tiny"], prefix_caching=True,
                                           max_model_len=4096), tmp / "oracle.log",
                               env=ENGINE_ENV)
    except BaseException:
        pd.stop()
        raise
    r = Rig(pd, oracle)
    yield r
    r.close()


def _reads(g, stored: int, prompt: int, policy: str) -> None:
    """Who read the hit from storage: the side(s) the policy forced, all of it."""
    hit_bytes = min(stored // T, (prompt - 1) // T) * BLOCK_BYTES
    pe, de = g.prefill_read_bytes, g.decode_read_bytes
    assert pe + de == hit_bytes, (policy, pe, de, hit_bytes)
    if policy == "prefill":
        assert de == 0
    elif policy == "decode":
        assert pe == 0
    elif policy == "split":
        assert pe > 0 and de > 0


def test_a_pd_conversation_is_bitwise_the_oracle_on_every_read_path(rig):
    """Turn 1 computes everything; then the PE read, the DE read, the split read and
    the scheduler's own choice, each bitwise the oracle, each read by the side(s) it
    names."""
    conv = Conversation(seed=101, first=300, append=200, gen=16)
    stored = 0
    for policy in ("scheduler", "prefill", "decode", "split", "scheduler"):
        prompt = list(conv.context)
        a = rig.turn(prompt, conv.gen, stored, policy)
        b = rig.oracle.generate(prompt, conv.gen)
        assert a["token_ids"] == b["token_ids"], policy
        assert a["logprobs"] == b["logprobs"], policy
        _reads(a["g"], stored, len(prompt), policy)
        stored = len(prompt) + conv.gen - 1
        conv.advance(a["token_ids"])
