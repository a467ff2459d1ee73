"""The vLLM connector's data plane without vLLM: a real node daemon (engine.kind = vllm,
role both, TCP provider on loopback) and a real WorkerAgent whose "KV tensors" are a
numpy array laid out as vLLM's CPU backend lays them out ([blocks, heads, K|V, tokens,
head bytes] per layer). Blocks saved from the worker come back, byte for byte, into
other engine blocks; a corrupt or deleted stored block is reported failed and never
written (vLLM would recompute it).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time

import grpc
import numpy as np
import pytest

from dualpath import config as _config
from dualpath import tls
from dualpath.kv.placement import KvFormat, KvPlacement
from dualpath.kv.prefix import block_keys
from dualpath.node.daemon import NodeDaemon
from dualpath.v1 import connector_pb2, connector_pb2_grpc
from dualpath.vllm.agent import AgentSettings, MemoryRange, WorkerAgent

L, H, B, D = 3, 2, 16, 64            # layers, KV heads, tokens per block, bytes per head row
UNITS = 12                           # engine blocks per layer
UNIT = H * 2 * B * D


def _cpu_like_placement() -> KvPlacement:
    segs = [(h, p) for h in range(H) for p in range(2)]
    fmt = KvFormat(L, B, (D,) * len(segs))
    return KvPlacement(fmt, ("kv",) * L, tuple((layer * UNITS * UNIT,) for layer in range(L)),
                       (0,) * len(segs), tuple(h * 2 * B * D + p * B * D for h, p in segs),
                       UNIT, UNITS)


class Daemon:
    """The node daemon on a loop of its own thread (the agent's calls block), over mutual
    TLS with a throw-away PKI (node/n0: the daemon and its worker; client/x: a cluster
    identity that is not the node)."""

    def __init__(self, tmp):
        self.pki = tls.make_cluster_pki(tmp / "tls", ["node/n0", "node/n1", "client/x"])
        t = self.pki.section("node/n0")
        cfg = _config.load(None, {"engine.kind": "vllm", "transport.kind": "tcp",
                                  "storage.dir": str(tmp / "kv"), "storage.fsync": False,
                                  "buffers.pe_buffer_mib": 4, "buffers.mlock": False,
                                  **{f"tls.{k}": v for k, v in t.items()}})
        self.loop = asyncio.new_event_loop()
        self.node = NodeDaemon(cfg, "both", "n0", "")
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.call(self.node.start())

    def call(self, coro, timeout=30):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self):
        self.call(self.node.close())
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture(scope="module", params=["write", "copy"])
def rig(tmp_path_factory, request):
    """``write``: the daemon WRITEs into the worker's memory over the data plane;
    ``copy``: the worker maps the daemon's shared buffer and copies each layer."""
    d = Daemon(tmp_path_factory.mktemp("node"))
    mem = np.zeros(L * UNITS * UNIT, np.uint8)
    agent = WorkerAgent(AgentSettings(node_address=d.node.address, model_id="test-model",
                                      transport=_config.load(None, {"transport.kind": "tcp"}
                                                             ).transport,
                                      tls=d.pki.config("node/n0"),
                                      shared_buffer=request.param == "copy"),
                        [MemoryRange("kv", mem.ctypes.data, mem.nbytes)], _cpu_like_placement())
    agent.start()
    assert (agent.shared is not None) == (request.param == "copy")
    ch = tls.sync_channel(d.node.address, d.pki.config("node/n0"))
    yield d, agent, mem, connector_pb2_grpc.KvConnectorStub(ch)
    ch.close()
    agent.close()
    d.close()


def _engine_block(mem, layer, unit):
    off = (layer * UNITS + unit) * UNIT
    return mem[off:off + UNIT]


def _fill(mem, units, rng) -> None:
    """Random bytes in every layer of engine blocks ``units``."""
    for layer in range(L):
        for u in units:
            _engine_block(mem, layer, u)[:] = rng.integers(0, 256, UNIT, dtype=np.uint8)


def _load(agent, keys, units, rid="r-load"):
    """Load ``keys`` into ``units`` as vLLM's forward would: wait for each layer (on a
    shared buffer, the agent copies it as it arrives), then give the load back."""
    h = agent.load(rid, keys, units)
    for layer in range(L):
        assert h.wait_layer(layer, 30)
        assert h.ready > layer or h.error
    agent.end_load(h)
    return h


def _save(agent, keys, units):
    h = agent.begin_save("r-save", keys, units)
    for layer in range(L):
        agent.save_layer(h, layer)
    return agent.finish_save(h, commit=True)


def _wait_stored(d, keys, stub):
    """Lookups count committed blocks at once (write-back); wait until they are on disk
    too (a generous liveness bound, not a timing)."""
    assert stub.Lookup(connector_pb2.LookupRequest(model_id="test-model",
                                                   block_keys=keys)).hit_blocks == len(keys)
    store = d.node.engine.vllm.space.store
    deadline = time.monotonic() + 60
    while not all(store.contains(k) for k in keys):
        assert time.monotonic() < deadline, "committed blocks never reached the store"
        time.sleep(0.05)


def test_save_then_load_moves_exact_bytes_into_other_blocks(rig):
    d, agent, mem, stub = rig
    rng = np.random.default_rng(1)
    keys = block_keys(np.arange(3 * B) + 1000, B)
    src, dst = [2, 5, 6], [9, 0, 11]
    _fill(mem, src, rng)
    assert _save(agent, keys, src)
    _wait_stored(d, keys, stub)
    h = _load(agent, keys, dst)
    assert not h.failed and not h.error
    for layer in range(L):
        for s, t in zip(src, dst):
            assert np.array_equal(_engine_block(mem, layer, s), _engine_block(mem, layer, t))
    # A lookup stops at the first hole; a key that was never saved misses.
    other = block_keys(np.arange(2 * B) + 5000, B)
    assert stub.Lookup(connector_pb2.LookupRequest(model_id="test-model",
                                                   block_keys=keys[:2] + other)).hit_blocks == 2
    assert stub.Lookup(connector_pb2.LookupRequest(model_id="another-model",
                                                   block_keys=keys)).hit_blocks == 0


def test_corrupt_and_deleted_blocks_are_reported_and_never_written(rig):
    d, agent, mem, stub = rig
    rng = np.random.default_rng(2)
    keys = block_keys(np.arange(3 * B) + 7000, B)
    src = [1, 3, 4]
    _fill(mem, src, rng)
    assert _save(agent, keys, src)
    _wait_stored(d, keys, stub)
    store = d.node.engine.vllm.space.store
    path = store.path_of(keys[1])
    with open(path, "r+b") as f:                 # one flipped byte in block 1's payload
        f.seek(os.path.getsize(path) - 100)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))
    dst = [7, 8, 10]
    for layer in range(L):
        for u in dst:
            _engine_block(mem, layer, u)[:] = 0xAA
    h = _load(agent, keys, dst, "r-bad")
    assert h.failed == {1, 2} and not h.error    # from the first bad block on
    for layer in range(L):
        assert np.array_equal(_engine_block(mem, layer, 1), _engine_block(mem, layer, 7))
    # A payload is verified once all its layers are read, and read layer by layer they
    # may already be in place when it fails: reported failed all the same (vLLM
    # recomputes them). A block the store knows is bad or missing is never written:
    for layer in range(L):
        _engine_block(mem, layer, 8)[:] = 0xAA
    h = _load(agent, keys[:2], [7, 8], "r-quarantined")   # block 1 was quarantined
    assert h.failed == {1}
    for layer in range(L):
        assert (_engine_block(mem, layer, 8) == 0xAA).all()    # never written
    store.delete(keys[0])
    for layer in range(L):
        _engine_block(mem, layer, 7)[:] = 0xAA
    h = _load(agent, keys[:1], [7], "r-gone")
    assert h.failed == {0}
    for layer in range(L):
        assert (_engine_block(mem, layer, 7) == 0xAA).all()    # never written


