"""The PE and DE node daemon: one process per node, g engines in one group (paper §6.1).

What a node owns (created in this order, closed in reverse): the block store and its read
queue behind a storage-NIC token bucket (shared by the node's engines); one pinned DRAM
buffer (the PE buffer or the DE buffer) and, per engine, an "HBM" region, all registered
with the node's TransferEngine; the gRPC server (Engine + Node + health,
dualpath/engine/servicers.py); the leader loop that registers the group and fetches work
every few ms.

What a request does there lives with its side: the prefill on a PE in
dualpath/engine/prefill.py (:class:`PrefillPath`), prepare, the DE read and decode on a DE
in dualpath/engine/decode.py (:class:`DecodePath`). The daemon hands them assignments and
cancels, and carries their completions on the next fetch.

Modes come from the request payload (dualpath/engine/kvplan.py): basic forces the PE
read side, oracle skips storage and every KV transfer (compute and decode only).

Threads: one asyncio loop owns all state; storage I/O runs on the block store's pools,
the data path on the TransferEngine's thread, verification in ``asyncio.to_thread``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2

from dualpath import metrics as _metrics
from dualpath.buffers.pool import BlockPool
from dualpath.buffers.region import PinnedRegion
from dualpath.config import Config
from dualpath.engine.decode import DecodePath
from dualpath.engine.oob import GrpcChannels, GrpcOutOfBand
from dualpath.engine.prefill import PrefillPath
from dualpath.engine.servicers import create_server
from dualpath.engine.state import (
    DECODE,
    PREFILL,
    ROLE_PB,
    Engine,
    NodeMetrics,
    RequestFailed,
    unix_now,
)
from dualpath.errors import ConfigError, UsageError
from dualpath.kv.layout import BlockLayout
from dualpath.kv.profiles import ModelProfile, get_profile
from dualpath.kv.synth import SyntheticKV
from dualpath.storage.ratelimit import RateLimiter, gbit_to_bytes_per_s
from dualpath.storage.read_queue import ReadQueue
from dualpath.storage.store import BlockStore
from dualpath.transfer import TransferEngine
from dualpath.v1 import scheduler_pb2, scheduler_pb2_grpc

log = logging.getLogger("dualpath.engine")


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


class NodeDaemon:
    """See the module docstring. Create, ``await start()``, run :meth:`run_leader` until
    ``stop`` is set (or use :func:`run`), ``await close()``. Event-loop thread only."""

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
        self.pe = PrefillPath(self)     # prefills (busy on a PE node only)
        self.de = DecodePath(self)      # prepared requests and decodes (on a DE node)
        self.completions: list[scheduler_pb2.Completion] = []
        self.address = ""
        self.stop = asyncio.Event()
        self._closers: list[Callable] = []
        self._tasks: set[asyncio.Task] = set()
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
                                verify_checksum=s.verify_checksum, fsync=s.fsync,
                                integrity_key=s.integrity_key())
        self._closers.append(self.store.close)
        self.snic_bytes_per_s = gbit_to_bytes_per_s(s.snic_gbit_per_s) if s.snic_gbit_per_s else 0
        self.limiter = CountingLimiter(s.snic_gbit_per_s, s.snic_burst_bytes or None)
        self.read_queue = ReadQueue(self.store, self.limiter)
        self.channels = GrpcChannels()
        self.oob = GrpcOutOfBand(self.channels)
        # The gRPC server first: our name on the out-of-band channel is its address.
        self.server, port, self.health = create_server(ecfg.control_listen, self)
        host = ecfg.control_listen.rpartition(":")[0]
        self.address = f"{ecfg.advertise or host}:{port}"
        self.transfer = TransferEngine.open(self.address, self.oob, transport=cfg.transport,
                                            transfer=cfg.transfer, lane=cfg.kv_lane)
        await self.transfer.start()
        self.metrics.transport.labels(self.transfer.transport).set(1)
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
        self.metrics_srv = _metrics.start_metrics_server(ecfg.metrics_listen, self.registry,
                                                        "engine.metrics_listen")
        await self.server.start()
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        self.sched_channel = grpc.aio.insecure_channel(self.scheduler_address)
        self.scheduler = scheduler_pb2_grpc.SchedulerStub(self.sched_channel)
        lane = cfg.kv_lane
        # The provider's description names the device, port and GID in use (verbs) or
        # the listen address (tcp); the config's device "" / gid_index -1 only mean "auto".
        log.info("%s node %s up: control %s; transport %s (%s), lane SL %d / TC %d; "
                 "%d engines, HBM %s (%d MiB each), %s %d MiB; storage "
                 "%s, storage NIC %s; model %s (emulated execution, speed x%g); config %s",
                 self.role, self.node_id, self.address, self.transfer.transport,
                 self.transfer.provider.description,
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

    async def read_hit_blocks(self, rid: str, keys: list[bytes], dests: list
                              ) -> tuple[int, tuple[float, float]]:
        """Read request ``rid``'s hit Full Blocks ``keys`` from storage into ``dests``
        (one flat block view each) through the node's read queue; the bytes read and
        the read's wall-clock (start, end). Raises RequestFailed when any is missing."""
        r0 = unix_now()
        self.pending_reads.pop(rid, None)    # queued now: counted by the read queue
        res = await self.read_queue.read(keys, dests)
        span = (r0, unix_now())
        if not res.all_hit:
            raise RequestFailed(f"{rid}: {res.hits.count(False)} of {len(keys)} hit "
                                "blocks missing from storage")
        nbytes = len(keys) * self.layout.full_bytes
        self.metrics.read_bytes.inc(nbytes)
        return nbytes, span

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
        if now - self._last_status_log > 5.0 and (self.pe.tasks or self.de.requests):
            self._last_status_log = now
            log.info("%s: in flight: prefills %s; decodes %s", self.node_id,
                     sorted(self.pe.tasks)[:6], sorted(self.de.requests)[:6])
        try:
            r = await self.scheduler.Fetch(scheduler_pb2.FetchRequest(
                group_id=self.node_id, lease_id=self.lease_id,
                engines=[self._status(e) for e in self.engines], completions=done), timeout=5)
        except grpc.aio.AioRpcError:
            self.completions[:0] = done     # reports are idempotent: resend next time
            raise
        for rid in r.cancelled_request_ids:
            self.cancel(rid)
        for a in r.assignments:
            if self.role == PREFILL:
                e = self.by_id.get(a.prefill_engine_id)
                if e is not None:
                    self.pe.assign(e, a)
            else:
                e = self.by_id.get(a.decode_engine_id)
                if e is not None:
                    self.de.assign(e, a)

    def complete(self, rid: str, engine: Engine, stage: int) -> None:
        self.completions.append(scheduler_pb2.Completion(request_id=rid,
                                                         engine_id=engine.engine_id,
                                                         stage=stage))

    def spawn(self, coro) -> asyncio.Task:
        t = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    def cancel(self, rid: str) -> None:
        """Drop request ``rid`` wherever it is here (the scheduler cancelled it, a PE
        gave it up, or the lease was lost)."""
        self.pe.cancel(rid)
        self.pending_reads.pop(rid, None)
        self.de.cancel(rid)
        for e in self.engines:
            e.tokens.pop(rid, None)
            e.reserved_blocks.pop(rid, None)

    def _drop_all(self) -> None:
        for rid in [*self.pe.tasks, *self.de.requests]:
            self.cancel(rid)
        self.completions.clear()

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
        for st in node.de.requests.values():
            log.info("request %s: layers_done %d, load_error %r, tasks %s", st.request_id,
                     st.layers_done, st.load_error, [(t.get_name(), t.done()) for t in st.tasks])

    with contextlib.suppress(NotImplementedError, RuntimeError):
        loop.add_signal_handler(signal.SIGUSR1, dump_tasks)
    try:
        await node.start()
        if on_ready is not None:
            on_ready(node)
        leader = node.spawn(node.run_leader())
        await node.stop.wait()
        log.info("%s: shutting down", node.node_id)
        leader.cancel()
    finally:
        await node.close()
