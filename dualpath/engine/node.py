"""The PE and DE node daemon: one process per node, g engines in one group (paper §6.1).

What a node owns (created in this order, closed in reverse): the block store and its read
queue behind a storage-NIC token bucket (shared by the node's engines); one pinned DRAM
buffer (the PE buffer or the DE buffer) and, per engine, an "HBM" region, all registered
with the node's TransferEngine; the gRPC server (Engine + Node + health); the leader
loop that registers the group and fetches work every few ms.

One request on a PE (:meth:`NodeDaemon._prefill`; paper Fig. 4a/4b):

    assigned -> DE prepared (Node.PrepareRequest: DE-buffer slots)
      read side PREFILL: hit Full Blocks storage -> PE buffer; per layer PE buffer -> HBM
                         by a WRITE over the node's loopback connection
      read side DECODE:  Engine.SubmitTransferOrder(LOAD_HIT_KV) + WatchTransfers: the DE
                         writes each layer's hit blocks into our HBM
      per layer: wait for its hit KV -> compute (cost-model time; miss-token KV from the
        synthetic generator written into HBM) -> WRITE that layer's KV (PE read: hit and
        miss; DE read: miss only) into the DE buffer; with layerwise prefill the next
        layer's transfers run while this layer computes
    -> Node.PrefillDone -> PREFILL_DONE reported (FAILED on any error: requeued)

One request on a DE (:meth:`NodeDaemon._decode`): PrepareRequest reserves DE-buffer
slots; PrefillDone starts decode: every byte of the assembled prompt KV is verified
against the generator (a mismatch fails the request loudly and is counted) -> DE buffer
-> DE HBM, DRAM released -> tokens at the cost model's decode rate -> every new full
block persisted -> DECODE_DONE reported and timings sent to the replay client's sink.

Modes come from the request payload (dualpath/engine/kvplan.py): basic forces the PE
read side, oracle skips storage and every KV transfer (compute and decode only).

Threads: one asyncio loop owns all state; storage I/O runs on the block store's pools,
the data path on the TransferEngine's thread, verification in ``asyncio.to_thread``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from dualpath import metrics as _metrics
from dualpath.buffers.pool import BlockPool
from dualpath.buffers.region import PinnedRegion
from dualpath.config import Config
from dualpath.engine.kvplan import (
    BlockSpan,
    Payload,
    block_spans,
    blocks_for,
    layer_runs,
)
from dualpath.engine.oob import GrpcChannels, GrpcOutOfBand
from dualpath.errors import ConfigError, DualPathError, UsageError
from dualpath.kv import cost
from dualpath.kv.layout import BlockLayout
from dualpath.kv.prefix import block_keys
from dualpath.kv.profiles import ModelProfile, get_profile
from dualpath.kv.synth import SyntheticKV
from dualpath.storage.ratelimit import RateLimiter, gbit_to_bytes_per_s
from dualpath.storage.read_queue import ReadQueue
from dualpath.storage.store import BlockStore
from dualpath.transfer import TransferEngine
from dualpath.v1 import (
    engine_pb2,
    engine_pb2_grpc,
    node_pb2,
    node_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)

log = logging.getLogger("dualpath.engine")

PREFILL, DECODE = "prefill", "decode"
ROLE_PB = {PREFILL: scheduler_pb2.ENGINE_ROLE_PREFILL, DECODE: scheduler_pb2.ENGINE_ROLE_DECODE}
RS_NONE, RS_PREFILL, RS_DECODE = (scheduler_pb2.READ_SIDE_NONE, scheduler_pb2.READ_SIDE_PREFILL,
                                  scheduler_pb2.READ_SIDE_DECODE)


def unix_now() -> float:
    """Wall-clock seconds: the one clock comparable across processes (and, with NTP,
    across nodes) for the replay's per-request timings."""
    return time.time()


class CountingLimiter(RateLimiter):
    """The storage-NIC token bucket, also counting the bytes it grants per wall-clock
    slot: the node's real storage-NIC traffic over time (Node.StorageReads)."""

    SLOT_S = 0.05

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.slots: dict[int, int] = {}

    async def acquire(self, nbytes: int) -> None:
        await super().acquire(nbytes)
        k = int(unix_now() / self.SLOT_S)
        self.slots[k] = self.slots.get(k, 0) + nbytes


class RequestFailed(DualPathError):
    """A request could not be served here; it is reported FAILED and requeued."""


@dataclass
class Engine:
    """One (emulated) GPU: its HBM pool, its compute lock and its requests."""

    engine_id: str
    rank: int
    region: str                 # registered name of its HBM region
    hbm: BlockPool
    gpu: asyncio.Lock = field(default_factory=asyncio.Lock)
    tokens: dict[str, int] = field(default_factory=dict)   # request -> prompt tokens
    reserved_blocks: dict[str, int] = field(default_factory=dict)  # DE: HBM promised
    slots: asyncio.Semaphore | None = None                 # PE: concurrent prefills


