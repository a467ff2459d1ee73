"""GPU correctness by construction (issue 39 item 5), the parts a host without a GPU can
check: a save's WRITE of a layer waits for the call that says the layer's compute is
complete (on a GPU, an event recorded on the model's stream), never starts before it;
host-memory KV needs none; and the connector asks vLLM for PIECEWISE CUDA graphs, since
its layer hooks wait on and start transfers that a full graph's replay would skip."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from types import SimpleNamespace

import pytest

from dualpath.vllm import agent as agent_mod
from dualpath.vllm.agent import SaveHandle, WorkerAgent
from dualpath.vllm.worker_side import WorkerSide


def test_a_layers_write_starts_only_after_its_compute_is_complete(monkeypatch):
    order: list[str] = []
    done = threading.Event()

    async def write_layer(*a, **kw):
        order.append("write")

    def computed():                   # the event's synchronize(), on a thread of its own
        done.wait(5)
        order.append("computed")

    monkeypatch.setattr(agent_mod, "write_layer", write_layer)
    a = object.__new__(WorkerAgent)
    a.attached = SimpleNamespace(buffer=SimpleNamespace(units_of_slots=lambda s: s))
    a.placement = SimpleNamespace(fmt=SimpleNamespace(block_tokens=16))
    a.transfer, a.settings = None, SimpleNamespace(node_address="n")
    h = SaveHandle("r", [b"k"], [0])
    h.begun = concurrent.futures.Future()
    h.begun.set_result((1, [3]))

    async def main():
        task = asyncio.ensure_future(a._save_layer(h, 0, computed))
        await asyncio.sleep(0.05)
        assert order == [] and not task.done()        # the GPU is still computing
        done.set()
        await task
    asyncio.run(main())
    assert order == ["computed", "write"] and h.ok


def test_host_memory_kv_needs_no_event():
    w = object.__new__(WorkerSide)
    w.kv = SimpleNamespace(ranges=[SimpleNamespace(gpu_device=None)])
    assert w._layer_computed() is None


def test_gpu_kv_gets_an_event_on_the_models_stream():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (torch sees none): the event is recorded on its stream")
    w = object.__new__(WorkerSide)
    w.kv = SimpleNamespace(ranges=[SimpleNamespace(gpu_device=0)])
    x = torch.ones(1 << 24, device="cuda")
    for _ in range(8):
        x = x * 1.0001                                # queued kernels
    computed = w._layer_computed()
    computed()
    assert torch.cuda.current_stream().query()        # the queued kernels are done


def test_the_connector_asks_for_piecewise_cuda_graphs():
    from dualpath.vllm.connector import DualPathConnector

    assert DualPathConnector.requires_piecewise_for_cudagraph({}) is True
