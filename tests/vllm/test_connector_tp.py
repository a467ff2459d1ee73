"""DualPath's connector at tensor parallelism 2 (issue 39 item 1), with the seeded tiny
Llama of 2 KV heads (``tiny2``: each rank holds one). Both ranks' workers attach to the
node as ranks of one instance; the node stores the canonical block (both heads, the TP=1
order), so:

- a TP=2 conversation is bitwise vLLM's own prefix-cache hit at TP=2, and each load
  moves exactly the hit's blocks (each rank its head's half);
- KV saved at TP=2 is a hit for a TP=1 instance (another node on the same store) and
  gives the TP=1 oracle's tokens.
"""

from __future__ import annotations

import time

import pytest

from dualpath.cluster.vllm_node import ENGINE_ENV, NodeProcess, engine_args
from dualpath.vllm.driver import EngineProcess
from dualpath.vllm.models import TINY2
from tests.vllm.conftest import Conversation, make_rig, max_diff, same

T = 128                              # vLLM's CPU block size = DualPath's block_tokens
KV_BYTES = 2 * TINY2["num_key_value_heads"] * TINY2["head_dim"] * 4     # per token, layer
BLOCK_BYTES = TINY2["num_hidden_layers"] * T * KV_BYTES
# vLLM's CPU build binds each rank's threads to a core of its own; its default binding
# refuses a single NUMA node ("Not enough allowed NUMA nodes").
TP_ENV = {**ENGINE_ENV, "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
TP2 = {"tensor_parallel_size": 2}


@pytest.fixture(scope="module")
def rig(tmp_path_factory, model_dirs):
    r = make_rig(tmp_path_factory.mktemp("tp2"), model_dirs["tiny2"], 4096,
                 engine_extra=TP2, env=TP_ENV)
    yield r
    r.close()


def _loaded(node) -> float:
    return node.metric("dualpath_node_connector_loaded_bytes_total")


def test_a_tp2_conversation_is_bitwise_vllm_prefix_cache_at_tp2(rig):
    conv = Conversation(seed=21, first=300, append=150, gen=8)
    stored = 0
    for t in range(3):
        prompt = list(conv.context)
        before = _loaded(rig.node)
        a = rig.dp.generate(prompt, conv.gen)
        b = rig.oracle.generate(prompt, conv.gen)
        assert same(a, b), f"turn {t} ({len(prompt)} tokens): DualPath {a} vs vLLM {b}"
        loaded = _loaded(rig.node) - before
        want = min((len(prompt) - 1) // T, stored // T) * BLOCK_BYTES
        assert loaded == want and (t == 0 or loaded > 0), (t, loaded, want)
        stored = len(prompt) + conv.gen - 1
        conv.advance(a["token_ids"])
    log = rig.node.log_path.read_text()
    assert "rank 0 of 2: 2 of the block's 4 segments" in log
    assert "rank 1 of 2: 2 of the block's 4 segments" in log


def test_kv_saved_at_tp2_loads_at_tp1(rig, tmp_path, model_dirs):
    """A TP=1 instance beside another node on the same store hits the blocks the TP=2
    instance saved (one namespace: the model id has no TP size) and answers with the
    TP=1 oracle's tokens."""
    conv = Conversation(seed=22, first=400, append=100, gen=8)
    conv.advance(rig.dp.generate(list(conv.context), conv.gen)["token_ids"])  # TP=2 saves
    prompt = list(conv.context)
    deadline = time.monotonic() + 60             # its write-back reaches the store
    while rig.node.metric("dualpath_node_connector_pending_blocks") > 0:
        assert time.monotonic() < deadline, "the TP=2 node never persisted its saves"
        time.sleep(0.1)
    node = NodeProcess(tmp_path / "tp1", name="n1",
                       settings={"storage": {"dir": str(rig.node.store_dir)}}).start()
    engines = []
    try:
        model = model_dirs["tiny2"]
        dp = EngineProcess(engine_args(model, node=node, prefix_caching=False,
                                       max_model_len=4096), tmp_path / "dp1.log",
                           env=ENGINE_ENV)
        engines.append(dp)
        oracle = EngineProcess(engine_args(model, prefix_caching=True, max_model_len=4096),
                               tmp_path / "oracle1.log", env=ENGINE_ENV)
        engines.append(oracle)
        a = dp.generate(prompt, conv.gen)
        b = oracle.generate(prompt, conv.gen)
        loaded = _loaded(node)
        assert loaded == ((len(prompt) - 1) // T) * BLOCK_BYTES > 0, loaded
        assert a["token_ids"] == b["token_ids"], (a, b, max_diff(a, b))
        assert max_diff(a, b) <= 1e-4
    finally:
        for e in engines:
            e.close()
        node.stop()