@dataclass
class DecodeState:
    """A request on this DE from PrepareRequest to its end."""

    request_id: str
    engine: Engine
    payload: Payload
    spans: list[BlockSpan]
    buffer: object | None                       # DE-buffer Reservation
    pe_address: str
    layers_done: int = 0
    load_error: str = ""
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    read_bytes: int = 0
    read_span: tuple[float, float] = (0.0, 0.0)
    tasks: list[asyncio.Task] = field(default_factory=list)


class NodeMetrics:
    def __init__(self, registry, role: str):
        m = _metrics
        self.read_bytes = m.counter(registry, "dualpath_node_storage_read_bytes_total",
                                    "KV bytes this node read from storage (its storage NIC).")
        self.requests = m.counter(registry, "dualpath_node_requests_total",
                                  "Requests this node finished, by outcome.", ("outcome",))
        self.verified = m.counter(registry, "dualpath_node_kv_verified_bytes_total",
                                  "Prompt KV bytes the DE verified against the generator.")
        self.mismatched = m.counter(registry, "dualpath_node_kv_mismatched_bytes_total",
                                    "Prompt KV bytes in requests that failed verification.")
        self.persisted = m.counter(registry, "dualpath_node_blocks_persisted_total",
                                   "Full Blocks of new KV written to storage.")
        self.read_q = m.gauge(registry, "dualpath_node_read_queue_tokens",
                              "Tokens queued or in flight on this node's storage reads.")
        self.phase_s = m.histogram(registry, "dualpath_node_request_phase_seconds",
                                   "Time per request phase (prefill on PEs, decode on DEs).",
                                   ("phase",))
        self.role = role


