"""The node daemon (`dualpath node`): one process per node, serving one model engine.

The daemon only assembles. Inside one exit stack (closed in reverse order, also after a
start-up that failed half way) it opens the node's resources and hands each part what
it needs, never itself:

    gRPC server (bound first: its address is our name on the data plane) ->
    transfer engine (verbs or tcp) -> storage-NIC limiter -> the node's buffer ->
    the engine, with its path (PE: a PrefillPath; DE: a DecodePath) -> services ->
    serving -> once the engine is ready, the leader (PE/DE: registers the group and
    fetches from the scheduler)

Engines (``engine.kind``): the daemon looks the kind up in dualpath/engines/ (KINDS)
and talks to what it opens through dualpath/engines/protocol.py only: ``emulated`` (a
cost model and "HBM" of our own, for benchmarks at scale) or ``vllm`` (a vLLM instance
beside the node, whose workers attach through the KvConnector service).

Threads: one asyncio loop owns all state; storage I/O runs on the block store's pools,
the data path on the transfer engine's thread, verification in ``asyncio.to_thread``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable

from grpc_health.v1 import health_pb2

from dualpath import journald, tls
from dualpath import metrics as _metrics
from dualpath.buffers.region import PinnedRegion
from dualpath.config import Config
from dualpath.doctor.checks import startup_memory
from dualpath.doctor.facts import has_ipc_lock, memory_facts
from dualpath.engines import open_kind
from dualpath.engines.protocol import NodeEngine, NodeParts
from dualpath.errors import ConfigError, UsageError
from dualpath.lane import describe as describe_lane
from dualpath.node.holdings import Holdings, pool_holding
from dualpath.node.leader import Leader
from dualpath.node.servicers import add_services, engine_services, new_server
from dualpath.paths.auth import Callers
from dualpath.paths.errors import PeerUnavailable
from dualpath.paths.fence import Fences
from dualpath.paths.metrics import (
    CountingLimiter,
    NodeMetrics,
    OwnedCounters,
    PoolGauges,
    StoreGauges,
)
from dualpath.paths.peers import PeerClient
from dualpath.paths.ranks import EngineRank
from dualpath.paths.resources import NodeResources
from dualpath.roles import BOTH, DECODE, ROLES, CompletionStage
from dualpath.sdnotify import Notifier
from dualpath.stall import StallWatch
from dualpath.storage.ratelimit import gbit_to_bytes_per_s
from dualpath.trace.model import trajectory_token_ids
from dualpath.transfer import TransferEngine
from dualpath.transfer.oob_grpc import GrpcChannels, GrpcOutOfBand

log = logging.getLogger("dualpath.node")


class NodeDaemon:
    """See the module docstring. Create, ``await start()``, ``await run_until(stop)``
    (or use :func:`run`), ``await close()``. Event-loop thread only."""

    def __init__(self, config: Config, role: str, node_id: str, scheduler: str, *,
                 config_path: str | None = None, notifier: Notifier | None = None):
        self.notifier = notifier or Notifier({})   # systemd's, from run(); silent here
        if role not in ROLES:
            raise UsageError(f"role must be one of {', '.join(ROLES)}, not {role!r}")
        self.kind = open_kind(config.engine.kind)
        self.kind.check(config, role)
        self.cfg = config
        self.role = role
        self.node_id = node_id
        self.scheduler_address = scheduler
        self.config_path = config_path
        self.registry = _metrics.new_registry()
        self.metrics = NodeMetrics(self.registry, role)
        self.ranks: list[EngineRank] = []
        self.engine: NodeEngine | None = None
        self.leader: Leader | None = None
        self.address = ""
        self.stop = asyncio.Event()
        self._stack = contextlib.AsyncExitStack()
        self._tasks: set[asyncio.Task] = set()

    # ------------------------------------------------------------ start-up

    def _stalled(self, seconds: float) -> None:
        self.metrics.loop_stalls.inc()
        self.metrics.loop_stalled.inc(seconds)

    async def start(self) -> None:
        cfg, ecfg, s = self.cfg, self.cfg.engine, self.cfg.storage
        st = self._stack
        tls.log_mode(cfg.tls, f"node {self.node_id}", log)
        # A blocked event loop is late for every lease, deadline and peer at once: say
        # where it was blocked (dualpath/stall.py).
        stall = StallWatch(f"node {self.node_id}", on_stall=self._stalled).start()
        st.callback(stall.close)
        self.callers = Callers(cfg.tls, self.node_id)
        self.channels = GrpcChannels(cfg.tls)
        st.push_async_callback(self.channels.close)
        self.oob = GrpcOutOfBand(self.channels)
        self.peers = PeerClient(self.channels)
        # The gRPC server is bound first: our name on the data plane is its address.
        self.server, port, self.health = new_server(ecfg.control_listen,
                                                    tls.server_credentials(cfg.tls),
                                                    cfg.grpc)
        host = ecfg.control_listen.rpartition(":")[0]
        self.address = f"{ecfg.advertise or host}:{port}"
        # Before any region is mapped: what the configuration pins against what the
        # host gives (memlock, free huge pages), one line, a warning when short.
        short, line = startup_memory(cfg, self.role, memory_facts(), has_ipc_lock())
        log.log(logging.WARNING if short else logging.INFO, "%s: %s", self.node_id, line)
        # Regions are unmapped only after the transfer engine closed (it deregisters
        # them and stops the threads that write into them): pushed before it.
        self._regions: list[PinnedRegion] = []
        st.callback(lambda: [r.close() for r in reversed(self._regions)])
        self.transfer = TransferEngine.open(self.address, self.oob, transport=cfg.transport,
                                            transfer=cfg.transfer, lane=cfg.kv_lane)
        st.push_async_callback(self.transfer.close)
        await self.transfer.start()
        if not cfg.tls.plaintext:       # our vLLM worker (our certificate) writes anywhere
            self.transfer.trust(str(tls.Identity("node", self.node_id)))
        self.metrics.transport.labels(self.transfer.transport).set(1)
        self.snic_bytes_per_s = gbit_to_bytes_per_s(s.snic_gbit_per_s) if s.snic_gbit_per_s else 0
        self.limiter = CountingLimiter(s.snic_gbit_per_s, s.snic_burst_bytes or None)
        self.metrics.snic_rate.set(self.snic_bytes_per_s)
        self.fences = Fences(self._ask_writer, self.spawn, self.metrics.fenced_blocks)
        self.resources = NodeResources(
            self.node_id, self.role, self.address, cfg, self.transfer, self.peers,
            self.limiter, self.metrics, trajectory_token_ids, self.spawn, self._complete,
            self.fences)
        buf_name = "de_buffer" if self.role == DECODE else "pe_buffer"
        b = cfg.buffers
        self.buffer = self._region(buf_name, b.de_buffer_mib if self.role == DECODE
                                   else b.pe_buffer_mib, shared=self.kind.shares_buffer)
        self.engine = engine = self.kind.open(NodeParts(
            self.resources, self.buffer, buf_name, st, self._region, self.callers))
        self.ranks = engine.ranks
        decode = engine.path if self.role == DECODE else None
        add_services(self.server, [
            *engine_services(self.callers, self.oob, self.transfer, decode,
                             self.stop_request, self.limiter, self.holdings, engine.forward),
            *engine.services])
        self.registry.register(OwnedCounters(self.transfer.stats, self._store_stats,
                                             self.transfer.provider.target_stats))
        self.registry.register(PoolGauges(self._pool))
        self.registry.register(StoreGauges(self._store_upkeep))
        self.metrics_srv = _metrics.start_metrics_server(ecfg.metrics_listen, self.registry,
                                                        "engine.metrics_listen",
                                                        tls.metrics_context(cfg.tls))
        if self.metrics_srv is not None:
            st.callback(self.metrics_srv.close)
        await self.server.start()
        st.push_async_callback(self.server.stop, 1.0)
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        lane = cfg.kv_lane
        # The provider's description names the device, port and GID in use (verbs) or
        # the listen address (tcp); the config's device "" / gid_index -1 only mean "auto".
        log.info("%s node %s up: control %s; transport %s (%s), lane %s; TLS "
                 "%s; engine %s; %s %d MiB; storage %s, storage NIC %s; scheduler %s; "
                 "config %s", self.role, self.node_id, self.address,
                 self.transfer.transport, self.transfer.provider.description,
                 describe_lane(lane.service_level, lane.traffic_class), tls.mode(cfg.tls),
                 self.engine.describe(), buf_name,
                 self.buffer.nbytes >> 20, s.resolved_dir(),
                 f"{s.snic_gbit_per_s:g} Gbit/s" if s.snic_gbit_per_s else "unlimited",
                 "none (role both)" if self.role == BOTH else self.scheduler_address,
                 self.config_path or "(defaults)")

    def _region(self, name: str, mib: int, shared: bool = False) -> PinnedRegion:
        if mib <= 0:
            raise ConfigError(f"the {name} of a {self.role} node needs a size: set "
                              f"buffers.{'de' if name == 'de_buffer' else 'pe'}_buffer_mib > 0")
        b = self.cfg.buffers
        region = PinnedRegion(mib << 20, huge_pages=b.huge_pages, lock=b.mlock,
                              what=f"{self.node_id} {name}", shared=shared)
        self._regions.append(region)
        # Scoped under mutual TLS: a peer WRITEs only into the slots of the requests it
        # was given (KvSpace.grant); plaintext has no identities to scope by.
        self.transfer.register(name, addr=region.addr, length=region.nbytes,
                               scoped=not self.cfg.tls.plaintext)
        return region

    @property
    def path(self):
        """The engine's path (a PrefillPath or a DecodePath; None on a role-both node)."""
        return self.engine.path if self.engine is not None else None

    def _leader(self) -> Leader:
        terms = self.engine.leader_terms()
        return Leader(node_id=self.node_id, role=self.role, address=self.address,
                      scheduler=self.scheduler_address, tls_config=self.cfg.tls,
                      ranks=self.ranks, path=self.path,
                      cancel=self.cancel, read_q_tokens=self.read_q_tokens,
                      metrics=self.metrics, profile_name=terms.profile_name,
                      block_bytes=self.engine.space.layout.full_bytes,
                      storage_read_bytes_per_s=int(self.snic_bytes_per_s),
                      fetch_interval_ms=self.cfg.engine.fetch_interval_ms,
                      results=self.path if self.role == DECODE else None,
                      status=self.notifier.status, available=terms.available,
                      quota=terms.quota)

    def _pool(self):
        """The node's buffer pool (None until a vLLM worker attached)."""
        space = self.engine.space if self.engine is not None else None
        return space.pool if space is not None else None

    def holdings(self) -> Holdings:
        """What this node holds now (Node.Holdings; the idle invariant: holdings.py)."""
        path = self.path
        requests = (path.held_requests() if path is not None else 0) + \
            self.engine.held_requests()
        return Holdings(self.node_id,
                        tuple(pool_holding(p) for p in self.engine.pools()),
                        self.fences.blocks,
                        self.read_q_tokens(), requests)

    def _store_stats(self) -> dict[str, int]:
        """The block store's counters (a vLLM node opens its store when its worker first
        attaches: none before)."""
        space = self.engine.space if self.engine is not None else None
        return space.store.stats_dict() if space is not None else {}

    def _store_upkeep(self):
        """The store's upkeep (evictor), None without a capacity or a store yet."""
        space = self.engine.space if self.engine is not None else None
        return space.store.upkeep if space is not None else None

    # ------------------------------------------------------------ running

    def read_q_tokens(self) -> int:
        """read_q: hit tokens queued or being read, plus those of requests this node will
        read but has not queued yet (the read queue's expectations)."""
        return self.engine.read_q_tokens()

    def _complete(self, rid: str, engine: EngineRank, stage: CompletionStage, error: str = "",
                  suspect: str = "", final: bool = False) -> None:
        if self.leader is not None:
            self.leader.complete(rid, engine, stage, error, suspect, final)

    async def _ask_writer(self, peer: str, rid: str, attempt: int, writer=None) -> None:
        """A fence's question to the peer that may write into our memory: stop that
        attempt and answer once your writes ended (bounded by their own timeouts). Only
        the writer (``writer``, the identity that prepared the request) answers for it:
        another server at that address is not believed. A peer whose control port
        refuses connections is gone: a node stops serving only after its tasks ended
        (close()), and a restarted one listens elsewhere."""
        try:
            await self.peers.stop(peer, rid, attempt,
                                  timeout_s=2 * self.cfg.transfer.timeout_s + 5,
                                  expect=str(writer) if writer is not None else "")
        except PeerUnavailable:
            if not await _refuses_connections(peer):
                raise
            log.info("%s: %s is gone (its control port refuses connections); its writes "
                     "for %s ended with it", self.node_id, peer, rid)

    async def stop_request(self, rid: str, attempt: int, caller) -> bool:
        """Engine.CancelRequest: the caller stopped its ``attempt`` of ``rid`` (its
        writes into our memory ended); stop ours and return once they ended."""
        if self.path is None:
            return False
        return await self.path.stop(rid, attempt, caller)

    def spawn(self, coro) -> asyncio.Task:
        t = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    def cancel(self, rid: str) -> None:
        """Drop request ``rid`` wherever it is here (the scheduler cancelled it, a PE
        gave it up, or the lease was lost)."""
        if self.path is not None:
            self.path.cancel(rid)
        self.engine.forget(rid)
        for e in self.ranks:
            e.tokens.pop(rid, None)
            e.reserved_blocks.pop(rid, None)

    async def run_until_stopped(self) -> None:
        """Lead (PE/DE) until ``stop`` is set; then hand the work back (the leader's
        shutdown: pending completions, the node's tasks stopped, ReleaseGroup)."""
        if self.role != BOTH:
            self.notifier.status("waiting for the engine to take work")
            if not await self.engine.ready(self.stop):
                return
            self.leader = self._leader()
            self._stack.push_async_callback(self.leader.close)
        leader = self.spawn(self.leader.run(self.stop)) if self.leader else None
        await self.stop.wait()
        log.info("%s: shutting down", self.node_id)
        if leader is not None:
            leader.cancel()
            await asyncio.wait([leader])
            await self.leader.shutdown(self._quiesce)

    async def _quiesce(self) -> None:
        """Sink reports on their way go out (bounded); then every task stops (a prefill
        tells its DE, after its writes ended, that its attempt is over)."""
        if self.path is not None:
            await self.path.flush(timeout_s=2.0)
        await self._cancel_tasks()

    async def _cancel_tasks(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # ------------------------------------------------------------ shutdown

    async def close(self) -> None:
        """Stop serving, cancel work, then close what start() made, newest first (safe
        after a start() that failed half way). Idempotent."""
        await self._cancel_tasks()
        await self._stack.aclose()


async def _refuses_connections(address: str) -> bool:
    """True when nothing listens at ``address`` (host:port) any more: a TCP connect is
    refused. A host that does not answer (stalled, cut off) is not gone."""
    host, _, port = address.rpartition(":")
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host.strip("[]"),
                                                                   int(port)), 2.0)
    except ConnectionRefusedError:
        return True
    except (OSError, TimeoutError, ValueError):
        return False
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return False


