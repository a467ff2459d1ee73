"""The vLLM model id (the store namespace of a model's KV; dualpath/vllm/settings.py) is
what defines the KV, not where or when the weights were written: two hosts holding the
same weights, copied at different times to different paths, share one namespace and
so their hits (issue 40); another checkpoint, config or geometry never does.
"""

from __future__ import annotations

import json
import os
import shutil
from types import SimpleNamespace

import numpy as np
import pytest

from dualpath.errors import UsageError
from dualpath.vllm import settings
from dualpath.vllm.settings import ConnectorSettings, model_id, model_identity


def _write_model(d, seed=0, hidden=64):
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": hidden,
                                               "num_hidden_layers": 4,
                                               "_name_or_path": str(d)}))
    data = np.random.default_rng(seed).standard_normal(300_000).astype(np.float32).tobytes()
    header = json.dumps({"w": {"dtype": "F32", "shape": [300_000],
                               "data_offsets": [0, len(data)]}}).encode()
    (d / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + data)
    return d


def _config(path, *, tp=1, block=128, hf=None):
    mc = SimpleNamespace(model=str(path), revision=None, dtype="torch.float32",
                         served_model_name=str(path), use_mla=False, hf_config=hf,
                         get_num_layers=lambda pc: 4, get_total_num_kv_heads=lambda: 1,
                         get_head_size=lambda: 32)
    return SimpleNamespace(model_config=mc,
                           cache_config=SimpleNamespace(cache_dtype="auto", block_size=block),
                           parallel_config=SimpleNamespace(tensor_parallel_size=tp))


def test_the_same_weights_copied_elsewhere_later_share_one_id(tmp_path):
    a = _write_model(tmp_path / "host-a" / "tiny")
    b = tmp_path / "host-b" / "TinyLlama-copy"       # another path, another name
    shutil.copytree(a, b)
    (b / "config.json").write_text(json.dumps({**json.loads((b / "config.json").read_text()),
                                               "_name_or_path": "/elsewhere"}))
    for f in b.iterdir():                    # written an hour later on the other host
        os.utime(f, (f.stat().st_atime + 3600, f.stat().st_mtime + 3600))
    assert model_identity(str(a)) == model_identity(str(b))
    assert model_id(_config(a)) == model_id(_config(b))
    assert model_id(_config(a)).startswith("llama-")


def test_another_checkpoint_config_or_geometry_is_another_id(tmp_path):
    a = _write_model(tmp_path / "a" / "m")
    ids = {model_id(_config(a))}
    other = _write_model(tmp_path / "b" / "m", seed=1)          # other weights
    ids.add(model_id(_config(other)))
    wider = _write_model(tmp_path / "c" / "m", hidden=128)      # other config
    ids.add(model_id(_config(wider)))
    ids.add(model_id(_config(a, block=16)))                     # other KV geometry
    # The config vLLM runs (an override: rope scaling) is not the file's.
    hf = SimpleNamespace(to_dict=lambda: {"model_type": "llama", "hidden_size": 64,
                                          "num_hidden_layers": 4,
                                          "rope_scaling": {"factor": 2.0}})
    ids.add(model_id(_config(a, hf=hf)))
    # One byte changed in place, anywhere (same size, same header): a small file is
    # hashed whole.
    f = a / "model.safetensors"
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2 + 3] ^= 0xFF
    f.write_bytes(bytes(raw))
    ids.add(model_id(_config(a)))
    assert len(ids) == 6


def test_a_large_file_is_known_by_its_header_and_every_tensors_edges(tmp_path, monkeypatch):
    monkeypatch.setattr(settings, "WHOLE_BYTES", 1024)      # as if it were 600 GB
    a = _write_model(tmp_path / "a" / "m")
    f = a / "model.safetensors"
    first = model_identity(str(a))
    raw = bytearray(f.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    raw[8 + n + 5] ^= 0xFF                   # the tensor's first bytes (a whole-tensor edit)
    f.write_bytes(bytes(raw))
    assert model_identity(str(a)) != first


def test_an_operator_set_id_is_used_as_it_is_and_checked():
    s = ConnectorSettings.from_extra_config({"node_address": "h:1", "model_id": "llama-70b.v3"})
    assert s.model_id == "llama-70b.v3"
    assert ConnectorSettings.from_extra_config({"node_address": "h:1"}).model_id == ""
    for bad in ("a/b", "x" * 65, 7):
        with pytest.raises(UsageError, match="model_id must be 1-64 letters"):
            ConnectorSettings.from_extra_config({"node_address": "h:1", "model_id": bad})


def test_the_tensor_parallel_size_is_not_part_of_the_id(tmp_path):
    """Issue 39 item 1: the stored block is the canonical one at any TP, so KV saved at
    TP=2 is a hit at TP=1."""
    a = _write_model(tmp_path / "m")
    assert model_id(_config(a, tp=1)) == model_id(_config(a, tp=2)) == \
        model_id(_config(a, tp=4))
