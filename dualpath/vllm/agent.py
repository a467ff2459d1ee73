"""The data-plane target inside a vLLM worker process: its KV memory, registered.

vLLM's KV tensors are private memory of its worker process, so (as NIXL's and
Mooncake's connectors do) the worker hosts the data plane's end: :class:`WorkerAgent`
registers the tensors' memory with a :class:`~dualpath.transfer.TransferEngine` of its
own, serves the out-of-band exchange (Engine.ExchangeEndpoint) so the node daemon can
connect to it, and attaches to the daemon (KvConnector.Attach) with the placement of
every Layer Block in that memory. The daemon's DRAM buffer then WRITEs hit KV straight
into vLLM's blocks, and the worker WRITEs newly computed blocks into the daemon's buffer
for persisting.

Threads. The agent runs an asyncio loop on a thread of its own (the transfer engine and
gRPC need one; vLLM's worker has none). Every public method is called from vLLM's
threads and hands work to that loop; results come back through :class:`LoadHandle` /
:class:`SaveHandle`, whose waits are bounded. No torch here: the caller passes raw
ranges and a placement (dualpath/vllm/kv_tensors.py makes them from tensors).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc
import numpy as np

from dualpath import rpc, tls, topology
from dualpath.buffers.shm import take_buffer
from dualpath.config_sections import KvLaneConfig, TransportConfig
from dualpath.cpus import cpu_list
from dualpath.errors import DualPathError, UsageError
from dualpath.kv import placement_wire
from dualpath.kv.placement import KvPlacement, runs
from dualpath.tls import PLAINTEXT, TlsConfig
from dualpath.transfer import TransferEngine
from dualpath.transfer.config import TransferConfig
from dualpath.transfer.kvio import write_layer
from dualpath.transfer.oob_grpc import GrpcChannels, GrpcOutOfBand
from dualpath.v1 import connector_pb2, connector_pb2_grpc, engine_pb2, engine_pb2_grpc

log = logging.getLogger("dualpath.vllm")


@dataclass(frozen=True)
class MemoryRange:
    """One registered range of the engine's KV memory (a tensor storage)."""

    name: str
    addr: int
    length: int
    gpu_device: int | None = None     # None: host memory


