"""Two node daemons sharing one store write their namespace's manifest at once (their
vLLM workers attach together): neither may fail. A shared temporary name did: one node
renamed the other's file away, whose Attach then failed with FileNotFoundError and took
its vLLM instance down (the vLLM tier, once)."""

from __future__ import annotations

import json
import os

from dualpath.engines.vllm import engine as vllm_engine
from dualpath.engines.vllm.engine import write_manifest


def test_two_writers_at_once_both_succeed(tmp_path, monkeypatch):
    manifest = tmp_path / "namespace.json"
    real = os.replace
    calls = []

    def interleaved(src, dst):
        if not calls:                       # the other node writes and renames first
            calls.append(src)
            write_manifest(manifest, {"writer": "b"})
        real(src, dst)
    monkeypatch.setattr(vllm_engine.os, "replace", interleaved)
    write_manifest(manifest, {"writer": "a"})
    assert json.loads(manifest.read_text()) == {"writer": "a"}
    assert [p.name for p in tmp_path.iterdir()] == ["namespace.json"]   # no temp left
