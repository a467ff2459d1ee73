"""The group leader of a PE or DE node (rank 0's job, paper §6.1): register the group,
then fetch assignments and report completions every few milliseconds.

Each fetch carries every engine's status (unfinished requests and tokens, the node's
read queue, free HBM on DEs) and the completions since the last fetch; its answer's
assignments are converted to :class:`~dualpath.engine.assignment.Assignment` once, here,
and handed to the node's path. A lost lease drops all in-flight work and registers again.

Each completion carries the attempt of the assignment it answers (docs/reliability.md), so
the scheduler ignores one from an execution it has since given up; the channel to the
scheduler keeps itself alive (:data:`dualpath.rpc.CHANNEL_OPTIONS`).

Threads: the node's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import grpc

from dualpath import tls
from dualpath.engine.assignment import Assignment
from dualpath.engine.emulated import EngineRank
from dualpath.engine.metrics import NodeMetrics
from dualpath.engine.roles import DECODE, PREFILL, ROLE_PB
from dualpath.errors import ConfigError, UsageError
from dualpath.rpc import CHANNEL_OPTIONS
from dualpath.tls import TlsConfig
from dualpath.v1 import scheduler_pb2, scheduler_pb2_grpc

log = logging.getLogger("dualpath.engine")

#: Attempts remembered for requests not yet reported; past this many, those no engine
#: of the node holds any more are forgotten (a completion without one says attempt 0).
MAX_ATTEMPTS_KEPT = 65536


class Leader:
    """``path`` is the node's PrefillPath or DecodePath (``assign``, ``cancel`` and the
    ids it holds); ``cancel`` drops a request everywhere on the node."""

    def __init__(self, *, node_id: str, role: str, address: str, scheduler: str,
                 tls_config: TlsConfig, ranks: list[EngineRank], path, cancel: Callable[[str], None],
                 read_q_tokens: Callable[[], int], metrics: NodeMetrics, profile_name: str,
                 block_bytes: int, storage_read_bytes_per_s: int, fetch_interval_ms: int = 0):
        self.node_id, self.role, self.address = node_id, role, address
        self.scheduler_address = scheduler
        self.ranks = ranks
        self.by_id = {e.engine_id: e for e in ranks}
        self.path = path
        self.cancel = cancel
        self.read_q_tokens = read_q_tokens
        self.metrics = metrics
        self.profile_name = profile_name
        self.block_bytes = block_bytes
        self.storage_read_bytes_per_s = storage_read_bytes_per_s
        self.fetch_interval_ms = fetch_interval_ms
        self.fetch_interval_s = (fetch_interval_ms or 20) / 1000.0
        self.completions: list[scheduler_pb2.Completion] = []
        # Request id -> the attempt of its assignment here, until this node reports it.
        self.attempts: dict[str, int] = {}
        self.lease_id = 0
        self._last_status_log = 0.0
        self.channel = tls.channel(scheduler, tls_config, options=CHANNEL_OPTIONS)
        self.scheduler = scheduler_pb2_grpc.SchedulerStub(self.channel)

    def complete(self, rid: str, engine: EngineRank, stage: int) -> None:
        """Queue a completion; it rides on the next fetch. Any completion ends this
        node's part of the request (PREFILL_DONE on a PE; DECODE_DONE or FAILED)."""
        self.completions.append(scheduler_pb2.Completion(
            request_id=rid, engine_id=engine.engine_id, stage=stage,
            attempt=self.attempts.pop(rid, 0)))

    async def run(self, stop: asyncio.Event) -> None:
        """Register, then fetch/report every interval until ``stop`` is set."""
        backoff = 0.05
        while not stop.is_set():
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
            hbm_bytes=e.hbm.capacity * self.block_bytes if self.role == DECODE else 0)
            for e in self.ranks]
        r = await self.scheduler.RegisterGroup(scheduler_pb2.RegisterGroupRequest(
            group_id=self.node_id, role=ROLE_PB[self.role], engines=infos,
            storage_read_bytes_per_s=self.storage_read_bytes_per_s), timeout=5)
        if r.model_profile and r.model_profile != self.profile_name:
            raise ConfigError(f"the scheduler plans with model profile {r.model_profile!r}, "
                              f"this node runs {self.profile_name!r}")
        self.lease_id = r.lease_id
        ms = self.fetch_interval_ms or r.fetch_interval_ms or 20
        self.fetch_interval_s = ms / 1000.0
        log.info("%s: group registered (lease %d, fetch every %d ms)", self.node_id,
                 r.lease_id, ms)

    def _status(self, e: EngineRank) -> scheduler_pb2.EngineStatus:
        free = 0
        if self.role == DECODE:
            free_blocks = e.hbm.capacity - sum(e.reserved_blocks.values())
            free = max(0, free_blocks) * self.block_bytes
        return scheduler_pb2.EngineStatus(
            engine_id=e.engine_id, unfinished_requests=len(e.tokens),
            unfinished_tokens=sum(e.tokens.values()),
            read_queue_tokens=self.read_q_tokens(), free_hbm_bytes=free)

    def _in_flight(self) -> list[str]:
        return sorted({rid for e in self.ranks for rid in e.tokens})

    async def _fetch_once(self) -> None:
        done, self.completions = self.completions, []   # they ride on the fetch
        self.metrics.read_q.set(self.read_q_tokens())
        now = time.monotonic()
        busy = self._in_flight()
        if now - self._last_status_log > 5.0 and busy:
            self._last_status_log = now
            log.info("%s: in flight: %s", self.node_id, busy[:6])
        try:
            r = await self.scheduler.Fetch(scheduler_pb2.FetchRequest(
                group_id=self.node_id, lease_id=self.lease_id,
                engines=[self._status(e) for e in self.ranks], completions=done), timeout=5)
        except grpc.aio.AioRpcError:
            self.completions[:0] = done     # reports are idempotent: resend next time
            raise
        for rid in r.cancelled_request_ids:
            self.attempts.pop(rid, None)
            self.cancel(rid)
        if len(self.attempts) > MAX_ATTEMPTS_KEPT:   # ended without a report: forget them
            live = set(busy)
            self.attempts = {k: v for k, v in self.attempts.items() if k in live}
        for pb in r.assignments:
            eid = pb.prefill_engine_id if self.role == PREFILL else pb.decode_engine_id
            e = self.by_id.get(eid)
            if e is None:
                continue
            self.attempts[pb.request_id] = pb.attempt
            try:
                a = Assignment.from_pb(pb)
            except UsageError as err:
                log.warning("%s: assignment %s refused: %s", self.node_id, pb.request_id, err)
                self.complete(pb.request_id, e, scheduler_pb2.COMPLETION_STAGE_FAILED)
                continue
            self.path.assign(e, a)

    def _drop_all(self) -> None:
        for rid in self._in_flight():
            self.cancel(rid)
        self.completions.clear()
        self.attempts.clear()

    async def close(self) -> None:
        await self.channel.close()
