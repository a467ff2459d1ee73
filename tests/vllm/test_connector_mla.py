"""DualPath's connector with an MLA model (a seeded tiny DeepSeek-V2: a 576-wide latent
per token and layer, no heads, no K/V planes; issue 39). vLLM's CPU MLA backend forces
prefix caching off, so the oracle is vLLM's own recompute of every turn: DualPath's
engine loads each turn's hit from the block store and must give the same greedy tokens
with logprobs within TOL (a load computes another span than the recompute), and the
bytes it loaded must be the hit's whole blocks of latent rows. At TP=2 the latent is the
same on both ranks (replicated): each rank loads it whole and both save it into one
save's slots.
"""

from __future__ import annotations

import pytest

from dualpath.cluster.vllm_node import ENGINE_ENV
from dualpath.vllm.models import MLA, MLA_ENGINE_ARGS
from tests.vllm.conftest import Conversation, close, make_rig, max_diff

T = 16                               # vLLM's MLA block size on CPU (forced)
LATENT = MLA["kv_lora_rank"] + MLA["qk_rope_head_dim"]
BLOCK_BYTES = MLA["num_hidden_layers"] * T * LATENT * 4      # float32


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def rig(request, tmp_path_factory, model_dirs):
    tp = request.param
    r = make_rig(tmp_path_factory.mktemp(f"mla-tp{tp}"), model_dirs["mla"], 2048,
                 engine_extra={**MLA_ENGINE_ARGS, "tensor_parallel_size": tp},
                 env={**ENGINE_ENV, "VLLM_CPU_OMP_THREADS_BIND": "0|1"} if tp > 1 else None)
    r.tp = tp
    yield r
    r.close()


def test_an_mla_conversation_loads_its_latent_kv_and_matches_the_recompute(rig):
    conv = Conversation(seed=11, first=200, append=100, gen=8)
    stored = 0                       # tokens whose latent the previous turns saved
    for t in range(3):
        prompt = list(conv.context)
        before = rig.node.metric("dualpath_node_connector_loaded_bytes_total")
        a = rig.dp.generate(prompt, conv.gen)
        b = rig.oracle.generate(prompt, conv.gen)
        loaded = rig.node.metric("dualpath_node_connector_loaded_bytes_total") - before
        assert close(a, b), (f"turn {t} ({len(prompt)} tokens): DualPath {a} vs vLLM's "
                             f"recompute {b} (max logprob diff {max_diff(a, b):.3g})")
        # The hit: the whole blocks the earlier turns saved, short of the last prompt token.
        # At TP=2 the latent is whole on both ranks: each loads all of it.
        want = min((len(prompt) - 1) // T, stored // T) * BLOCK_BYTES * rig.tp
        assert loaded == want and (t == 0 or loaded > 0), (t, loaded, want)
        stored = len(prompt) + conv.gen - 1
        conv.advance(a["token_ids"])
