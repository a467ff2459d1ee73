"""A prefill that fails part way must not hand its HBM slots back while writes of earlier
layers still read from them: the next request would get those slots and the old writes
would carry its bytes into another request's DE buffer. Fakes record the order of
events; the failure is injected at layer 1's compute."""

import asyncio
import types

import numpy as np
import pytest

from dualpath.engine import prefill as prefill_mod
from dualpath.engine.kvplan import Payload
from dualpath.engine.prefill import PrefillPath
from dualpath.engine.state import RS_NONE
from dualpath.kv.profiles import get_profile

LAYERS = 4


class FakeHbm:
    def __init__(self, events):
        self.events = events

    def offset(self, i):
        return i * 4096

    def flat(self, i):
        return np.zeros(1 << 20, dtype=np.uint8)

    def release(self):
        self.events.append("hbm released")


class FakeTransfer:
    """Layer pushes that take a few loop turns (as a real WRITE takes its time)."""

    def __init__(self, events):
        self.events = events
        self.n = 0

    async def write(self, peer, items, *, local, remote):
        n, self.n = self.n, self.n + 1
        for _ in range(5):
            await asyncio.sleep(0)
        self.events.append(f"push {n} done")


class FakeSynth:
    def fill_layer(self, view, key, layer, s0):
        if layer == 1:
            raise RuntimeError("injected failure at layer 1")


class FakeNodeStub:
    def __init__(self, channel):
        pass

    async def PrepareRequest(self, req, timeout):
        return types.SimpleNamespace(block_offsets_bytes=[0])

    async def PrefillDone(self, req, timeout):
        return None


def test_failed_prefill_waits_for_in_flight_pushes_before_releasing_hbm(monkeypatch):
    events: list[str] = []
    profile = get_profile("demo")
    layout = types.SimpleNamespace(tokens=profile.block_tokens, layer_bytes=1024,
                                   token_bytes=8, layers=LAYERS)
    hbm = FakeHbm(events)

    async def reserve(nb):
        return hbm

    node = types.SimpleNamespace(
        layout=layout, profile=profile, address="pe:1", ecfg=types.SimpleNamespace(
            layerwise=True), pending_reads={}, channels=types.SimpleNamespace(
            channel=lambda addr: None), synth=FakeSynth(), transfer=FakeTransfer(events))
    monkeypatch.setattr(prefill_mod.node_pb2_grpc, "NodeStub", FakeNodeStub)
    monkeypatch.setattr(prefill_mod.cost, "request_prefill_s", lambda *a: 0.0)
    engine = types.SimpleNamespace(hbm=types.SimpleNamespace(reserve=reserve),
                                   gpu=asyncio.Lock(), region="hbm0")
    payload = Payload("t0", 0, prompt_tokens=8, hit_tokens=0, gen_tokens=1).encode()
    a = types.SimpleNamespace(request_id="r1", payload=payload, hit_tokens=0,
                              prompt_tokens=8, decode_control_address="de:1",
                              decode_engine_id="d0/e0", read_side=RS_NONE)
    path = PrefillPath(node)

    with pytest.raises(RuntimeError, match="injected"):
        asyncio.run(path._prefill_request(engine, a))
    # Layer 0's push was in flight when layer 1 failed; it must end before the release.
    assert events == ["push 0 done", "hbm released"], events