@dataclass(frozen=True)
class AgentSettings:
    node_address: str                 # the node daemon's control address (host:port)
    model_id: str
    listen: str = "127.0.0.1:0"       # this worker's own gRPC (out-of-band) address
    advertise: str = ""
    transport: TransportConfig = field(default_factory=TransportConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    lane: KvLaneConfig = field(default_factory=KvLaneConfig)
    tls: TlsConfig = PLAINTEXT      # the node's [tls]: the worker calls as the node
    shared_buffer: bool = True      # map the node's buffer when offered (host KV only)
    load_timeout_s: float = 60.0      # a load that makes no progress for this long fails
    save_timeout_s: float = 60.0
    tp_rank: int = 0
    tp_size: int = 1
    prefix_caching: bool = False      # vLLM's own prefix cache is on (told to the node)


@dataclass(frozen=True)
class Attached:
    node_id: str
    namespace: str
    block_tokens: int
    buffer: KvPlacement               # the daemon's DRAM buffer (saves land there)


def leave_engine_cores() -> str:
    """Move the calling thread, and so every thread it starts (gRPC's, the copier), off
    the cores the engine computes on; returns where it runs, for the log.

    vLLM's CPU worker binds its OpenMP threads, and with them every thread the worker
    starts later, to the cores it computes on, and keeps the host's others for its
    scheduler and a KV connector (vllm/utils/ompmultiprocessing.py reserves one more core
    when a connector is configured). The agent's I/O and copies belong on those: on the
    model's cores they preempt its threads and every layer waits. An unbound worker (a
    GPU host) is left as it is."""
    mine = os.sched_getaffinity(0)
    rest = set(range(os.cpu_count() or 1)) - mine
    if not rest:
        return f"cores {cpu_list(mine)} (the engine's own: none is left to others)"
    try:
        os.sched_setaffinity(0, rest)
    except OSError as e:              # the host's cpuset allows none of them
        return f"cores {cpu_list(mine)} ({e.strerror} moving to {cpu_list(rest)})"
    return (f"cores {cpu_list(os.sched_getaffinity(0))} (the engine computes on "
            f"{cpu_list(mine)})")


class LoadHandle:
    """One request's load in one step. ``layers_done`` layers are where the daemon puts
    them (vLLM's KV memory, or its shared buffer) and ``ready`` layers in vLLM's KV
    memory (a shared-buffer load: once the agent's copier has copied them), for every
    block not in ``failed``; ``ended`` once the stream is over and nothing more will be
    copied (``error`` says why when it ended early: then every block counts as failed).
    Thread-safe."""

    def __init__(self, request_id: str, nblocks: int):
        self.request_id = request_id
        self.nblocks = nblocks
        self.layers_done = 0
        self.ready = 0
        self.failed: set[int] = set()
        self.ended = False
        self.complete = False         # the daemon sent its last layer's message
        self.error = ""
        self.nbytes = 0
        self.wait_s = 0.0             # time vLLM's forward waited on this load
        # Shared-buffer loads: the blocks' slots in the daemon's buffer, the load's id
        # (EndLoad), until when the daemon holds them.
        self.slots: tuple[int, ...] = ()
        self.load_id = 0
        self.hold_deadline = 0.0
        self._cond = threading.Condition()
        # Held across each layer's copy: an end (or a give-up) waits for the copy under
        # way, so no copy lands in KV memory after the load was given up.
        self._copy_lock = threading.RLock()
        self._future: concurrent.futures.Future | None = None

    def _update(self, layers_done: int, failed: Sequence[int], complete: bool, nbytes: int,
                slots: Sequence[int] = (), load_id: int = 0, hold_ms: int = 0) -> None:
        with self._cond:
            if slots and not self.slots:
                self.slots, self.load_id = tuple(slots), load_id
                # Copy only well inside the daemon's hold: past it the slots may serve
                # another request.
                self.hold_deadline = time.monotonic() + hold_ms / 2000.0
            self.layers_done = max(self.layers_done, layers_done)
            if not self.slots:
                self.ready = self.layers_done
            self.failed.update(failed)
            self.nbytes += nbytes
            self.complete = self.complete or complete
            self._cond.notify_all()

    def _end(self, error: str = "") -> None:
        with self._copy_lock, self._cond:
            if not self.ended or error:
                if error or not self.complete and self.nblocks:
                    self.error = error or (f"load stream ended after {self.layers_done} "
                                           "layers, before its last")
                    self.failed.update(range(self.nblocks))
                self.ended = True
            self._cond.notify_all()

    def wait_layer(self, layer: int, timeout: float) -> bool:
        """Wait until layer ``layer`` (0-based) is in vLLM's KV memory or the load ended;
        False when ``timeout`` passed without either (the caller must fence and give
        up)."""
        t0 = time.monotonic()
        with self._cond:
            ok = self._cond.wait_for(lambda: self.ready > layer or self.ended, timeout)
        self.wait_s += time.monotonic() - t0
        return ok

    def give_up(self, why: str) -> None:
        self._end(why)
        if self._future is not None:
            self._future.cancel()

    @property
    def all_failed(self) -> bool:
        return bool(self.error)


class SaveHandle:
    """One request's save of newly full blocks in one step (see WorkerAgent.begin_save)."""

    def __init__(self, request_id: str, keys: list[bytes], units: list[int],
                 ticket: str = ""):
        self.request_id = request_id
        self.keys = keys
        self.units = units
        self.ticket = ticket
        self.begun: concurrent.futures.Future | None = None   # -> (save_id, slots) | None
        self.layers: list[concurrent.futures.Future] = []
        self.copied = 0               # layers copied into the shared buffer
        self.ok = True
        self.error = ""


class _EngineEdge(engine_pb2_grpc.EngineServicer):
    """The one Engine RPC a worker serves: the daemon's connect exchange."""

    def __init__(self, agent: WorkerAgent):
        self.agent = agent

    async def ExchangeEndpoint(self, request, context):
        cfg = self.agent.settings.tls
        ident = None
        if not cfg.plaintext:
            # Only the node this worker attached to may connect into vLLM's KV memory.
            ident = tls.peer_identity(context, cfg.trust_domain)
            node = self.agent.attached.node_id if self.agent.attached else None
            if ident is None or ident.role != "node" or ident.name != node:
                await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                    f"{ident or 'no identity'} may not connect to this "
                                    f"worker (needs node/{node})")
        try:
            data = await self.agent.oob.handle(request.caller.endpoint,
                                               str(ident) if ident else None)
        except DualPathError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return engine_pb2.ExchangeEndpointResponse(callee=engine_pb2.DataPlaneEndpoint(
            engine_id=self.agent.name, transport=self.agent.transfer.transport,
            endpoint=data))