class NodeDaemon:
    """See the module docstring. Create, ``await start()``, ``await serve_forever()``
    (or use :func:`run`), ``await close()``."""

    def __init__(self, config: Config, role: str, node_id: str, scheduler: str, *,
                 config_path: str | None = None):
        if role not in (PREFILL, DECODE):
            raise UsageError(f"role must be prefill or decode, not {role!r}")
        self.cfg = config
        self.ecfg = config.engine
        self.role = role
        self.node_id = node_id
        self.scheduler_address = scheduler
        self.config_path = config_path
        self.profile: ModelProfile = get_profile(self.ecfg.model_profile).scaled(
            self.ecfg.speed_scale)
        self.layout = BlockLayout.of(self.profile)
        self.synth = SyntheticKV(self.layout)
        self.registry = _metrics.new_registry()
        self.metrics = NodeMetrics(self.registry, role)
        self.engines: list[Engine] = []
        self.by_id: dict[str, Engine] = {}
        self.requests: dict[str, DecodeState] = {}
        self.prefills: dict[str, asyncio.Task] = {}
        self.completions: list[scheduler_pb2.Completion] = []
        self.address = ""
        self.stop = asyncio.Event()
        self._closers: list[Callable] = []
        self._tasks: set[asyncio.Task] = set()
        self._order_ids = itertools.count(1)
        self._rr = itertools.count()
        self.lease_id = 0
        self.fetch_interval_s = 0.02
        self._last_status_log = 0.0
        self.pending_reads: dict[str, int] = {}   # request -> hit tokens not yet queued

    # ------------------------------------------------------------ start-up
    async def start(self) -> None:
        cfg, ecfg = self.cfg, self.ecfg
        s = cfg.storage
        self.store = BlockStore(s.resolved_dir(), self.profile, read_workers=s.read_workers,
                                write_workers=s.write_workers, direct_io=s.direct_io,
                                verify_checksum=s.verify_checksum, fsync=s.fsync)
        self._closers.append(self.store.close)
        self.snic_bytes_per_s = gbit_to_bytes_per_s(s.snic_gbit_per_s) if s.snic_gbit_per_s else 0
        self.limiter = CountingLimiter(s.snic_gbit_per_s, s.snic_burst_bytes or None)
        self.read_queue = ReadQueue(self.store, self.limiter)
        self.channels = GrpcChannels()
        self.oob = GrpcOutOfBand(self.channels)
        # The gRPC server first: our name on the out-of-band channel is its address.
        self.server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        engine_pb2_grpc.add_EngineServicer_to_server(EngineServicer(self), self.server)
        node_pb2_grpc.add_NodeServicer_to_server(NodeServicer(self), self.server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        host = ecfg.control_listen.rpartition(":")[0]
        try:
            port = self.server.add_insecure_port(ecfg.control_listen)
        except RuntimeError as e:
            raise UsageError(f"engine.control_listen {ecfg.control_listen}: {e}") from None
        self.address = f"{ecfg.advertise or host}:{port}"
        self.transfer = TransferEngine.open(self.address, self.oob, transport=cfg.transport,
                                            transfer=cfg.transfer, lane=cfg.kv_lane)
        await self.transfer.start()
        b = cfg.buffers
        mib = b.pe_buffer_mib if self.role == PREFILL else b.de_buffer_mib
        buf_name = "pe_buffer" if self.role == PREFILL else "de_buffer"
        self.buffer = self._region(buf_name, mib, self.transfer)
        self.pool = BlockPool(buf_name, self.buffer.array, self.layout,
                              region_addr=self.buffer.addr)
        if ecfg.hbm == "cupy":
            raise ConfigError("engine.hbm = 'cupy' needs GPUDirect RDMA registration, which "
                              "this build does not do; use 'host' or 'auto'")
        hbm_mib = ecfg.prefill_hbm_mib if self.role == PREFILL else ecfg.decode_hbm_mib
        for rank in range(ecfg.engines_per_node):
            name = f"hbm{rank}"
            region = self._region(name, hbm_mib, self.transfer)
            e = Engine(f"{self.node_id}/e{rank}", rank, name,
                       BlockPool(name, region.array, self.layout, region_addr=region.addr))
            if self.role == PREFILL:
                e.slots = asyncio.Semaphore(ecfg.max_prefills_per_engine)
            self.engines.append(e)
            self.by_id[e.engine_id] = e
        self.metrics_srv = _metrics.start_metrics_server(ecfg.metrics_listen, self.registry)
        await self.server.start()
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        self.sched_channel = grpc.aio.insecure_channel(self.scheduler_address)
        self.scheduler = scheduler_pb2_grpc.SchedulerStub(self.sched_channel)
        lane = cfg.kv_lane
        t = cfg.transport
        log.info("%s node %s up: control %s; transport %s (%s), device %s, GID index %s, "
                 "lane SL %d / TC %d; %d engines, HBM %s (%d MiB each), %s %d MiB; storage "
                 "%s, storage NIC %s; model %s (emulated execution, speed x%g); config %s",
                 self.role, self.node_id, self.address, self.transfer.transport,
                 self.transfer.provider.description, t.device or "(auto)", t.gid_index,
                 lane.service_level, lane.traffic_class, len(self.engines), "host memory",
                 hbm_mib, buf_name, mib, self.store.dir,
                 f"{s.snic_gbit_per_s:g} Gbit/s" if s.snic_gbit_per_s else "unlimited",
                 self.profile.name, ecfg.speed_scale, self.config_path or "(defaults)")

    def _region(self, name: str, mib: int, te: TransferEngine) -> PinnedRegion:
        b = self.cfg.buffers
        region = PinnedRegion(mib << 20, huge_pages=b.huge_pages, lock=b.mlock,
                              what=f"{self.node_id} {name}")
        self._closers.append(region.close)
        te.register(name, addr=region.addr, length=region.nbytes)
        return region

    # ------------------------------------------------------------ leader
    async def run_leader(self) -> None:
        """Register, then fetch/report every interval until stopped. rank 0's job."""
        backoff = 0.05
        while not self.stop.is_set():
            try:
                if not self.lease_id:
                    await self._register()
                await self._fetch_once()
                backoff = 0.05
                await asyncio.sleep(self.fetch_interval_s)
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    log.warning("%s: lease lost (%s); dropping in-flight work, registering "
                                "again", self.node_id, e.details())
                    self._drop_all()
                    self.lease_id = 0
                else:
                    log.warning("%s: scheduler %s: %s %s; retrying in %.2f s", self.node_id,
                                self.scheduler_address, e.code().name, e.details(), backoff)
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, 1.0)

    async def _register(self) -> None:
        infos = [scheduler_pb2.EngineInfo(
            engine_id=e.engine_id, rank=e.rank, node_id=self.node_id,
            control_address=self.address,
            hbm_bytes=e.hbm.capacity * self.layout.full_bytes if self.role == DECODE else 0)
            for e in self.engines]
        r = await self.scheduler.RegisterGroup(scheduler_pb2.RegisterGroupRequest(
            group_id=self.node_id, role=ROLE_PB[self.role], engines=infos,
            storage_read_bytes_per_s=int(self.snic_bytes_per_s)), timeout=5)
        if r.model_profile and r.model_profile != self.profile.name:
            raise ConfigError(f"the scheduler plans with model profile {r.model_profile!r}, "
                              f"this node runs {self.profile.name!r}")
        self.lease_id = r.lease_id
        ms = self.ecfg.fetch_interval_ms or r.fetch_interval_ms or 20
        self.fetch_interval_s = ms / 1000.0
        log.info("%s: group registered (lease %d, fetch every %d ms)", self.node_id,
                 r.lease_id, ms)

    def read_q_tokens(self) -> int:
        """read_q: hit tokens queued or being read, plus those of requests this node will
        read but has not queued yet (waiting for a prefill slot or buffer space), so the
        scheduler does not see a short queue that is about to grow."""
        return self.read_queue.read_q_tokens + sum(self.pending_reads.values())

    def _status(self, e: Engine) -> scheduler_pb2.EngineStatus:
        free = 0
        if self.role == DECODE:
            free_blocks = e.hbm.capacity - sum(e.reserved_blocks.values())
            free = max(0, free_blocks) * self.layout.full_bytes
        return scheduler_pb2.EngineStatus(
            engine_id=e.engine_id, unfinished_requests=len(e.tokens),
            unfinished_tokens=sum(e.tokens.values()),
            read_queue_tokens=self.read_q_tokens(), free_hbm_bytes=free)

    async def _fetch_once(self) -> None:
        done, self.completions = self.completions, []   # they ride on the fetch
        self.metrics.read_q.set(self.read_q_tokens())
        now = time.monotonic()
        if now - self._last_status_log > 5.0 and (self.prefills or self.requests):
            self._last_status_log = now
            log.info("%s: in flight: prefills %s; decodes %s", self.node_id,
                     sorted(self.prefills)[:6], sorted(self.requests)[:6])
        try:
            r = await self.scheduler.Fetch(scheduler_pb2.FetchRequest(
                group_id=self.node_id, lease_id=self.lease_id,
                engines=[self._status(e) for e in self.engines], completions=done), timeout=5)
        except grpc.aio.AioRpcError:
            self.completions[:0] = done     # reports are idempotent: resend next time
            raise
        for rid in r.cancelled_request_ids:
            self._cancel(rid)
        for a in r.assignments:
            if self.role == PREFILL:
                e = self.by_id.get(a.prefill_engine_id)
                if e is None or a.request_id in self.prefills:
                    continue
                e.tokens[a.request_id] = a.prompt_tokens
                if a.read_side == RS_PREFILL:
                    self.pending_reads[a.request_id] = a.hit_tokens
                self.prefills[a.request_id] = self._spawn(self._prefill(e, a))
            else:
                e = self.by_id.get(a.decode_engine_id)
                if e is not None:
                    e.tokens[a.request_id] = a.prompt_tokens
                    e.reserved_blocks[a.request_id] = blocks_for(
                        a.prompt_tokens + a.max_new_tokens, self.layout.tokens)

    def _complete(self, rid: str, engine: Engine, stage: int) -> None:
        self.completions.append(scheduler_pb2.Completion(request_id=rid,
                                                         engine_id=engine.engine_id,
                                                         stage=stage))

    def _spawn(self, coro) -> asyncio.Task:
        t = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    def _cancel(self, rid: str) -> None:
        t = self.prefills.pop(rid, None)
        if t is not None:
            t.cancel()
        self.pending_reads.pop(rid, None)
        st = self.requests.pop(rid, None)
        if st is not None:
            for t in st.tasks:
                t.cancel()
            self._release_decode(st)
        for e in self.engines:
            e.tokens.pop(rid, None)
            e.reserved_blocks.pop(rid, None)

    def _drop_all(self) -> None:
        for rid in [*self.prefills, *self.requests]:
            self._cancel(rid)
        self.completions.clear()

    # ------------------------------------------------------------ PE
    def _read_side(self, p: Payload, a) -> int:
        if a.hit_tokens == 0 or p.oracle or p.read_policy == "none":
            return RS_NONE
        if p.read_policy == "prefill":
            return RS_PREFILL
        if p.read_policy == "round_robin":
            return RS_PREFILL if next(self._rr) % 2 == 0 else RS_DECODE
        if a.read_side == scheduler_pb2.READ_SIDE_SPLIT:
            return RS_DECODE if a.decode_read_tokens >= a.prefill_read_tokens else RS_PREFILL
        return a.read_side if a.read_side in (RS_PREFILL, RS_DECODE) else RS_PREFILL

    async def _prefill(self, e: Engine, a) -> None:
        rid = a.request_id
        t0 = time.monotonic()
        try:
            async with e.slots:
                await self._prefill_request(e, a)
            self._complete(rid, e, scheduler_pb2.COMPLETION_STAGE_PREFILL_DONE)
            self.metrics.phase_s.labels("prefill").observe(time.monotonic() - t0)
        except asyncio.CancelledError:
            raise
        except Exception as err:  # noqa: BLE001 - any failure requeues the request
            log.warning("prefill of %s on %s failed: %s", rid, e.engine_id, err)
            self.metrics.requests.labels("prefill_failed").inc()
            # Free what the DE holds for it, and only then report: the retry's
            # PrepareRequest must not overtake this cancel.
            with contextlib.suppress(grpc.aio.AioRpcError):
                await engine_pb2_grpc.EngineStub(self.channels.channel(
                    a.decode_control_address)).CancelRequest(
                        engine_pb2.CancelRequestRequest(request_id=rid), timeout=1)
            self._complete(rid, e, scheduler_pb2.COMPLETION_STAGE_FAILED)
        finally:
            e.tokens.pop(rid, None)
            self.prefills.pop(rid, None)
            self.pending_reads.pop(rid, None)

    async def _prefill_request(self, e: Engine, a) -> None:
        p = Payload.decode(a.payload)
        side = self._read_side(p, a)
        if side == RS_PREFILL:
            self.pending_reads[a.request_id] = int(a.hit_tokens)
        else:
            self.pending_reads.pop(a.request_id, None)
        T, LB, TB = self.layout.tokens, self.layout.layer_bytes, self.layout.token_bytes
        L = self.layout.layers
        rid, prompt, hit = a.request_id, int(a.prompt_tokens), int(a.hit_tokens)
        de = a.decode_control_address
        spans = block_spans(p.token_ids(prompt), T)
        nb, hit_blocks = len(spans), hit // T
        node = node_pb2_grpc.NodeStub(self.channels.channel(de))
        prep = await node.PrepareRequest(node_pb2.PrepareRequestRequest(
            request_id=rid, decode_engine_id=a.decode_engine_id,
            prefill_control_address=self.address, prompt_tokens=prompt, hit_tokens=hit,
            read_side=side, payload=a.payload), timeout=30)
        layer_s = cost.request_prefill_s(self.profile, hit, prompt - hit) / L
        layerwise = p.layerwise and self.ecfg.layerwise
        if p.oracle:
            for _ in range(L):
                async with e.gpu:
                    await asyncio.sleep(layer_s)
            await self._prefill_done(node, rid, e, 0, (0.0, 0.0))
            return
        de_off = list(prep.block_offsets_bytes)
        if len(de_off) != nb:
            raise RequestFailed(f"{rid}: the DE prepared {len(de_off)} blocks, {nb} needed")
        hbm = await e.hbm.reserve(nb)
        pebuf = None
        watch = None
        read_bytes, read_span = 0, (0.0, 0.0)
        arrivals: list[asyncio.Future] = []
        try:
            if side == RS_PREFILL and hit_blocks:
                pebuf = await self.pool.reserve(hit_blocks)
                r0 = unix_now()
                self.pending_reads.pop(rid, None)
                res = await self.read_queue.read([s.key for s in spans[:hit_blocks]],
                                                 [pebuf.flat(i) for i in range(hit_blocks)])
                read_span = (r0, unix_now())
                if not res.all_hit:
                    raise RequestFailed(f"{rid}: {res.hits.count(False)} of {hit_blocks} hit "
                                        "blocks missing from storage")
                read_bytes = hit_blocks * self.layout.full_bytes
                self.metrics.read_bytes.inc(read_bytes)

                def h2d(layer: int):
                    items = [(pebuf.offset(i) + layer * LB, hbm.offset(i) + layer * LB, LB)
                             for i in range(hit_blocks)]
                    return self.transfer.write(self.address, items, local="pe_buffer",
                                               remote=e.region)
                if layerwise:
                    arrivals = [asyncio.ensure_future(h2d(0))]
                else:
                    for layer in range(L):
                        await h2d(layer)
            elif side == RS_DECODE and hit_blocks:
                await self.transfer.connect(de)
                eng = engine_pb2_grpc.EngineStub(self.channels.channel(de))
                await eng.SubmitTransferOrder(engine_pb2.TransferOrder(
                    request_id=rid, kind=engine_pb2.TRANSFER_KIND_LOAD_HIT_KV,
                    source_engine_id=a.decode_engine_id, target_engine_id=e.engine_id,
                    block_keys=[s.key for s in spans[:hit_blocks]], first_token=0,
                    tokens=hit_blocks * T, layer_count=L,
                    target_slots=[engine_pb2.TargetSlot(region=e.region,
                                                        offset_bytes=hbm.offset(i),
                                                        length_bytes=self.layout.full_bytes)
                                  for i in range(hit_blocks)]), timeout=10)
                watch = _LayerWatch(eng.WatchTransfers(
                    engine_pb2.WatchTransfersRequest(request_id=rid)))
                if not layerwise:
                    await watch.until(L)
            pushes: list[asyncio.Future] = []
            push_from = hit if side == RS_DECODE else 0
            for layer in range(L):
                if side == RS_PREFILL and hit_blocks and layerwise:
                    await arrivals[layer]
                    if layer + 1 < L:
                        arrivals.append(asyncio.ensure_future(h2d(layer + 1)))
                elif watch is not None:
                    await watch.until(layer + 1)
                async with e.gpu:
                    await asyncio.sleep(layer_s)
                    for b, s0, s1 in layer_runs(hit, prompt, T):
                        view = hbm.flat(b)[layer * LB + s0 * TB: layer * LB + s1 * TB]
                        self.synth.fill_layer(view, spans[b].key, layer, s0)
                items = [(hbm.offset(b) + layer * LB + s0 * TB,
                          de_off[b] + layer * LB + s0 * TB, (s1 - s0) * TB)
                         for b, s0, s1 in layer_runs(push_from, prompt, T)]
                push = self.transfer.write(de, items, local=e.region, remote="de_buffer")
                if layerwise:
                    pushes.append(asyncio.ensure_future(push))
                else:
                    await push
            if pushes:
                await asyncio.gather(*pushes)
        finally:
            if watch is not None:
                watch.cancel()
            for f in arrivals:
                f.cancel()
            hbm.release()
            if pebuf is not None:
                pebuf.release()
        await self._prefill_done(node, rid, e, read_bytes, read_span)

    async def _prefill_done(self, node, rid: str, e: Engine, read_bytes: int,
                            span: tuple[float, float]) -> None:
        await node.PrefillDone(node_pb2.PrefillDoneRequest(
            request_id=rid, prefill_engine_id=e.engine_id, prefill_done_unix_s=unix_now(),
            prefill_node_id=self.node_id, prefill_read_bytes=read_bytes,
            read_start_unix_s=span[0], read_end_unix_s=span[1]), timeout=10)

    # ------------------------------------------------------------ DE
    async def prepare(self, req) -> list[int]:
        e = self.by_id.get(req.decode_engine_id)
        if e is None:
            raise UsageError(f"engine {req.decode_engine_id} is not on node {self.node_id}")
        p = Payload.decode(req.payload)
        old = self.requests.pop(req.request_id, None)
        if old is not None:            # a retry after a failed prefill: start over
            for t in old.tasks:
                t.cancel()
            self._release_decode(old)
        prompt = int(req.prompt_tokens)
        spans = block_spans(p.token_ids(prompt), self.layout.tokens)
        res = None if p.oracle else await self.pool.reserve(len(spans))
        st = DecodeState(req.request_id, e, p, spans, res, req.prefill_control_address)
        self.requests[req.request_id] = st
        if req.read_side == RS_DECODE:
            self.pending_reads[req.request_id] = int(req.hit_tokens)
        e.tokens.setdefault(req.request_id, prompt)
        return [] if res is None else [res.offset(i) for i in range(len(spans))]

    def _release_decode(self, st: DecodeState) -> None:
        self.pending_reads.pop(st.request_id, None)
        if st.buffer is not None and not st.buffer.released:
            st.buffer.release()

    async def load_hit_kv(self, st: DecodeState, order) -> None:
        """DE read path: hit Full Blocks storage -> DE buffer; per layer DE buffer -> the
        PE's HBM (the order's target slots), announcing each layer."""
        LB = self.layout.layer_bytes
        n = len(order.block_keys)
        try:
            if n > len(st.spans) or st.buffer is None:
                raise RequestFailed(f"{st.request_id}: order for {n} blocks does not fit")
            r0 = unix_now()
            self.pending_reads.pop(st.request_id, None)
            res = await self.read_queue.read(list(order.block_keys),
                                             [st.buffer.flat(i) for i in range(n)])
            st.read_span = (r0, unix_now())
            if not res.all_hit:
                raise RequestFailed(f"{st.request_id}: {res.hits.count(False)} of {n} hit "
                                    "blocks missing from storage")
            st.read_bytes = n * self.layout.full_bytes
            self.metrics.read_bytes.inc(st.read_bytes)
            region = order.target_slots[0].region
            for layer in range(self.layout.layers):
                items = [(st.buffer.offset(i) + layer * LB,
                          order.target_slots[i].offset_bytes + layer * LB, LB)
                         for i in range(n)]
                await self.transfer.write(st.pe_address, items, local="de_buffer",
                                          remote=region)
                st.layers_done = layer + 1
                st.changed.set()
        except BaseException as err:  # reported to the PE through the watch, then re-raised
            st.load_error = f"{type(err).__name__}: {err}"
            log.warning("loading hit KV of %s for %s failed: %s", st.request_id,
                        st.pe_address, st.load_error)
            st.changed.set()
            if not isinstance(err, Exception):
                raise

    async def decode(self, st: DecodeState, req) -> None:
        e, p = st.engine, st.payload
        rid = st.request_id
        t0 = time.monotonic()
        prompt, gen = p.prompt_tokens, p.gen_tokens
        timings = node_pb2.RequestTimings(
            request_id=rid, decode_engine_id=e.engine_id, prefill_node_id=req.prefill_node_id,
            decode_node_id=self.node_id, prefill_read_bytes=req.prefill_read_bytes,
            decode_read_bytes=st.read_bytes)
        spans = [(req.read_start_unix_s, req.read_end_unix_s), st.read_span]
        spans = [s for s in spans if s[0] > 0]
        if spans:
            timings.read_start_unix_s = min(s[0] for s in spans)
            timings.read_end_unix_s = max(s[1] for s in spans)
        T = self.layout.tokens
        hbm = None
        try:
            verified = 0
            if not p.oracle:
                bad = await asyncio.to_thread(self._verify, st)
                nbytes = prompt * self.profile.kv_bytes_per_token
                if bad is not None:
                    self.metrics.mismatched.inc(nbytes)
                    timings.bytes_mismatched = nbytes
                    raise RequestFailed(f"KV MISMATCH in {rid}: {bad}")
                verified = nbytes
                self.metrics.verified.inc(nbytes)
                timings.bytes_verified = verified
            total_blocks = blocks_for(prompt + gen, T)
            hbm = await e.hbm.reserve(total_blocks)
            if st.buffer is not None:
                for i in range(len(st.spans)):
                    np.copyto(hbm.flat(i), st.buffer.flat(i))   # DE buffer -> DE HBM
                self._release_decode(st)
            step = cost.decode_s(self.profile, 1)
            await asyncio.sleep(step)
            timings.first_token_unix_s = unix_now()
            if gen >= 2:
                await asyncio.sleep(step)
                timings.second_token_unix_s = unix_now()
            if gen > 2:
                await asyncio.sleep(cost.decode_s(self.profile, gen - 2))
            if not p.oracle:
                await self._persist(st, hbm, prompt, gen)
            timings.finish_unix_s = unix_now()
            self.metrics.requests.labels("done").inc()
            self.metrics.phase_s.labels("decode").observe(time.monotonic() - t0)
            self._complete(rid, e, scheduler_pb2.COMPLETION_STAGE_DECODE_DONE)
        except asyncio.CancelledError:
            raise
        except Exception as err:  # noqa: BLE001 - reported, then requeued by the scheduler
            log.error("decode of %s on %s failed: %s", rid, e.engine_id, err)
            self.metrics.requests.labels("decode_failed").inc()
            timings.failed, timings.error = True, str(err)
            timings.finish_unix_s = unix_now()
            self._complete(rid, e, scheduler_pb2.COMPLETION_STAGE_FAILED)
        finally:
            if hbm is not None:
                hbm.release()
            self._release_decode(st)
            self.requests.pop(rid, None)
            e.tokens.pop(rid, None)
            e.reserved_blocks.pop(rid, None)
        if p.sink:
            sink = node_pb2_grpc.ReplaySinkStub(self.channels.channel(p.sink))
            try:
                await sink.Report(timings, timeout=10)
            except grpc.aio.AioRpcError as err:
                log.warning("replay sink %s unreachable for %s: %s", p.sink, rid,
                            err.code().name)

    def _verify(self, st: DecodeState) -> str | None:
        """Every byte of the assembled prompt KV against the generator; the first bad
        place as text, or None. Runs on a worker thread (numpy releases the GIL)."""
        LB, TB = self.layout.layer_bytes, self.layout.token_bytes
        for i, span in enumerate(st.spans):
            flat = st.buffer.flat(i)
            if span.tokens == self.layout.tokens:
                m = self.synth.verify_full(flat, span.key)
                if m is not None:
                    return f"block {i}: {m}"
                continue
            for layer in range(self.layout.layers):
                m = self.synth.verify_layer(flat[layer * LB: layer * LB + span.tokens * TB],
                                            span.key, layer, 0)
                if m is not None:
                    return f"block {i} (partial, {span.tokens} tokens): {m}"
        return None

    async def _persist(self, st: DecodeState, hbm, prompt: int, gen: int) -> None:
        """Every full block past the hit prefix: prompt blocks as verified, blocks that
        generated tokens complete as the emulated model's KV."""
        T = self.layout.tokens
        p = st.payload
        keys = block_keys(p.token_ids(prompt + gen), T)
        for b in range(p.hit_tokens // T, len(keys)):
            if (b + 1) * T > prompt:
                self.synth.fill_full(hbm.flat(b), keys[b])
            await self.store.awrite(keys[b], hbm.flat(b))
            self.metrics.persisted.inc()

    # ------------------------------------------------------------ shutdown
    async def close(self) -> None:
        """Stop serving, cancel work, then close what start() made, newest first
        (safe after a start() that failed half way)."""
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if hasattr(self, "sched_channel"):
            await self.sched_channel.close()
        if getattr(self, "metrics_srv", None) is not None:
            self.metrics_srv.close()
        if hasattr(self, "server"):
            await self.server.stop(1.0)
        if hasattr(self, "transfer"):
            await self.transfer.close()
        if hasattr(self, "channels"):
            await self.channels.close()
        if hasattr(self, "read_queue"):
            await self.read_queue.close()
        for c in reversed(self._closers):
            c()
        self._closers.clear()


class _LayerWatch:
    """Consumes a WatchTransfers stream; ``await until(n)`` returns once n layers landed."""

    def __init__(self, call):
        self.call = call
        self.layers = 0
        self.error: str | None = None
        self.changed = asyncio.Event()
        self.task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        try:
            async for prog in self.call:
                self.layers = max(self.layers, prog.layers_done)
                self.changed.set()
        except grpc.aio.AioRpcError as e:
            self.error = f"{e.code().name} {e.details()}"
        if self.error is None and not self.layers:
            self.error = "transfer stream ended early"
        self.changed.set()

    async def until(self, n: int) -> None:
        while self.layers < n:
            if self.error is not None or self.task.done():
                raise RequestFailed(f"hit KV from the DE: {self.error or 'stream ended'}")
            self.changed.clear()
            await self.changed.wait()

    def cancel(self) -> None:
        self.call.cancel()
        self.task.cancel()


class EngineServicer(engine_pb2_grpc.EngineServicer):
    def __init__(self, node: NodeDaemon):
        self.node = node

    async def ExchangeEndpoint(self, request, context):
        try:
            data = await self.node.oob.handle(request.caller.endpoint)
        except DualPathError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return engine_pb2.ExchangeEndpointResponse(callee=engine_pb2.DataPlaneEndpoint(
            engine_id=self.node.node_id, transport=self.node.transfer.transport,
            endpoint=data))

    async def SubmitTransferOrder(self, request, context):
        node = self.node
        st = node.requests.get(request.request_id)
        if request.kind != engine_pb2.TRANSFER_KIND_LOAD_HIT_KV:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                                "only LOAD_HIT_KV orders are executed by a DE")
        if st is None:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"request {request.request_id} was not prepared here")
        if len(request.target_slots) != len(request.block_keys):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "one target slot per block key is required")
        await node.transfer.connect(st.pe_address)
        st.tasks.append(node._spawn(node.load_hit_kv(st, request)))
        return engine_pb2.TransferOrderAccepted(order_id=next(node._order_ids))

    async def WatchTransfers(self, request, context):
        st = self.node.requests.get(request.request_id)
        if st is None:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"request {request.request_id} is not here")
        sent = -1
        L = self.node.layout.layers
        while True:
            # Clear before looking: a layer that lands while we are suspended in the
            # yield below sets the event again, so no wake-up is lost.
            st.changed.clear()
            if st.load_error:
                await context.abort(grpc.StatusCode.ABORTED, st.load_error)
            if st.layers_done != sent:
                sent = st.layers_done
                yield engine_pb2.TransferProgress(request_id=st.request_id, layers_done=sent,
                                                  complete=sent == L)
                if sent == L:
                    return
                continue
            await st.changed.wait()

    async def CancelRequest(self, request, context):
        known = request.request_id in self.node.requests
        self.node._cancel(request.request_id)
        return engine_pb2.CancelRequestResponse(was_known=known)