def _dump_tasks(node: NodeDaemon) -> None:
    """SIGUSR1: log where every task waits (the await chain), for stuck requests."""
    for t in asyncio.all_tasks():
        chain, c = [], t.get_coro()
        while c is not None and hasattr(c, "cr_frame") and c.cr_frame is not None:
            chain.append(f"{c.cr_code.co_name}:{c.cr_frame.f_lineno}")
            c = c.cr_await
        log.info("task %s waits in %s (on %r)", t.get_name(), " > ".join(chain), c)
    if node.path is not None:
        node.path.dump(log)


async def run(config: Config, role: str, node_id: str, scheduler: str, *,
              config_path: str | None = None,
              on_ready: Callable[[NodeDaemon], None] | None = None) -> None:
    """Run a node until SIGTERM/SIGINT; tells systemd (sd_notify) when it serves, how its
    registration goes, and when it stops."""
    journald.set_fields(DUALPATH_NODE_ID=node_id, DUALPATH_ROLE=role)
    notifier = Notifier()
    node = NodeDaemon(config, role, node_id, scheduler, config_path=config_path,
                      notifier=notifier)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, node.stop.set)
    with contextlib.suppress(NotImplementedError, RuntimeError):
        loop.add_signal_handler(signal.SIGUSR1, _dump_tasks, node)
    watchdog = None
    try:
        await node.start()
        if on_ready is not None:
            on_ready(node)
        notifier.ready(f"serving on {node.address}; " + (
            "serving its vLLM instance's connector" if role == BOTH else
            f"registering with scheduler {scheduler}"))
        watchdog = asyncio.create_task(notifier.watchdog(), name="sd-watchdog")
        await node.run_until_stopped()
    finally:
        notifier.stopping(f"{node_id}: stopping (work handed back to the scheduler)")
        if watchdog is not None:
            watchdog.cancel()
        await node.close()
        notifier.close()