class WorkerAgent:
    """See the module docstring. ``start()`` (blocking, attaches), per-step calls,
    ``close()`` (idempotent)."""

    def __init__(self, settings: AgentSettings, ranges: Sequence[MemoryRange],
                 placement: KvPlacement, canonical: Sequence[int] = (),
                 canonical_rows: Sequence[int] = ()):
        if not ranges:
            raise UsageError("the worker agent needs at least one KV memory range")
        self.settings = settings
        self.ranges = list(ranges)
        self.placement = placement
        # Where this rank's segments sit in the canonical block (kv_tensors.py; () whole).
        self.canonical, self.canonical_rows = tuple(canonical), tuple(canonical_rows)
        self.name = ""
        self.attached: Attached | None = None
        self.shared = None            # the daemon's buffer, mapped (same host, host KV)
        self.shared_addr = 0
        self._range_addr = {r.name: r.addr for r in self.ranges}
        self._old_shared: list = []       # mappings of a daemon that restarted
        self._heartbeat: asyncio.Future | None = None
        self._copier = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="dualpath-copier")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop,
                                        name="dualpath-worker-agent", daemon=True)
        self.cores = ""               # where the agent's threads run (for the log)
        self._closed = False

    # ------------------------------------------------------------------ lifecycle

    def start(self, timeout: float = 60.0) -> Attached:
        self._thread.start()
        return self._run(self._start(), timeout)

    def _run_loop(self) -> None:
        self.cores = leave_engine_cores()
        self._loop.run_forever()

    def _run(self, coro, timeout: float):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def _submit(self, coro) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    async def _start(self) -> Attached:
        s = self.settings
        tls.log_mode(s.tls, "DualPath worker agent")
        self.channels = GrpcChannels(s.tls)
        self.oob = GrpcOutOfBand(self.channels)
        self.server = grpc.aio.server(options=rpc.server_options())
        engine_pb2_grpc.add_EngineServicer_to_server(_EngineEdge(self), self.server)
        port = rpc.bind(self.server, s.listen, "vLLM worker agent listen",
                        tls.server_credentials(s.tls))
        host = s.listen.rpartition(":")[0]
        self.name = f"{s.advertise or host}:{port}"
        await self.server.start()
        self.transfer = TransferEngine.open(self.name, self.oob, transport=self._transport(),
                                            transfer=s.transfer, lane=s.lane)
        await self.transfer.start()
        for r in self.ranges:
            self.transfer.register(r.name, addr=r.addr, length=r.length,
                                   gpu_device=r.gpu_device)
        self.stub = connector_pb2_grpc.KvConnectorStub(self.channels.channel(s.node_address))
        attached = await self._attach()
        self._heartbeat = asyncio.ensure_future(self._beat())
        return attached

    def _transport(self) -> TransportConfig:
        """The transport config with the RDMA device nearest this worker's GPU (issue 39
        item 5; ``gpu_nics`` pairs, else the PCIe tree: dualpath/topology.py). Host-memory
        KV, the TCP provider, or an operator's ``device`` without pairs: as configured."""
        t = self.settings.transport
        gpus = sorted({r.gpu_device for r in self.ranges if r.gpu_device is not None})
        if not gpus or t.kind == "tcp" or (t.device and not t.gpu_nics):
            return t
        from dualpath.gpu import CudaDriver

        try:
            bdf = CudaDriver().pci_bus_id(gpus[0])
        except DualPathError as e:
            log.warning("DualPath worker agent: GPU %d's NIC not paired (%s); using the "
                        "transport's device", gpus[0], e)
            return t
        nic, why = topology.nic_for(bdf, t.gpu_nics)
        if not nic:
            return t
        log.info("DualPath worker agent: GPU %d (%s)'s KV goes through RDMA device %s (%s)",
                 gpus[0], bdf, nic, "set in transport.gpu_nics" if why == "set"
                 else f"nearest on the PCIe tree: {why}")
        # A GID index names an entry of the configured device's table, not this one's.
        return dataclasses.replace(t, device=nic,
                                   gid_index=t.gid_index if nic == t.device else -1)

    #: Seconds between the worker's heartbeats to its daemon.
    HEARTBEAT_S = 1.0

    async def _beat(self) -> None:
        """Ask the daemon every HEARTBEAT_S whether it knows us; attach again when it
        does not (it restarted). A prefill or decode node registers with the scheduler
        only once its worker attached, so it must not wait for a load to find out."""
        req = connector_pb2.LookupRequest(model_id=self.settings.model_id,
                                          worker_name=self.name)
        while True:
            await asyncio.sleep(self.HEARTBEAT_S)
            try:
                r = await self.stub.Lookup(req, timeout=5)
                if not r.worker_attached:
                    log.warning("DualPath worker agent: node %s does not know this worker "
                                "(it restarted); attaching again",
                                self.settings.node_address)
                    await self._attach()
            except (grpc.aio.AioRpcError, DualPathError) as e:
                log.debug("DualPath worker agent: heartbeat: %s", e)

    async def _attach(self) -> Attached:
        """Attach (again, after the daemon restarted: it answers NOT_FOUND for us)."""
        s = self.settings
        host = s.shared_buffer and all(r.gpu_device is None for r in self.ranges)
        reply = await self.stub.Attach(connector_pb2.AttachRequest(
            worker_name=self.name, model_id=s.model_id, tp_rank=s.tp_rank,
            tp_size=s.tp_size, placement=placement_wire.to_pb(self.placement),
            host_memory=host, prefix_caching=s.prefix_caching,
            canonical_segments=self.canonical, canonical_row_bytes=self.canonical_rows),
            timeout=30)
        if reply.transport != self.transfer.transport:
            raise UsageError(f"node daemon {s.node_address} uses transport {reply.transport}, "
                             f"this worker {self.transfer.transport}: set [transport] kind "
                             "alike on both")
        self.attached = Attached(reply.node_id, reply.namespace, reply.block_tokens,
                                 placement_wire.from_pb(reply.buffer, "daemon buffer"))
        if self.shared is not None:
            # A copy on the copier thread may still read the old mapping: keep it mapped.
            self._old_shared.append(self.shared)
        self.shared, self.shared_addr = None, 0
        if reply.shm_name:
            m = await asyncio.to_thread(take_buffer, reply.shm_name, reply.shm_token)
            arr = np.frombuffer(m, np.uint8)
            self.shared, self.shared_addr = (m, arr), arr.ctypes.data
        log.info("DualPath worker agent %s: transport %s (%s), %d KV range(s); attached to "
                 "node %s at %s (store namespace %s, %d-token blocks); %s; its threads on %s",
                 self.name,
                 self.transfer.transport, self.transfer.provider.description,
                 len(self.ranges), reply.node_id, s.node_address, reply.namespace,
                 reply.block_tokens, "the node's buffer shared: this worker copies"
                 if self.shared else "the node WRITEs into the KV memory", self.cores)
        return self.attached

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._thread.is_alive():
            try:
                self._run(self._close(), 30)
            except (concurrent.futures.TimeoutError, RuntimeError, DualPathError) as e:
                log.warning("DualPath worker agent: close: %s", e)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
        self._copier.shutdown(wait=True, cancel_futures=True)

    async def _close(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        if hasattr(self, "transfer"):
            await self.transfer.close()
        if hasattr(self, "server"):
            await self.server.stop(0.5)
        if hasattr(self, "channels"):
            await self.channels.close()

    # ------------------------------------------------------------------ loads

    def load(self, request_id: str, keys: list[bytes], units: list[int],
             ticket: str = "") -> LoadHandle:
        """Start loading ``keys`` into engine blocks ``units``; returns at once.
        ``ticket``: the node's, for a request it drives (P/D)."""
        h = LoadHandle(request_id, len(keys))
        h._future = self._submit(self._load(h, keys, units, ticket))
        return h

    async def _reattached(self, e: grpc.aio.AioRpcError) -> bool:
        """True when ``e`` says the daemon does not know us (it restarted) and attaching
        again worked: the caller may retry once."""
        if e.code() != grpc.StatusCode.NOT_FOUND or "worker" not in (e.details() or ""):
            return False
        try:
            await self._attach()
        except (grpc.aio.AioRpcError, DualPathError) as err:
            log.warning("DualPath worker agent: attaching again failed: %s", err)
            return False
        return True

    async def _load(self, h: LoadHandle, keys: list[bytes], units: list[int],
                    ticket: str = "") -> None:
        copying: asyncio.Future | None = None
        for attempt in (1, 2):
            req = connector_pb2.LoadRequest(request_id=h.request_id, worker_name=self.name,
                                            block_keys=keys, units=units,
                                            worker_copies=self.shared is not None,
                                            ticket=ticket)
            try:
                async for p in self.stub.Load(req, timeout=self.settings.load_timeout_s):
                    h._update(p.layers_done, p.failed_blocks, p.complete, p.bytes_written,
                              p.slots, p.load_id, p.hold_ms)
                    if h.slots:   # one thread, in order: the last one sees every layer
                        copying = self._loop.run_in_executor(self._copier,
                                                             self._copy_arrived, h, units)
                if copying is not None:
                    await copying
                h._end()
                return
            except grpc.aio.AioRpcError as e:
                if attempt == 1 and h.layers_done == 0 and await self._reattached(e):
                    continue
                h._end(f"{e.code().name}: {e.details()}")
                return
            except asyncio.CancelledError:
                h._end("load given up")
                raise

    def _copy_arrived(self, h: LoadHandle, units: list[int]) -> None:
        """The copier thread: copy every layer of a shared-buffer load that is in the
        daemon's buffer but not yet in vLLM's KV memory, in order, as it arrives (so the
        forward's wait for a layer is a wait, not a copy). Ends the load (every block
        failed) when the daemon's hold on its slots ran out first."""
        fmt = self.placement.fmt
        buf = self.attached.buffer
        while True:
            with h._copy_lock:
                with h._cond:
                    layer, ok = h.ready, min([*h.failed, h.nblocks])
                    if h.ended or layer >= h.layers_done:
                        return
                if time.monotonic() > h.hold_deadline:
                    h._end("the node's hold on its buffer ran out before the copy")
                    return
                for r in runs(buf, buf.units_of_slots(h.slots[:ok]), self.placement,
                              units[:ok * fmt.units], layer, 0, ok * fmt.block_tokens):
                    ctypes.memmove(self._range_addr[r.dst_region] + r.dst_offset,
                                   self.shared_addr + r.src_offset, r.length)
                with h._cond:
                    h.ready = layer + 1
                    h._cond.notify_all()

    def end_load(self, h: LoadHandle) -> None:
        """Give a shared-buffer load's slots back to the daemon (returns at once)."""
        if h.load_id:
            self._submit(self._end_load(h.load_id))

    async def _end_load(self, load_id: int) -> None:
        try:
            await self.stub.EndLoad(connector_pb2.EndLoadRequest(load_id=load_id), timeout=10)
        except grpc.aio.AioRpcError as e:   # the daemon takes them back after its hold
            log.warning("DualPath: EndLoad %d failed: %s", load_id, e.code().name)

    def fence(self) -> None:
        """Make every WRITE still on its way into our KV memory fail where it lands (the
        daemon may still be writing a load we gave up on): rekey every range."""
        self._run(self._fence(), 30)

    async def _fence(self) -> None:
        for r in self.ranges:
            self.transfer.rekey(r.name)

    # ------------------------------------------------------------------ saves

    def begin_save(self, request_id: str, keys: list[bytes], units: list[int],
                   ticket: str = "") -> SaveHandle:
        """Borrow daemon buffer slots for ``keys`` (newly full blocks in engine blocks
        ``units``); returns at once, the answer is awaited by the layer writes."""
        h = SaveHandle(request_id, keys, units, ticket)
        h.begun = self._submit(self._begin_save(h))
        return h

    async def _end_save(self, save_id: int, commit: bool) -> None:
        await self.stub.EndSave(connector_pb2.EndSaveRequest(save_id=save_id, commit=commit),
                                timeout=10)

    async def _begin_save(self, h: SaveHandle):
        req = connector_pb2.BeginSaveRequest(request_id=h.request_id, worker_name=self.name,
                                             block_keys=h.keys, ticket=h.ticket)
        for attempt in (1, 2):
            try:
                r = await self.stub.BeginSave(req, timeout=self.settings.save_timeout_s)
                return r.save_id, list(r.slots)
            except grpc.aio.AioRpcError as e:
                if attempt == 1 and await self._reattached(e):
                    continue
                h.ok, h.error = False, f"BeginSave: {e.code().name}: {e.details()}"
                return None

    def save_layer(self, h: SaveHandle, layer: int, computed=None) -> None:
        """Layer ``layer`` of the save's blocks into the borrowed slots: a copy into the
        shared buffer (here, now), or a WRITE (async). ``computed``: for KV in GPU
        memory, a call that returns once the layer's compute is complete on the GPU (an
        event recorded on the model's stream, WorkerSide.save_layer): the WRITE, which
        reads that memory through the NIC, waits for it off the model's thread."""
        if self.shared is None:
            h.layers.append(self._submit(self._save_layer(h, layer, computed)))
            return
        try:
            got = h.begun.result(self.settings.save_timeout_s)
        except concurrent.futures.TimeoutError:
            got, h.ok, h.error = None, False, "BeginSave timed out"
        if got is None or not h.ok:
            return
        buf = self.attached.buffer
        for r in runs(self.placement, h.units, buf, buf.units_of_slots(got[1]), layer, 0,
                      len(h.keys) * self.placement.fmt.block_tokens):
            ctypes.memmove(self.shared_addr + r.dst_offset,
                           self._range_addr[r.src_region] + r.src_offset, r.length)
        h.copied += 1

    async def _save_layer(self, h: SaveHandle, layer: int, computed=None) -> None:
        got = await asyncio.wrap_future(h.begun)
        if got is None or not h.ok:
            return
        if computed is not None:
            await asyncio.to_thread(computed)
        _, slots = got
        buf = self.attached.buffer
        stop = len(h.keys) * self.placement.fmt.block_tokens
        try:
            await write_layer(self.transfer, self.settings.node_address, self.placement,
                              h.units, buf, buf.units_of_slots(slots), layer, 0, stop)
        except DualPathError as e:
            h.ok, h.error = False, f"layer {layer}: {e}"

    def finish_save(self, h: SaveHandle, commit: bool) -> bool:
        """Wait for the save's writes, then hand the blocks to the daemon (``commit``) or
        drop them; True when they were handed over."""
        deadline = time.monotonic() + self.settings.save_timeout_s
        for f in h.layers:
            try:
                f.result(max(0.0, deadline - time.monotonic()))
            except concurrent.futures.TimeoutError:
                h.ok, h.error = False, "save writes timed out"
        try:
            got = h.begun.result(max(0.0, deadline - time.monotonic()))
        except concurrent.futures.TimeoutError:
            got, h.ok, h.error = None, False, "BeginSave timed out"
        if got is None:
            return False
        layers = self.placement.fmt.layers
        written = len(h.layers) + h.copied
        if written != layers:             # a layer never saved: its slots hold no KV
            h.ok, h.error = False, f"{written} of {layers} layers written"
        keep = commit and h.ok
        try:
            self._run(self._end_save(got[0], keep), 15)
        except (grpc.aio.AioRpcError, concurrent.futures.TimeoutError) as e:
            log.warning("DualPath: EndSave of %s failed: %s", h.request_id, e)
            return False
        return keep
