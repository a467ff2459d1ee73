"""Prefill/decode at different tensor parallelism (issue 39 item 2), with the seeded
tiny Llama of 2 KV heads (``tiny2``): a prefill instance at TP=2 with a decode instance
at TP=1, and the reverse. Every node keeps the canonical block (both heads, the TP=1
order), so what crosses nodes does not depend on either side's TP; each side's ranks get
their heads from it. Each read path is forced once (the PE's, the DE's, the split) and
every turn is a single instance at the decode's TP (vLLM's own prefix cache): greedy
tokens equal, logprobs within conftest.TOL; so are three requests at once near the full
context, after which every pool is whole and no fence held. The negative control gives each rank of the
TP=2 instance the other rank's heads (fault ``tp_swap_ranks``): the outputs leave the
oracle's.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from dualpath.cluster.vllm_node import ENGINE_ENV, engine_args
from dualpath.cluster.vllm_pd import VllmPdCluster
from dualpath.vllm.driver import EngineProcess
from dualpath.vllm.models import TINY2
from tests.faults.conftest import wait_idle_invariant
from tests.vllm.conftest import Conversation, close, max_diff
from tests.vllm.test_pd import Rig, pe_read_under_fault

T = 128
BLOCK_BYTES = TINY2["num_hidden_layers"] * T * 2 * TINY2["num_key_value_heads"] * \
    TINY2["head_dim"] * 4
TP_ENV = {**ENGINE_ENV, "VLLM_CPU_OMP_THREADS_BIND": "0|1"}


@pytest.fixture(scope="module", params=["p2d1", "p1d2"])
def rig(request, tmp_path_factory, model_dirs):
    tmp = tmp_path_factory.mktemp(request.param)
    ptp, dtp = int(request.param[1]), int(request.param[3])
    model = model_dirs["tiny2"]
    oracle = EngineProcess(engine_args(model, prefix_caching=True, max_model_len=4096,
                                       tensor_parallel_size=dtp),
                           tmp / "oracle.log", env=TP_ENV if dtp > 1 else ENGINE_ENV)
    try:
        pd = VllmPdCluster(model, work_dir=str(tmp / "cluster"), prefill_tp=ptp,
                           decode_tp=dtp).start()
    except BaseException:
        oracle.close()
        raise
    r = Rig(pd, oracle)
    r.topology = request.param
    yield r
    r.close()
    oracle.close()


def test_pd_at_different_tp_is_the_decodes_tp_on_every_read_path(rig):
    conv = Conversation(seed=121, first=300, append=200, gen=8)
    stored = 0
    for policy in ("scheduler", "prefill", "decode", "split"):
        prompt = list(conv.context)
        a = rig.turn(prompt, conv.gen, stored, policy)
        b = rig.oracle.generate(prompt, conv.gen)
        assert a["token_ids"] == b["token_ids"], (rig.topology, policy, a, b)
        assert close(a, b), (rig.topology, policy, max_diff(a, b))
        g = a["g"]
        hit = min(stored // T, (len(prompt) - 1) // T) * BLOCK_BYTES
        assert g.prefill_read_bytes + g.decode_read_bytes == hit, (policy, g)
        if policy == "prefill":
            assert g.decode_read_bytes == 0 and hit > 0
        elif policy == "decode":
            assert g.prefill_read_bytes == 0 and hit > 0
        elif policy == "split":
            assert g.prefill_read_bytes > 0 and g.decode_read_bytes > 0
        stored = len(prompt) + conv.gen - 1
        conv.advance(a["token_ids"])
    tp2 = "p0" if rig.topology == "p2d1" else "d0"
    log = (rig.pd.dir / "logs" / f"{tp2}.log").read_text()
    assert "rank 1 of 2: 2 of the block's 4 segments" in log


def test_concurrent_requests_near_the_full_context_at_different_tp(rig):
    """Three requests at once, each a stored 3,800-token prefix plus its own suffix (near
    the instances' 4,096-token context), on the buffers `up` derives: each served at its
    first attempt with the oracle's tokens (the ranks' saves and loads of several requests
    interleave), and once idle every pool is whole again and no fence is held."""
    rng = random.Random(41)
    prefix = [rng.randrange(49152) for _ in range(3800)]
    rig.turn(prefix, 2, 0)                              # computes and stores it
    rig.pd.wait_written()
    prompts = [prefix + [rng.randrange(49152) for _ in range(100)] for _ in range(3)]

    async def together():
        return await asyncio.gather(*(rig.gen.generate(
            f"{rig.topology}-k{i}", p, 8, hit_tokens=len(prefix), block_tokens=T,
            timeout_s=300) for i, p in enumerate(prompts)))
    got = rig.loop.run_until_complete(together())
    for p, g in zip(prompts, got):
        assert g.attempt == 1, g
        a = {"token_ids": g.token_ids, "logprobs": g.logprobs}
        b = rig.oracle.generate(p, 8)
        assert a["token_ids"] == b["token_ids"] and close(a, b), (max_diff(a, b), g)
    wait_idle_invariant(rig.pd.cluster)


@pytest.mark.parametrize("rig", ["p2d1"], indirect=True)
def test_negative_control_each_rank_given_the_other_ranks_heads_is_seen(rig):
    bad, ref = pe_read_under_fault(rig, "tp_swap_ranks", 131)
    assert not close(bad, ref), max_diff(bad, ref)