class NodeServicer(node_pb2_grpc.NodeServicer):
    def __init__(self, node: NodeDaemon):
        self.node = node

    async def PrepareRequest(self, request, context):
        if self.node.role != DECODE:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "not a decode node")
        try:
            offs = await self.node.prepare(request)
        except DualPathError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return node_pb2.PrepareRequestResponse(block_offsets_bytes=offs)

    async def StorageReads(self, request, context):
        lim = self.node.limiter
        keys = sorted(lim.slots)
        return node_pb2.StorageReadsResponse(
            node_id=self.node.node_id, slot_s=lim.SLOT_S,
            slot_start_unix_s=[k * lim.SLOT_S for k in keys],
            slot_bytes=[lim.slots[k] for k in keys])

    async def PrefillDone(self, request, context):
        node = self.node
        st = node.requests.get(request.request_id)
        if st is None:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"request {request.request_id} is not here")
        st.tasks.append(node._spawn(node.decode(st, request)))
        return node_pb2.PrefillDoneResponse()


async def run(config: Config, role: str, node_id: str, scheduler: str, *,
              config_path: str | None = None,
              on_ready: Callable[[NodeDaemon], None] | None = None) -> None:
    """Run a node until SIGTERM/SIGINT."""
    node = NodeDaemon(config, role, node_id, scheduler, config_path=config_path)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, node.stop.set)
    def dump_tasks() -> None:
        """SIGUSR1: log where every task waits (the await chain), for stuck requests."""
        for t in asyncio.all_tasks():
            chain, c = [], t.get_coro()
            while c is not None and hasattr(c, "cr_frame") and c.cr_frame is not None:
                chain.append(f"{c.cr_code.co_name}:{c.cr_frame.f_lineno}")
                c = c.cr_await
            log.info("task %s waits in %s (on %r)", t.get_name(), " > ".join(chain), c)
        for st in node.requests.values():
            log.info("request %s: layers_done %d, load_error %r, tasks %s", st.request_id,
                     st.layers_done, st.load_error, [(t.get_name(), t.done()) for t in st.tasks])

    with contextlib.suppress(NotImplementedError, RuntimeError):
        loop.add_signal_handler(signal.SIGUSR1, dump_tasks)
    try:
        await node.start()
        if on_ready is not None:
            on_ready(node)
        leader = node._spawn(node.run_leader())
        await node.stop.wait()
        log.info("%s: shutting down", node.node_id)
        leader.cancel()
    finally:
        await node.close()