@pytest.mark.parametrize("rig", ["copy"], indirect=True)   # a WRITE load has no hold
def test_a_shared_buffer_load_past_the_nodes_hold_is_failed_and_never_copied(rig,
                                                                             monkeypatch):
    """Past the daemon's hold its slots may serve another request: the copier must not
    copy out of them, and the load must end failed (vLLM recomputes)."""
    d, agent, mem, stub = rig
    rng = np.random.default_rng(3)
    keys = block_keys(np.arange(2 * B) + 9000, B)
    _fill(mem, (1, 2), rng)
    assert _save(agent, keys, [1, 2])
    _wait_stored(d, keys, stub)
    for layer in range(L):
        for u in (5, 6):
            _engine_block(mem, layer, u)[:] = 0xAA
    monkeypatch.setattr(d.node.engine.vllm, "HOLD_S", 0.0)
    h = _load(agent, keys, [5, 6], "r-late")
    assert h.error and "hold" in h.error and h.failed == {0, 1}
    for layer in range(L):
        for u in (5, 6):
            assert (_engine_block(mem, layer, u) == 0xAA).all()
    monkeypatch.undo()
    h = _load(agent, keys, [5, 6], "r-in-time")
    assert not h.error and not h.failed
    assert np.array_equal(_engine_block(mem, L - 1, 1), _engine_block(mem, L - 1, 5))


