"""The group leader of a PE or DE node (rank 0's job, paper §6.1): register the group,
then fetch assignments and report completions every few milliseconds.

Each fetch carries every engine's status (unfinished requests and tokens, the node's
read queue, free HBM on DEs) and the completions since the last fetch; its answer's
assignments are converted to :class:`~dualpath.paths.assignment.Assignment` once, here,
and handed to the node's path.

The reliability protocol (docs/reliability.md), the leader's side of it:

- Register again on FAILED_PRECONDITION (and only on it), claiming in ``running`` what
  the engines still run (request, engine, attempt, and on a DE whether all prompt KV
  arrived), and the finished requests whose DECODE_DONE has not been delivered yet. The
  work keeps running meanwhile; exactly the requests the answer lists in
  ``cancelled_request_ids`` are dropped, as are pending completions of what was not kept.
- Every completion carries the attempt of its assignment; a FAILED one its error and,
  when known, the engine to blame. Completions ride on fetches, so a node holding no
  lease reports nothing.
- A DE's result goes to the replay client's sink only once the fetch that carried its
  DECODE_DONE was answered without that request in ``ignored_request_ids``; one that was
  ignored, or whose claim was refused, may still have been recorded by a delivery whose
  answer was lost: GetResults says whether the scheduler holds it done at this attempt.
- On a graceful stop (:meth:`shutdown`): deliver what is pending, stop the node's work,
  then ReleaseGroup, so the scheduler requeues the rest at once instead of after a lease.
- The channel to the scheduler keeps itself alive (:data:`dualpath.rpc.CHANNEL_OPTIONS`)
  and is made anew after :data:`RECONNECT_AFTER` failed calls in a row.

Threads: the node's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

import grpc

from dualpath import tls
from dualpath.errors import ConfigError, UsageError
from dualpath.paths.assignment import Assignment
from dualpath.paths.metrics import NodeMetrics
from dualpath.paths.ranks import EngineRank
from dualpath.roles import DECODE, PREFILL, CompletionStage
from dualpath.rpc import CHANNEL_OPTIONS
from dualpath.tls import TlsConfig
from dualpath.v1 import scheduler_pb2, scheduler_pb2_grpc

log = logging.getLogger("dualpath.node")

#: Attempts remembered for requests not yet reported; past this many, those no engine
#: of the node holds any more are forgotten (a completion without one says attempt 0).
MAX_ATTEMPTS_KEPT = 65536
#: UNAVAILABLE / DEADLINE_EXCEEDED answers in a row after which the channel is made anew.
RECONNECT_AFTER = 5
#: How long an idle leader's fetch may be held by the scheduler (FetchRequest.wait_ms;
#: the scheduler bounds it by a third of the lease).
IDLE_WAIT_MS = 1000


def fetch_deadline_s(lease_ms: int, wait_ms: int) -> float:
    """A Fetch's deadline: the scheduler's hold (at most a third of the lease) and a
    lease to answer (0.25-5 s). Its arrival renewed the lease; a fetch unanswered for a
    whole lease after that would lose it anyway: a connection that died silently (a
    partition healed, its peer's side reset) must be given up then, to fetch again on a
    new one, not after seconds of a lapsed lease. Not sooner: a scheduler slow to answer
    on a loaded host is no reason to reconnect."""
    lease_s = lease_ms / 1000 if lease_ms > 0 else 10.0
    return min(wait_ms / 1000, lease_s / 3) + min(5.0, max(0.25, lease_s))

#: After ReleaseGroup, how long a stopping node lets the peers hear of the hand-back (the
#: scheduler's cancel rides on their next fetch, a held one woken at once) before it
#: stops its own work: their prefills are cancelled, not failed by an aborted load.
HANDBACK_GRACE_S = 0.3
#: Bytes of a FAILED completion's error (the scheduler keeps at most this much too).
MAX_ERROR_BYTES = 512
#: Request ids per GetResults call (below the scheduler's max_submit_requests).
RESULTS_PER_CALL = 256

_RETRIED = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
_ROLE_PB = {PREFILL: scheduler_pb2.ENGINE_ROLE_PREFILL, DECODE: scheduler_pb2.ENGINE_ROLE_DECODE}
_RECORDED = (scheduler_pb2.REQUEST_STATE_DECODE_DONE, scheduler_pb2.REQUEST_STATE_REPORTED)


class Leader:
    """``path`` is the node's PrefillPath or DecodePath (``assign``, ``cancel`` and
    ``claims``); ``cancel`` drops a request everywhere on the node; ``results`` (a DE's
    DecodePath) sends or drops the sink report of a completion the scheduler recorded
    or ignored."""

    def __init__(self, *, node_id: str, role: str, address: str, scheduler: str,
                 tls_config: TlsConfig, ranks: list[EngineRank], path, cancel: Callable[[str], None],
                 read_q_tokens: Callable[[], int], metrics: NodeMetrics,
                 profile_name: str | None,
                 block_bytes: int, storage_read_bytes_per_s: int, fetch_interval_ms: int = 0,
                 results=None, status: Callable[[str], None] = lambda text: None,
                 available: Callable[[], bool] = lambda: True,
                 quota: Callable[[float], None] | None = None):
        self.node_id, self.role, self.address = node_id, role, address
        self.scheduler_address = scheduler
        self.tls_config = tls_config
        self.ranks = ranks
        self.by_id = {e.engine_id: e for e in ranks}
        self.path = path
        self.cancel = cancel
        self.results = results
        self.read_q_tokens = read_q_tokens
        self.metrics = metrics
        self.profile_name = profile_name
        # An emulated PE's forward takes the compute quota every answer carries (§6.2);
        # a vLLM instance batches by its own scheduler and has none.
        self.quota = quota
        self.block_bytes = block_bytes
        self.storage_read_bytes_per_s = storage_read_bytes_per_s
        self.fetch_interval_ms = fetch_interval_ms
        self.status = status          # one line for the supervisor (systemd STATUS=)
        # False while the engine cannot take work (a vLLM instance that stopped
        # answering): the group is handed back and registered again once it can.
        self.available = available
        self.fetch_interval_s = (fetch_interval_ms or 20) / 1000.0
        self.completions: list[scheduler_pb2.Completion] = []
        # Request id -> the attempt of its assignment here, until this node reports it.
        self.attempts: dict[str, int] = {}
        self._polling = False                  # a long-poll fetch is in flight
        self._reporter: asyncio.Future | None = None   # completions sent meanwhile
        # DECODE_DONEs the scheduler did not acknowledge: asked about with GetResults.
        self.unconfirmed: list[scheduler_pb2.Completion] = []
        self.lease_id = 0
        self.registrations = 0
        self._failed_calls = 0
        self.lease_ms = 0                 # the scheduler's, from the last registration
        self._last_status_log = 0.0
        self._connect()

    def _connect(self) -> None:
        self.channel = tls.channel(self.scheduler_address, self.tls_config,
                                   options=CHANNEL_OPTIONS,
                                   expect=self.tls_config.scheduler_identity)
        self.scheduler = scheduler_pb2_grpc.SchedulerStub(self.channel)

    async def _reconnect(self) -> None:
        log.warning("%s: %d failed calls to the scheduler in a row; making its channel anew",
                    self.node_id, self._failed_calls)
        old = self.channel
        self._connect()
        with contextlib.suppress(Exception):
            await old.close()

    def complete(self, rid: str, engine: EngineRank, stage: CompletionStage, error: str = "",
                 suspect: str = "", final: bool = False) -> None:
        """Queue a completion; it rides on the next fetch. Any completion ends this
        node's part of the request (PREFILL_DONE on a PE; DECODE_DONE or FAILED)."""
        self.completions.append(scheduler_pb2.Completion(
            request_id=rid, engine_id=engine.engine_id, stage=int(stage),
            attempt=self.attempts.pop(rid, 0),
            error=error.encode()[:MAX_ERROR_BYTES].decode(errors="ignore"),
            suspect_engine_id=suspect, final=final))
        if self._polling and self._reporter is None:
            # The fetch in flight is a long poll the scheduler may hold for a second:
            # this completion goes at once, on a call of its own.
            self._reporter = asyncio.ensure_future(self._report_now())

    async def _report_now(self) -> None:
        """Deliver the queued completions (ReportCompletion; same rules and idempotence
        as on a fetch). Undelivered ones ride on the next fetch."""
        try:
            while self.completions and self.lease_id:
                done, self.completions = self.completions, []
                try:
                    r = await self.scheduler.ReportCompletion(
                        scheduler_pb2.ReportCompletionRequest(
                            group_id=self.node_id, lease_id=self.lease_id,
                            completions=done), timeout=5)
                except grpc.aio.AioRpcError:
                    self.completions[:0] = done
                    return
                self._settle(done, set(r.ignored_request_ids))
        finally:
            self._reporter = None

    async def run(self, stop: asyncio.Event) -> None:
        """Register, then fetch/report every interval until ``stop`` is set."""
        backoff = 0.05
        while not stop.is_set():
            try:
                if not self.available():
                    if self.lease_id:
                        await self._pause()
                    await asyncio.sleep(self.fetch_interval_s)
                    continue
                if not self.lease_id:
                    await self._register()
                await self._fetch_once()
                backoff, self._failed_calls = 0.05, 0
                await asyncio.sleep(self.fetch_interval_s)
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    log.warning("%s: lease lost (%s); registering again with what runs here",
                                self.node_id, e.details())
                    self.status(f"lease lost ({e.details()}); registering again")
                    self.lease_id = 0
                    continue
                why = await tls.explained(e, self.scheduler_address, self.tls_config,
                                          self.tls_config.scheduler_identity)
                log.warning("%s: scheduler %s: %s %s; retrying in %.2f s", self.node_id,
                            self.scheduler_address, e.code().name, why, backoff)
                self.status(f"scheduler {self.scheduler_address}: {e.code().name}; "
                            f"{'retrying' if self.lease_id else 'not registered yet'}")
                if e.code() in _RETRIED:
                    self._failed_calls += 1
                    # A fetch unanswered within its deadline: the connection is suspect
                    # (one that died silently holds every call on it); a new one at once.
                    if self._failed_calls % RECONNECT_AFTER == 0 or \
                            e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                        await self._reconnect()
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 1.0)
            except (ConfigError, asyncio.CancelledError):
                raise
            except Exception:  # a bug must not silently stop the group from serving
                log.exception("%s: leader step failed; retrying in %.2f s", self.node_id,
                              backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 1.0)

    def _claims(self) -> list[scheduler_pb2.RunningRequest]:
        """What this node still runs, and what it finished but has not reported."""
        out = [scheduler_pb2.RunningRequest(request_id=c.request_id, engine_id=c.engine_id,
                                            attempt=c.attempt, prefill_done=True)
               for c in self.completions
               if c.stage == scheduler_pb2.COMPLETION_STAGE_DECODE_DONE]
        seen = {c.request_id for c in out}
        for rid, e, prefill_done in self.path.claims():
            if rid not in seen:
                seen.add(rid)
                out.append(scheduler_pb2.RunningRequest(
                    request_id=rid, engine_id=e.engine_id, attempt=self.attempts.get(rid, 0),
                    prefill_done=prefill_done))
        return out

    async def _register(self) -> None:
        infos = [scheduler_pb2.EngineInfo(
            engine_id=e.engine_id, rank=e.rank, node_id=self.node_id,
            control_address=self.address,
            hbm_bytes=e.hbm.capacity * self.block_bytes if self.role == DECODE else 0)
            for e in self.ranks]
        claims = self._claims()
        r = await self.scheduler.RegisterGroup(scheduler_pb2.RegisterGroupRequest(
            group_id=self.node_id, role=_ROLE_PB[self.role], engines=infos,
            storage_read_bytes_per_s=self.storage_read_bytes_per_s, running=claims),
            timeout=5)
        if self.profile_name is not None and r.model_profile and \
                r.model_profile != self.profile_name:
            raise ConfigError(f"the scheduler plans with model profile {r.model_profile!r}, "
                              f"this node runs {self.profile_name!r}")
        self.lease_id = r.lease_id
        self.registrations += 1
        self._take_quota(r.compute_quota_ms)
        refused = set(r.cancelled_request_ids)
        kept = {c.request_id for c in claims} - refused
        # Completions of what was not kept name an attempt the scheduler gave up; a
        # DECODE_DONE among them may still be recorded (a lost answer): ask.
        moot = [c for c in self.completions if c.request_id not in kept]
        self.completions = [c for c in self.completions if c.request_id in kept]
        self._settle(moot, {c.request_id for c in moot})
        for rid in refused:
            self.attempts.pop(rid, None)
            self.cancel(rid)
        ms = self.fetch_interval_ms or r.fetch_interval_ms or 20
        self.fetch_interval_s = ms / 1000.0
        self.lease_ms = r.lease_ms
        log.info("%s: group registered (lease %d, fetch every %d ms); %d running requests "
                 "claimed, %d refused", self.node_id, r.lease_id, ms, len(claims), len(refused))
        self.status(f"registered with scheduler {self.scheduler_address}: lease {r.lease_id}, "
                    f"{len(self.ranks)} engine(s), {len(claims)} running requests claimed")

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
            # Idle (nothing running, nothing to report): a long poll the scheduler holds
            # until work moves, instead of a fetch every interval (an idle cluster's
            # CPU went to fetching nothing).
            idle = not busy and not self.attempts and not done and not self.unconfirmed
            self._polling = idle
            try:
                r = await self.scheduler.Fetch(scheduler_pb2.FetchRequest(
                    group_id=self.node_id, lease_id=self.lease_id,
                    engines=[self._status(e) for e in self.ranks], completions=done,
                    wait_ms=IDLE_WAIT_MS if idle else 0),
                    timeout=fetch_deadline_s(self.lease_ms, IDLE_WAIT_MS if idle else 0))
            finally:
                self._polling = False
        except grpc.aio.AioRpcError:
            self.completions[:0] = done     # reports are idempotent: resend next time
            raise
        self._settle(done, set(r.ignored_request_ids))
        self._take_quota(r.compute_quota_ms)
        for rid in r.cancelled_request_ids:
            self._drop(rid)
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
                self.complete(pb.request_id, e, CompletionStage.FAILED,
                              error=f"assignment refused: {err}", suspect=e.engine_id)
                continue
            self.path.assign(e, a)
        if self.unconfirmed:
            await self._confirm()

    def _take_quota(self, ms: int) -> None:
        if self.quota is not None and ms:
            self.quota(ms / 1000.0)

    def _settle(self, done: list[scheduler_pb2.Completion], ignored: set[str]) -> None:
        """Delivered completions: the recorded ones' results go to the sink; an ignored
        DECODE_DONE is asked about (:meth:`_confirm`), other ignored ones are dropped."""
        if self.results is None:
            return
        for c in done:
            if c.stage == scheduler_pb2.COMPLETION_STAGE_PREFILL_DONE:
                continue
            if c.request_id not in ignored:
                self.results.send_result(c.request_id, c.attempt)
            elif c.stage == scheduler_pb2.COMPLETION_STAGE_DECODE_DONE:
                self.unconfirmed.append(c)
            else:
                self.results.drop_result(c.request_id)

    async def _confirm(self) -> None:
        """GetResults for DECODE_DONEs the scheduler did not acknowledge: a result is sent
        only when the scheduler holds that request done at that attempt."""
        while self.unconfirmed:
            batch = self.unconfirmed[:RESULTS_PER_CALL]
            r = await self.scheduler.GetResults(scheduler_pb2.GetResultsRequest(
                request_ids=[c.request_id for c in batch]), timeout=5)
            del self.unconfirmed[:len(batch)]
            for c, res in zip(batch, r.results):
                if res.state in _RECORDED and res.attempt == c.attempt:
                    self.results.send_result(c.request_id, c.attempt)
                else:
                    self.results.drop_result(c.request_id)

    def _drop(self, rid: str) -> None:
        """The scheduler gave this node's attempt of ``rid`` up: drop it and anything
        pending of it (its completion, its result)."""
        self.attempts.pop(rid, None)
        self.cancel(rid)
        self.completions = [c for c in self.completions if c.request_id != rid]
        if self.results is not None:
            self.results.drop_result(rid)

    async def _pause(self) -> None:
        """The engine stopped answering: hand the group back (what it held is requeued
        at once, to run when an engine can take it) and drop this node's work; the run
        loop registers again once the engine is available."""
        log.warning("%s: the engine cannot take work; handing the group back until it "
                    "can", self.node_id)
        self.status("engine unavailable: group handed back")

        async def drop_all() -> None:
            for rid in self._in_flight():
                self._drop(rid)
        await self.shutdown(drop_all)

    async def shutdown(self, quiesce: Callable[[], Awaitable[None]]) -> None:
        """A graceful stop (the leader loop has ended): deliver pending completions (their
        results go to the sink), give the lease back (ReleaseGroup: the scheduler requeues
        what the group held at once and cancels it on the peers), then ``quiesce()`` the
        node's work. In that order, a peer learns of the hand-back from the scheduler as a
        cancel before this node stops the work it shares with it: it counts no failed
        attempt (stopping first failed the peer's prefill on an aborted load). Bounded;
        without a lease (or a scheduler) it only quiesces."""
        try:
            if self.lease_id and self.completions:
                done, self.completions = self.completions, []
                r = await self.scheduler.ReportCompletion(
                    scheduler_pb2.ReportCompletionRequest(
                        group_id=self.node_id, lease_id=self.lease_id, completions=done),
                    timeout=2)
                self._settle(done, set(r.ignored_request_ids))
                if self.unconfirmed:
                    await self._confirm()
        except grpc.aio.AioRpcError as e:
            log.warning("%s: pending completions not delivered at shutdown: %s %s",
                        self.node_id, e.code().name, e.details())
        if self.lease_id:
            try:
                r = await self.scheduler.ReleaseGroup(scheduler_pb2.ReleaseGroupRequest(
                    group_id=self.node_id, lease_id=self.lease_id), timeout=2)
                log.info("%s: lease %d released; %d requests handed back", self.node_id,
                         self.lease_id, r.requeued_requests)
                await asyncio.sleep(HANDBACK_GRACE_S)
            except grpc.aio.AioRpcError as e:
                log.warning("%s: lease %d not released (%s %s); its work waits out the "
                            "lease", self.node_id, self.lease_id, e.code().name, e.details())
            self.lease_id = 0
        await quiesce()

    async def close(self) -> None:
        await self.channel.close()
