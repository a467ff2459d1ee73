"""One conversation with the real model: SmolLM2-135M-Instruct (30 layers, 3 KV heads of
64, float32: 46,080 KV bytes per token), its hits loaded through DualPath, bitwise
vLLM's own prefix-cache run."""

from __future__ import annotations

import pytest

from tests.vllm.conftest import Conversation, make_rig, same

T = 128
BLOCK_BYTES = T * 46080          # a Full Block of SmolLM2: 30 layers x 3 heads x K,V x 64 x 4


@pytest.fixture(scope="module")
def rig(tmp_path_factory, model_dirs):
    r = make_rig(tmp_path_factory.mktemp("smollm2"), model_dirs["smollm2"], 8192)
    yield r
    r.close()


def test_smollm2_conversation_is_bitwise_vllm_prefix_cache(rig):
    conv = Conversation(seed=7, first=1500, append=300, gen=8)
    stored = 0
    for t in range(3):
        before = rig.node.metric("dualpath_node_connector_loaded_bytes_total")
        prompt = list(conv.context)
        a = rig.dp.generate(prompt, conv.gen)
        b = rig.oracle.generate(prompt, conv.gen)
        assert same(a, b), f"turn {t} ({len(prompt)} tokens): DualPath {a} vs vLLM {b}"
        hit_blocks = min((len(prompt) - 1) // T, stored // T)
        loaded = rig.node.metric("dualpath_node_connector_loaded_bytes_total") - before
        assert loaded == hit_blocks * BLOCK_BYTES, (t, loaded, hit_blocks)
        assert t == 0 or hit_blocks >= 11         # ~95% of the prompt from the store
        stored = len(prompt) + conv.gen - 1
        conv.advance(a["token_ids"])