def test_a_load_of_blocks_still_in_write_back_takes_no_slots_of_its_own(rig):
    """A decode node holds a request's prompt blocks (adopted, or saved and not yet on
    disk) while its instance loads them. That load is served from their own slots: with
    every other slot of the pool taken it still completes, byte for byte. (It used to
    reserve a second copy and wait for slots that only such loads could free: K
    concurrent requests stalled a pool of fewer than (K + 1) x P slots.)"""
    d, agent, mem, stub = rig
    eng = d.node.engine.vllm
    store, pool = eng.space.store, eng.space.pool
    rng = np.random.default_rng(4)
    keys = block_keys(np.arange(3 * B) + 11000, B)
    src, dst = [3, 4, 5], [8, 9, 10]
    _fill(mem, src, rng)
    gate = d.call(_make_event())
    awrite = store.awrite

    async def held_write(key, data):      # the write-back waits: the blocks stay pending
        await gate.wait()
        return await awrite(key, data)
    store.awrite = held_write
    hog = None
    try:
        assert _save(agent, keys, src)
        assert all(k in eng._pending for k in keys)
        hog = d.call(_reserve(pool, pool.free))
        assert pool.free == 0
        h = _load(agent, keys, dst, "r-in-place")
        assert not h.failed and not h.error
        for layer in range(L):
            for s_, t in zip(src, dst):
                assert np.array_equal(_engine_block(mem, layer, s_),
                                      _engine_block(mem, layer, t))
    finally:
        store.awrite = awrite
        d.loop.call_soon_threadsafe(gate.set)
        if hog is not None:
            d.loop.call_soon_threadsafe(hog.release)
    _wait_stored(d, keys, stub)
    deadline = time.monotonic() + 60        # the saved blocks' slots go back once stored
    while pool.free != pool.capacity:
        assert time.monotonic() < deadline, (pool.free, pool.capacity)
        time.sleep(0.05)


def test_blocks_two_requests_hold_stay_pending_until_both_let_go(rig):
    """Two P/D requests sharing a prefix each hold its blocks (adopted) until their own
    decode loaded them: the first to let go must not take the blocks from the second,
    whose load would then wait for slots of its own."""
    d, _, _, _ = rig
    eng = d.node.engine.vllm
    pool = eng.space.pool
    keys = block_keys(np.arange(2 * B) + 13000, B)
    a, b = d.call(_reserve(pool, 2)), d.call(_reserve(pool, 2))
    sa = d.call(_adopt(eng, "ra", keys, a))
    sb = d.call(_adopt(eng, "rb", keys, b))
    free = pool.free
    d.loop.call_soon_threadsafe(eng.release_adopted, sa)
    deadline = time.monotonic() + 60          # a's slots go back once persisted
    while pool.free != free + 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert all(eng._pending.serving(k)[0] is sb for k in keys)
    d.loop.call_soon_threadsafe(eng.release_adopted, sb)
    while pool.free != free + 4:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert not any(k in eng._pending for k in keys)


async def _adopt(eng, rid, keys, res):
    return eng.adopt(rid, keys, res)


async def _make_event() -> asyncio.Event:
    return asyncio.Event()


async def _reserve(pool, n: int):
    return await pool.reserve(n)


@pytest.mark.parametrize("who", ["client/x", "node/n1", None])
def test_only_the_node_itself_may_call_its_connector(rig, who):
    """The KvConnector writes into vLLM's memory: another cluster identity is refused
    (PERMISSION_DENIED), a caller without a certificate never completes the handshake."""
    d, agent, _, _ = rig
    if who is None:
        ch = grpc.insecure_channel(d.node.address)
        code = grpc.StatusCode.UNAVAILABLE
    else:
        ch = tls.sync_channel(d.node.address, d.pki.config(who))
        code = grpc.StatusCode.PERMISSION_DENIED
    stub = connector_pb2_grpc.KvConnectorStub(ch)
    try:
        with pytest.raises(grpc.RpcError) as e:
            stub.Lookup(connector_pb2.LookupRequest(model_id="test-model"), timeout=10)
        assert e.value.code() == code, e.value
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Load(connector_pb2.LoadRequest(request_id="x", worker_name=agent.name,
                                                     block_keys=[b"k" * 16], units=[0]),
                           timeout=10))
        assert e.value.code() == code
    finally:
        ch.close()


def test_bad_requests_are_refused_naming_the_problem(rig):
    _, agent, _, stub = rig
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Load(connector_pb2.LoadRequest(request_id="x", worker_name=agent.name,
                                                 block_keys=[b"k" * 16], units=[UNITS])))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "outside the worker" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Load(connector_pb2.LoadRequest(request_id="x", worker_name="nobody:1",
                                                 block_keys=[], units=[])))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as e:
        stub.Lookup(connector_pb2.LookupRequest(model_id="test-model", block_keys=[b"short"]))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
