"""The scheduler's RPC edge: gRPC servicers over the pure core, leases, metrics, serving.

Servicers are thin: protobuf -> core dataclasses -> :class:`Scheduler` -> protobuf, and
domain errors -> gRPC status codes (never error strings inside a response). HBM bytes
become tokens here, with the model profile, and nowhere else.

Durability: a handler that changed the core hands the core's journal events over
(:meth:`SchedulerService.commit`, with no await between the change, the hand-over and
building the answer), then awaits :meth:`SchedulerService.durable` before it answers:
everything journaled until then, by any handler, is on disk (group commit: the calls of
one loop turn share one transaction, :mod:`dualpath.scheduler.groupcommit`). So no
answer ever shows state that is not on disk. A journal that cannot be written stops the scheduler (fail-stop: every later call
is UNAVAILABLE and the daemon exits 1); its restart recovers the last committed state,
and callers retry.

Threads: everything runs on the asyncio loop that runs the server; the core is not
thread-safe and needs no lock because handlers never await while they touch it (an
answer is built before its durability wait). The Prometheus endpoint runs on its own
thread and reads only prometheus-client objects.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
from collections.abc import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from dualpath import clock as _clock
from dualpath import journald, rpc, tls
from dualpath import metrics as _metrics
from dualpath.errors import UsageError
from dualpath.kv.profiles import ModelProfile, get_profile
from dualpath.scheduler.admitted import payload_disagreement
from dualpath.scheduler.config import SchedulerConfig
from dualpath.scheduler.core import policy
from dualpath.scheduler.core.errors import Conflict, LeaseError, NotFound, PermissionDenied
from dualpath.scheduler.core.model import (
    Claim,
    Completion,
    CompletionStage,
    Engine,
    EngineReport,
    EngineSpec,
    Finished,
    Group,
    Outcome,
    Params,
    ReadSide,
    Request,
    RequestSpec,
    Role,
    Stage,
)
from dualpath.scheduler.core.scheduler import Scheduler
from dualpath.scheduler.groupcommit import GroupCommit
from dualpath.scheduler.journal import Batch, Journal, JournalError, open_scheduler
from dualpath.sdnotify import Notifier
from dualpath.stall import StallWatch
from dualpath.v1 import admin_pb2, admin_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

log = logging.getLogger("dualpath.scheduler")

ADMIN_PREFIX = "/dualpath.v1.Admin/"
SERVICE_NAMES = (
    scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name,
    admin_pb2.DESCRIPTOR.services_by_name["Admin"].full_name,
)

# Domain error -> status code; the first matching class wins (UsageError last: the base).
_STATUS = (
    (LeaseError, grpc.StatusCode.FAILED_PRECONDITION),
    (NotFound, grpc.StatusCode.NOT_FOUND),
    (Conflict, grpc.StatusCode.ALREADY_EXISTS),
    (PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
    (UsageError, grpc.StatusCode.INVALID_ARGUMENT),
)
_ERRORS = (*(cls for cls, _ in _STATUS), JournalError)

#: The longest an idle leader's fetch is held (FetchRequest.wait_ms).
MAX_FETCH_WAIT_MS = 2000
# gc thresholds once serving: young generations as Python's defaults; a full collection
# considered only every 100 gen-1 collections (default 10), i.e. every ~10 s at 6,000
# requests/s instead of every ~1 s (bench/scheduler.py: each walks all live requests).
GC_THRESHOLDS = (700, 10, 100)

_PATH_LABEL = {ReadSide.PREFILL: "pe_read", ReadSide.DECODE: "de_read",
               ReadSide.SPLIT: "split", ReadSide.NONE: "none"}
_ROLE_LABEL = {Role.PREFILL: "prefill", Role.DECODE: "decode"}
# The core's stage -> what a submitter is told (RequestState).
_STATE = {Stage.GLOBAL_QUEUE: scheduler_pb2.REQUEST_STATE_QUEUED,
          Stage.GROUP_QUEUE: scheduler_pb2.REQUEST_STATE_QUEUED,
          Stage.BACKOFF: scheduler_pb2.REQUEST_STATE_QUEUED,
          Stage.RECOVERING: scheduler_pb2.REQUEST_STATE_QUEUED,
          Stage.PREFILL_QUEUE: scheduler_pb2.REQUEST_STATE_ASSIGNED,
          Stage.PREFILLING: scheduler_pb2.REQUEST_STATE_ASSIGNED,
          Stage.DECODING: scheduler_pb2.REQUEST_STATE_PREFILL_DONE}
# Time to first token reaches a minute when storage is the bottleneck (tokens wait for reads).
TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
LIST_LIMIT = 1000
MAX_WAIT_MS = 60_000        # GetResults' long poll, at most


def params_from_config(cfg: SchedulerConfig, profile: ModelProfile | None = None) -> Params:
    """The core's constants from the config: α and β derived unless set (paper A.4)."""
    profile = profile or get_profile(cfg.model_profile)
    alpha = cfg.alpha_tokens or policy.derive_alpha(
        cfg.storage_read_bytes_per_s, profile.kv_bytes_per_token, cfg.alpha_window_s)
    beta = cfg.beta_tokens or policy.derive_beta(
        profile, cfg.beta_window_s, cfg.reference_context_tokens, cfg.reference_append_tokens)
    return Params(alpha_tokens=alpha, beta_tokens=beta, compute_quota_ms=cfg.compute_quota_ms,
                  split_read=cfg.split_read, split_align_tokens=profile.block_tokens,
                  split_min_saving_s=cfg.split_min_saving_ms / 1000.0,
                  lease_s=cfg.lease_ms / 1000.0,
                  max_assignments_per_fetch=cfg.max_assignments_per_fetch,
                  max_queued_requests=cfg.max_queued_requests,
                  context_tokens=profile.context_tokens, max_held_bytes=cfg.max_held_bytes,
                  max_payload_bytes=cfg.max_payload_bytes,
                  max_submit_requests=cfg.max_submit_requests,
                  default_read_tokens_per_s=cfg.storage_read_bytes_per_s
                  / profile.kv_bytes_per_token,
                  max_failed_attempts=cfg.max_failed_attempts,
                  max_lost_attempts=cfg.max_lost_attempts,
                  retry_backoff_s=cfg.retry_backoff_ms / 1000.0,
                  retry_backoff_max_s=cfg.retry_backoff_max_ms / 1000.0,
                  peer_avoid_s=cfg.peer_avoid_ms / 1000.0,
                  finished_requests_kept=cfg.finished_requests_kept)


class SchedulerMetrics:
    """The scheduler's Prometheus metrics. Counters follow the core's by delta at each
    :meth:`refresh`; the fetch histogram is observed inline."""

    def __init__(self, registry):
        m = _metrics
        self.queue = m.gauge(registry, "dualpath_scheduler_queue_requests",
                             "Requests waiting, by queue (global, DE group, prefill).",
                             ("queue",))
        self.running = m.gauge(registry, "dualpath_scheduler_running_requests",
                               "Requests on engines, by stage.", ("stage",))
        self.assignments = m.counter(registry, "dualpath_scheduler_assignments_total",
                                     "Complete (PE, DE, read side) assignments, by read path.",
                                     ("path",))
        self.placements = m.counter(registry, "dualpath_scheduler_decode_placements_total",
                                    "Requests placed on a DE (in-group phase).")
        self.submitted = m.counter(registry, "dualpath_scheduler_requests_submitted_total",
                                   "Requests accepted by SubmitRequest.")
        self.rejected = m.counter(registry, "dualpath_scheduler_requests_rejected_total",
                                  "Requests SubmitRequest rejected (invalid, too large, "
                                  "duplicate, queue full).")
        self.completed = m.counter(registry, "dualpath_scheduler_requests_completed_total",
                                   "Requests whose decode finished.")
        self.requeued = m.counter(registry, "dualpath_scheduler_requests_requeued_total",
                                  "Requests sent back to a queue head (lease loss, failure).")
        self.failed_attempts = m.counter(
            registry, "dualpath_scheduler_failed_attempts_total",
            "Attempts given up as failures (FAILED reports): the failure rate.")
        self.lost_attempts = m.counter(
            registry, "dualpath_scheduler_lost_attempts_total",
            "Attempts lost with a node whose lease lapsed (counted apart from failures).")
        self.failed = m.counter(registry, "dualpath_scheduler_requests_failed_total",
                                "Requests ended FAILED: their failure budget was spent.")
        self.cancelled = m.counter(registry, "dualpath_scheduler_requests_cancelled_total",
                                   "Requests cancelled by an operator.")
        self.journal_s = m.histogram(registry, "dualpath_scheduler_journal_commit_seconds",
                                     "Time to write one journal transaction (a group "
                                     "commit: the calls handed over meanwhile).")
        self.journal_calls = m.counter(registry, "dualpath_scheduler_journal_calls_total",
                                       "Calls whose journal rows were committed (divide "
                                       "by the commit count: calls per group commit).")
        self.tokens = m.gauge(registry, "dualpath_scheduler_tokens_in_flight",
                              "Sum of tok_e over the engines of up groups, by role.", ("role",))
        self.read_q = m.gauge(registry, "dualpath_scheduler_read_queue_tokens",
                              "Sum of read_q over the nodes of up groups, by role.", ("role",))
        self.groups = m.gauge(registry, "dualpath_scheduler_groups", "Engine groups, by state.",
                              ("state",))
        self.fetch_s = m.histogram(registry, "dualpath_scheduler_fetch_duration_seconds",
                                   "Time to serve one Fetch inside the scheduler, by role.",
                                   ("role",))
        self.loop_lag = m.histogram(registry, "dualpath_scheduler_event_loop_lag_seconds",
                                    "How late the event loop runs a timer (50 ms ticks): "
                                    "time no call could be served.")
        self.stuck = m.gauge(registry, "dualpath_scheduler_stuck_requests",
                             "Live requests whose stage has not changed for "
                             "scheduler.stuck_after_ms.")
        self.ttft = m.histogram(registry, "dualpath_scheduler_time_to_first_token_seconds",
                                "Submission to the PE's first PREFILL_DONE report (the "
                                "first token, as the scheduler hears of it).",
                                buckets=TTFT_BUCKETS_S)
        self.tpot = m.histogram(registry, "dualpath_scheduler_time_per_output_token_seconds",
                                "PREFILL_DONE to DECODE_DONE over max_new_tokens - 1, as "
                                "the scheduler hears of them (an early stop at EOS reads "
                                "low).")
        self._latency = {"ttft": self.ttft, "tpot": self.tpot}
        self._fetch_s = {r: self.fetch_s.labels(lbl) for r, lbl in _ROLE_LABEL.items()}
        self._assign = {s: self.assignments.labels(lbl) for s, lbl in _PATH_LABEL.items()}
        for q in ("global", "group", "prefill", "backoff", "recovering"):
            self.queue.labels(q)
        for s in ("prefilling", "decoding"):
            self.running.labels(s)
        for lbl in _ROLE_LABEL.values():
            self.tokens.labels(lbl)
            self.read_q.labels(lbl)
        for s in ("up", "down"):
            self.groups.labels(s)
        self._seen = {"submitted": 0, "completed": 0, "requeued": 0, "placed": 0,
                      "rejected": 0, "failed_attempts": 0, "lost_attempts": 0, "failed": 0,
                      "cancelled": 0}
        self._seen_paths = {s: 0 for s in _PATH_LABEL}

    def observe_fetch(self, role: Role, seconds: float) -> None:
        self._fetch_s[role].observe(seconds)

    def refresh(self, s: Scheduler, now: float, stuck_after_s: float) -> None:
        """Bring gauges and counters up to date with the core (O(engines + requests))."""
        c = s.counters
        while s.latencies:
            kind, seconds = s.latencies.popleft()
            self._latency[kind].observe(seconds)
        self.stuck.set(sum(1 for r in s.requests.values() if now - r.since >= stuck_after_s))
        for name, value, metric in (("submitted", c.submitted, self.submitted),
                                    ("rejected", c.rejected, self.rejected),
                                    ("completed", c.completed, self.completed),
                                    ("requeued", c.requeued, self.requeued),
                                    ("placed", c.decode_assigned, self.placements),
                                    ("failed_attempts", c.failed_attempts,
                                     self.failed_attempts),
                                    ("lost_attempts", c.lost_attempts, self.lost_attempts),
                                    ("failed", c.failed, self.failed),
                                    ("cancelled", c.cancelled, self.cancelled)):
            metric.inc(value - self._seen[name])
            self._seen[name] = value
        for side, child in self._assign.items():
            child.inc(c.by_read_side[side] - self._seen_paths[side])
            self._seen_paths[side] = c.by_read_side[side]
        stages = s.stage_counts()
        self.queue.labels("global").set(stages[Stage.GLOBAL_QUEUE])
        self.queue.labels("group").set(stages[Stage.GROUP_QUEUE])
        self.queue.labels("prefill").set(stages[Stage.PREFILL_QUEUE])
        self.queue.labels("backoff").set(stages[Stage.BACKOFF])
        self.queue.labels("recovering").set(stages[Stage.RECOVERING])
        self.running.labels("prefilling").set(stages[Stage.PREFILLING])
        self.running.labels("decoding").set(stages[Stage.DECODING])
        up = [g for g in s.groups.values() if g.up]
        self.groups.labels("up").set(len(up))
        self.groups.labels("down").set(len(s.groups) - len(up))
        for role, lbl in _ROLE_LABEL.items():
            mine = [g for g in up if g.role is role]
            self.tokens.labels(lbl).set(sum(g.total_tok - g.private_tokens for g in mine))
            nodes = {e.node.node_id: e.node.read_q for g in mine for e in g.engines}
            self.read_q.labels(lbl).set(sum(nodes.values()))


class Pulse:
    """Whoever waits is woken by the next :meth:`fire` (or its timeout); a fire with no
    waiter is not remembered. One event loop."""

    def __init__(self):
        self._event: asyncio.Event | None = None

    def fire(self) -> None:
        if self._event is not None:
            self._event.set()
            self._event = None

    async def wait(self, timeout_s: float) -> None:
        if self._event is None:
            self._event = asyncio.Event()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._event.wait(), timeout_s)


class SchedulerService:
    """The scheduler as the servicers see it: the core plus the model profile (for byte
    <-> token conversion), the clock, the journal, metrics and the lease sweeper.
    Loop-owned. With ``config.journal_file`` it opens the journal and recovers what it
    recorded (``recovered``: live requests, ended ones)."""

    def __init__(self, config: SchedulerConfig | None = None, *,
                 clock: Callable[[], float] = _clock.now, registry=None,
                 trust_domain: str = "dualpath"):
        self.config = config or SchedulerConfig()
        self.trust_domain = trust_domain   # whose certificate identities name callers
        self.profile = get_profile(self.config.model_profile)
        self.kv_bytes_per_token = self.profile.kv_bytes_per_token
        self.clock = clock
        cfg = self.config
        self.journal = Journal(cfg.journal_file, cfg.journal_sync) if cfg.journal_file \
            else None
        self.writer: GroupCommit | None = None    # made by the first commit
        try:
            self.core: Scheduler = open_scheduler(params_from_config(cfg, self.profile),
                                                  self.journal, clock(),
                                                  payload_check=payload_disagreement)
        except BaseException:
            self.close()
            raise
        self.recovered = (len(self.core.requests), len(self.core.finished))
        self.registry = registry if registry is not None else _metrics.new_registry()
        self.metrics = SchedulerMetrics(self.registry)
        self._sweeper: asyncio.Task | None = None
        self.failed: JournalError | None = None   # set once: fail-stop
        self.on_fatal: Callable[[], None] | None = None
        self._ended_count = self._ended_total()
        self._ended = Pulse()           # some request ended (GetResults' long polls)
        self._changed = Pulse()         # work moved (idle leaders' long-poll fetches)

    def close(self) -> None:
        """Write what was handed to the journal and close it (idempotent)."""
        if self.writer is not None:
            self.writer.close()
        if self.journal is not None:
            self.journal.close()

    # -------------------------------------------------------- durability

    def commit(self) -> None:
        """Hand what the last core calls journaled over to the group commit (written at
        the start of the next loop turn; answers await :meth:`durable`), wake long polls
        when requests ended, and log the ones that ended FAILED. Raises JournalError once
        the journal has failed."""
        core = self.core
        events = core.journal
        if events:
            try:
                batch = Batch(events)
            finally:
                events.clear()
            if self.failed is not None:
                raise self.failed
            if self.writer is None:
                self.writer = GroupCommit(self.journal, asyncio.get_running_loop(),  # type: ignore[arg-type]
                                          on_error=self._fatal,
                                          on_commit=self._committed)
            self.writer.submit(batch)
        for f in core.newly_failed:
            log.warning("request %s failed after %d failed attempts: %s", f.request_id,
                        f.failures, f.error)
        core.newly_failed.clear()
        ended = self._ended_total()
        if ended != self._ended_count:
            self._ended_count = ended
            self._ended.fire()

    async def durable(self, context: grpc.aio.ServicerContext | None = None) -> None:
        """Until everything journaled so far is on disk (every answer waits for it);
        with ``context``, a failed journal aborts the call UNAVAILABLE."""
        if self.writer is None:
            return
        try:
            await self.writer.durable()
        except JournalError as e:
            if context is None:
                raise
            await _abort(context, e)

    def _committed(self, seconds: float, calls: int) -> None:
        self.metrics.journal_s.observe(seconds)
        self.metrics.journal_calls.inc(calls)

    def _ended_total(self) -> int:
        c = self.core.counters
        return c.completed + c.failed + c.cancelled

    def _fatal(self, e: JournalError) -> None:
        if self.failed is None:
            self.failed = e
            log.critical("%s; the scheduler stops (what it acknowledged is on disk; a "
                         "restart recovers it)", e)
            if self.on_fatal is not None:
                self.on_fatal()

    def changed(self) -> None:
        """Work moved (submitted, assigned, requeued, cancelled, a group came or went):
        wake the leaders' long-polling fetches."""
        self._changed.fire()

    async def wait_changed(self, timeout_s: float) -> None:
        """Until :meth:`changed` (or ``timeout_s``)."""
        await self._changed.wait(timeout_s)

    def fetch_wait_s(self, wait_ms: int) -> float:
        """How long an idle fetch asking ``wait_ms`` may be held: within a third of the
        lease (the fetch renews it) and until the next backoff ends (nothing else makes a
        request eligible without an event)."""
        s = min(wait_ms, MAX_FETCH_WAIT_MS, self.config.lease_ms // 3) / 1000.0
        due = self.core.next_due()
        if due is not None:
            s = min(s, max(0.0, due - self.clock()))
        return s

    async def wait_ended(self, timeout_s: float) -> None:
        """Until some request ends (or ``timeout_s``)."""
        await self._ended.wait(timeout_s)

    def result(self, rid: str) -> scheduler_pb2.RequestResult:
        x = self.core.lookup(rid)
        if x is None:
            return scheduler_pb2.RequestResult(request_id=rid,
                                               state=scheduler_pb2.REQUEST_STATE_UNKNOWN)
        if isinstance(x, Finished):
            state = scheduler_pb2.REQUEST_STATE_REPORTED if x.reported else int(x.outcome)
            return scheduler_pb2.RequestResult(request_id=rid, state=state,
                                               attempt=x.attempt,
                                               failed_attempts=x.failures, error=x.error,
                                               final=x.final)
        return scheduler_pb2.RequestResult(request_id=rid, state=_STATE[x.stage],
                                           attempt=x.attempt, failed_attempts=x.failures,
                                           error=x.error)

    # -------------------------------------------------------- leases and metrics

    def housekeeping(self) -> list[Group]:
        """Expire late groups, end due backoffs and the recovery hold, write the journal
        and refresh the metrics; returns the groups marked down."""
        if self.failed is not None:
            return []
        recovering = len(self.core.recovering)
        queued = len(self.core.global_queue)
        late = self.core.expire(self.clock())
        if late or len(self.core.global_queue) != queued:
            self.changed()
        for g in late:
            log.warning("group %s (%s) missed its lease; marked down, its unfinished "
                        "requests requeued", g.group_id, _ROLE_LABEL[g.role])
        if recovering and not self.core.recovering:
            log.info("recovery hold over: %d recovered requests no engine claimed were "
                     "requeued with their next attempt", recovering)
        with contextlib.suppress(JournalError):
            self.commit()
        self.metrics.refresh(self.core, self.clock(), self.config.stuck_after_ms / 1000.0)
        return late

    def start_sweeper(self, period_s: float | None = None) -> None:
        """Housekeeping every ``period_s`` (default min(1 s, lease/4)); each wake-up
        measures how late the loop woke it (the event-loop lag histogram: GC pauses, slow
        handlers, a starved CPU all show up there). No tick in between: an idle scheduler
        wakes once a period."""
        period = period_s or min(1.0, self.core.params.lease_s / 4)

        async def sweep() -> None:
            loop = asyncio.get_running_loop()
            while True:
                t = loop.time()
                await asyncio.sleep(period)
                self.metrics.loop_lag.observe(max(0.0, loop.time() - t - period))
                self.housekeeping()

        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().create_task(sweep())

    async def stop_sweeper(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None

    # -------------------------------------------------------- conversions

    def tokens(self, nbytes: int) -> int:
        return nbytes // self.kv_bytes_per_token

    def engine_view(self, e: Engine) -> admin_pb2.EngineView:
        return admin_pb2.EngineView(
            engine_id=e.engine_id, group_id=e.group.group_id, node_id=e.node.node_id,
            role=int(e.role), rank=e.rank, unfinished_requests=e.seq,
            unfinished_tokens=e.tok, read_queue_tokens=e.node.read_q,
            free_hbm_bytes=e.free_hbm_tokens * self.kv_bytes_per_token, drained=e.drained,
            group_state=admin_pb2.GROUP_STATE_UP if e.group.up else admin_pb2.GROUP_STATE_DOWN,
            assigned_requests=e.assigned_total,
            node_read_bytes_total=e.node.read_tokens_total * self.kv_bytes_per_token,
            control_address=e.control_address)

    def params_pb(self) -> admin_pb2.Params:
        p = self.core.params
        return admin_pb2.Params(alpha_tokens=p.alpha_tokens, beta_tokens=p.beta_tokens,
                                compute_quota_ms=p.compute_quota_ms, split_read=p.split_read)


def _assignment(r: Request, with_pe: bool) -> scheduler_pb2.Assignment:
    de = r.de
    pe = r.pe if with_pe else None
    return scheduler_pb2.Assignment(
        request_id=r.request_id,
        prefill_engine_id=pe.engine_id if pe else "",
        decode_engine_id=de.engine_id,  # type: ignore[union-attr]
        read_side=int(r.read_side), prompt_tokens=r.prompt_tokens, hit_tokens=r.hit_tokens,
        max_new_tokens=r.max_new_tokens,
        prefill_read_tokens=r.prefill_read_tokens, decode_read_tokens=r.decode_read_tokens,
        prefill_control_address=pe.control_address if pe else "",
        decode_control_address=de.control_address,  # type: ignore[union-attr]
        payload=r.payload, attempt=r.attempt,
        decode_identity=de.group.owner,  # type: ignore[union-attr]
        submitter_identity=r.submitter)


def _completions(msgs) -> list[Completion]:
    try:
        return [Completion(c.request_id, c.engine_id, CompletionStage(c.stage), c.attempt,
                           c.error, c.suspect_engine_id, c.final) for c in msgs]
    except ValueError:
        raise UsageError("completion stage must be PREFILL_DONE, DECODE_DONE or "
                         "FAILED") from None


async def _abort(context: grpc.aio.ServicerContext, e: Exception) -> None:
    if isinstance(e, JournalError):
        await context.abort(grpc.StatusCode.UNAVAILABLE, f"scheduler stopping: {e}")
    for cls, code in _STATUS:
        if isinstance(e, cls):
            await context.abort(code, str(e))
    raise e


async def caller_identity(context: grpc.aio.ServicerContext, trust_domain: str,
                          roles: tuple[str, ...], what: str) -> str:
    """The identity a call acts as: "role/name" from its certificate over mutual TLS
    (PERMISSION_DENIED unless its role is one of ``roles``), "" over a plaintext
    listener (an explicit opt-in: no identities there)."""
    if not tls.is_secure(context):
        return ""
    ident = tls.peer_identity(context, trust_domain)
    if ident is None:
        await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                            f"{what}: the client certificate names no "
                            f"spiffe://{trust_domain}/<role>/<name> identity")
    if ident.role not in roles:
        await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                            f"{what} needs a {' or '.join(roles)} certificate; the caller "
                            f"is {ident}")
    return str(ident)


_LEADER = ("node",)
_SUBMITTER = ("client", "admin", "node")
async def _refuse_if_failed(svc: SchedulerService, context) -> None:
    if svc.failed is not None:
        await context.abort(grpc.StatusCode.UNAVAILABLE,
                            f"scheduler stopping: {svc.failed}")


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    """Leader calls need a node identity and act only on the caller's own group (the
    core checks the binding); submissions need any cluster identity."""

    def __init__(self, svc: SchedulerService):
        self.svc = svc

    async def RegisterGroup(self, request, context):
        svc = self.svc
        caller = await caller_identity(context, svc.trust_domain, _LEADER, "RegisterGroup")
        try:
            role = Role(request.role)
        except ValueError:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"group {request.group_id}: role must be PREFILL or DECODE")
        specs = [EngineSpec(e.engine_id, e.rank, e.node_id, e.control_address,
                            svc.tokens(e.hbm_bytes)) for e in request.engines]
        rate = request.storage_read_bytes_per_s / svc.kv_bytes_per_token
        claims = [Claim(c.request_id, c.engine_id, c.attempt, c.prefill_done)
                  for c in request.running]
        await _refuse_if_failed(svc, context)
        try:
            g = svc.core.register_group(request.group_id, role, specs, svc.clock(), rate,
                                        claims, owner=caller)
            cancelled = svc.core.take_cancelled(g)
            svc.commit()
            svc.changed()
        except _ERRORS as e:
            if isinstance(e, PermissionDenied):
                log.warning("RegisterGroup refused: %s", e)
            await _abort(context, e)
        refused = len(set(cancelled) & {c.request_id for c in claims})
        log.info("group %s registered by %s: %s, %d engines, lease %d; %d running requests "
                 "claimed, %d of them refused", g.group_id,
                 caller or "an unauthenticated caller", _ROLE_LABEL[role], len(g.engines),
                 g.lease_id, len(claims), refused)
        cfg = svc.config
        reply = scheduler_pb2.RegisterGroupResponse(
            lease_id=g.lease_id, lease_ms=cfg.lease_ms, fetch_interval_ms=cfg.fetch_interval_ms,
            compute_quota_ms=svc.core.params.compute_quota_ms,
            model_profile=svc.profile.name, cancelled_request_ids=cancelled)
        await svc.durable(context)
        return reply

    async def Fetch(self, request, context):
        svc = self.svc
        t0 = _clock.now()
        caller = await caller_identity(context, svc.trust_domain, _LEADER, "Fetch")
        kvb = svc.kv_bytes_per_token
        reports = [EngineReport(s.engine_id, s.unfinished_requests, s.unfinished_tokens,
                                s.read_queue_tokens, s.free_hbm_bytes // kvb)
                   for s in request.engines]
        accepted, ignored = 0, []
        await _refuse_if_failed(svc, context)
        try:
            now = svc.clock()
            if request.completions:
                accepted, ignored = svc.core.report(request.group_id, request.lease_id,
                                                    _completions(request.completions), now,
                                                    caller)
            res = svc.core.fetch(request.group_id, request.lease_id, reports, now,
                                 request.max_assignments, caller)
            svc.commit()
            if res.assignments or res.cancelled or accepted:
                svc.changed()
            elif request.wait_ms and not request.completions:
                wait = svc.fetch_wait_s(request.wait_ms)
                if wait > 0:
                    await svc.durable(context)
                    await svc.wait_changed(wait)
                    await _refuse_if_failed(svc, context)
                    res = svc.core.fetch(request.group_id, request.lease_id, reports,
                                         svc.clock(), request.max_assignments, caller)
                    svc.commit()
                    if res.assignments or res.cancelled:
                        svc.changed()
        except _ERRORS as e:
            with contextlib.suppress(JournalError):
                svc.commit()   # a lease found expired gave its requests back
            await _abort(context, e)
        with_pe = res.role is Role.PREFILL
        reply = scheduler_pb2.FetchResponse(
            assignments=[_assignment(r, with_pe) for r in res.assignments],
            cancelled_request_ids=res.cancelled,
            compute_quota_ms=svc.core.params.compute_quota_ms,
            ignored_request_ids=ignored)
        await svc.durable(context)
        svc.metrics.observe_fetch(res.role, _clock.now() - t0)
        return reply

    async def ReportCompletion(self, request, context):
        svc = self.svc
        caller = await caller_identity(context, svc.trust_domain, _LEADER, "ReportCompletion")
        await _refuse_if_failed(svc, context)
        try:
            accepted, ignored = svc.core.report(request.group_id, request.lease_id,
                                                _completions(request.completions), svc.clock(),
                                                caller)
            svc.commit()
            if accepted:
                svc.changed()
        except _ERRORS as e:
            with contextlib.suppress(JournalError):
                svc.commit()
            await _abort(context, e)
        await svc.durable(context)
        return scheduler_pb2.ReportCompletionResponse(accepted=accepted,
                                                      ignored_request_ids=ignored)

    async def ReleaseGroup(self, request, context):
        svc = self.svc
        caller = await caller_identity(context, svc.trust_domain, _LEADER, "ReleaseGroup")
        await _refuse_if_failed(svc, context)
        try:
            n = svc.core.release_group(request.group_id, request.lease_id, svc.clock(),
                                       caller)
            svc.commit()
            svc.changed()
        except _ERRORS as e:
            await _abort(context, e)
        if n or request.group_id in svc.core.groups:
            log.info("group %s released lease %d; %d requests handed back", request.group_id,
                     request.lease_id, n)
        await svc.durable(context)
        return scheduler_pb2.ReleaseGroupResponse(requeued_requests=n)

    async def SubmitRequest(self, request, context):
        svc = self.svc
        core = svc.core
        caller = await caller_identity(context, svc.trust_domain, _SUBMITTER,
                                       "SubmitRequest")
        specs = [RequestSpec(r.prompt_tokens, r.hit_tokens, r.max_new_tokens, r.request_id,
                             r.payload, caller) for r in request.requests]
        await _refuse_if_failed(svc, context)
        try:
            out = core.submit(specs, svc.clock())
            svc.commit()
            if out.ids:
                svc.changed()
        except _ERRORS as e:
            await _abort(context, e)
        reply = scheduler_pb2.SubmitRequestResponse(
            request_ids=out.ids, queued_requests=core.queued_requests(),
            rejected=[scheduler_pb2.RejectedRequest(index=x.index, request_id=x.request_id,
                                                    reason=int(x.reason), detail=x.detail)
                      for x in out.rejected],
            resubmitted_request_ids=out.resubmitted,
            waiting_for_engines=core.waiting_for_engines())
        await svc.durable(context)
        return reply

    async def WithdrawRequests(self, request, context):
        svc = self.svc
        caller = await caller_identity(context, svc.trust_domain, _SUBMITTER,
                                       "WithdrawRequests")
        await _refuse_if_failed(svc, context)
        ids = list(request.request_ids)
        if len(ids) > svc.core.params.max_submit_requests:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"{len(ids)} request ids in one WithdrawRequests; at most "
                                f"{svc.core.params.max_submit_requests}")
        try:
            ended = svc.core.cancel(ids, svc.clock(), submitter=caller)
            svc.commit()
            svc.changed()
        except _ERRORS as e:
            await _abort(context, e)
        gone = [rid for rid, x in zip(ids, ended, strict=True) if x is not None]
        if gone:
            log.info("%s withdrew %d requests: %s", caller or "a plaintext client", len(gone),
                     ", ".join(gone[:20]))
        await svc.durable(context)
        return scheduler_pb2.WithdrawRequestsResponse(withdrawn_request_ids=gone)

    async def GetResults(self, request, context):
        svc = self.svc
        await caller_identity(context, svc.trust_domain, _SUBMITTER, "GetResults")
        await _refuse_if_failed(svc, context)
        n = len(request.request_ids) + len(request.acknowledged_request_ids)
        if n > svc.core.params.max_submit_requests:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"{n} request ids in one GetResults; at most "
                                f"{svc.core.params.max_submit_requests} "
                                "(scheduler.max_submit_requests)")
        if request.acknowledged_request_ids:
            svc.core.acknowledge(list(request.acknowledged_request_ids))
            try:
                svc.commit()
            except JournalError as e:
                await _abort(context, e)
        ids = list(request.request_ids)
        results = [svc.result(rid) for rid in ids]
        if request.wait_ms and ids and not any(_ended(x) for x in results):
            await svc.wait_ended(min(request.wait_ms, MAX_WAIT_MS) / 1000.0)
            await _refuse_if_failed(svc, context)
            results = [svc.result(rid) for rid in ids]
        await svc.durable(context)    # an end it shows is on disk first
        return scheduler_pb2.GetResultsResponse(results=results)


def _ended(x: scheduler_pb2.RequestResult) -> bool:
    return x.state >= scheduler_pb2.REQUEST_STATE_DECODE_DONE or \
        x.state == scheduler_pb2.REQUEST_STATE_UNKNOWN


class AdminServicer(admin_pb2_grpc.AdminServicer):
    def __init__(self, svc: SchedulerService):
        self.svc = svc

    async def ListEngines(self, request, context):
        svc = self.svc
        engines = sorted(svc.core.engines.values(),
                         key=lambda e: (e.group.group_id, e.rank))
        return admin_pb2.ListEnginesResponse(engines=[svc.engine_view(e) for e in engines])

    async def ListGroups(self, request, context):
        svc = self.svc
        now = svc.clock()
        views = []
        for g in sorted(svc.core.groups.values(), key=lambda g: g.group_id):
            views.append(admin_pb2.GroupView(
                group_id=g.group_id, role=int(g.role),
                state=admin_pb2.GROUP_STATE_UP if g.up else admin_pb2.GROUP_STATE_DOWN,
                engines=len(g.engines), unfinished_tokens=g.tok_sum,
                private_queue_requests=len(g.private_queue),
                ms_since_fetch=max(0, int((now - g.last_fetch) * 1000)), lease_id=g.lease_id))
        return admin_pb2.ListGroupsResponse(groups=views)

    async def Stats(self, request, context):
        svc = self.svc
        core = svc.core
        stages = core.stage_counts()
        c = core.counters
        up = sum(1 for g in core.groups.values() if g.up)
        return admin_pb2.StatsResponse(
            params=svc.params_pb(),
            global_queue_requests=stages[Stage.GLOBAL_QUEUE],
            group_queue_requests=stages[Stage.GROUP_QUEUE],
            prefill_queue_requests=stages[Stage.PREFILL_QUEUE],
            prefilling_requests=stages[Stage.PREFILLING],
            decoding_requests=stages[Stage.DECODING],
            submitted_requests_total=c.submitted, completed_requests_total=c.completed,
            requeued_requests_total=c.requeued,
            assignments_prefill_read_total=c.by_read_side[ReadSide.PREFILL],
            assignments_decode_read_total=c.by_read_side[ReadSide.DECODE],
            assignments_split_total=c.by_read_side[ReadSide.SPLIT],
            assignments_no_read_total=c.by_read_side[ReadSide.NONE],
            groups_up=up, groups_down=len(core.groups) - up, model_profile=svc.profile.name,
            backoff_requests=stages[Stage.BACKOFF], recovering_requests=stages[Stage.RECOVERING],
            failed_attempts_total=c.failed_attempts, failed_requests_total=c.failed,
            lost_attempts_total=c.lost_attempts,
            cancelled_requests_total=c.cancelled, journal=svc.journal is not None)

    async def Drain(self, request, context):
        svc = self.svc
        try:
            e = svc.core.drain(request.engine_id, request.undo)
        except _ERRORS as err:
            await _abort(context, err)
        svc.changed()
        log.info("engine %s %s", e.engine_id, "undrained" if request.undo else "drained")
        return admin_pb2.DrainResponse(engine=svc.engine_view(e))

    async def SetParams(self, request, context):
        svc = self.svc
        changes = {f: getattr(request, f) for f in
                   ("alpha_tokens", "beta_tokens", "compute_quota_ms", "split_read")
                   if request.HasField(f)}
        try:
            svc.core.set_params(**changes)
        except _ERRORS as e:
            await _abort(context, e)
        svc.changed()
        log.info("parameters changed: %s", changes)
        return admin_pb2.SetParamsResponse(params=svc.params_pb())

    async def ListRequests(self, request, context):
        svc = self.svc
        core = svc.core
        now = svc.clock()
        stuck_s = (request.stuck_after_ms or svc.config.stuck_after_ms) / 1000.0
        failed = [f for f in reversed(core.finished.values()) if f.outcome is Outcome.FAILED]
        live = sorted((r for r in core.requests.values()
                       if request.all or now - r.since >= stuck_s),
                      key=lambda r: r.since)
        views = [admin_pb2.RequestView(
            request_id=f.request_id, state=scheduler_pb2.REQUEST_STATE_FAILED, stage="failed",
            attempt=f.attempt, failed_attempts=f.failures, error=f.error,
            ms_in_stage=int(max(0.0, now - f.finished_at) * 1000)) for f in failed]
        views += [admin_pb2.RequestView(
            request_id=r.request_id, state=_STATE[r.stage], stage=r.stage.name.lower(),
            attempt=r.attempt, failed_attempts=r.failures, error=r.error,
            ms_in_stage=int(max(0.0, now - r.since) * 1000),
            prefill_engine_id=r.pe.engine_id if r.pe and r.stage is Stage.PREFILLING else "",
            decode_engine_id=r.de.engine_id if r.de else "") for r in live]
        return admin_pb2.ListRequestsResponse(requests=views[:request.limit or LIST_LIMIT],
                                              matched=len(views))

    async def Cancel(self, request, context):
        svc = self.svc
        await _refuse_if_failed(svc, context)
        ids = list(request.request_ids)
        live = [rid for rid in ids if rid in svc.core.requests]
        try:
            svc.core.cancel(ids, svc.clock())
            svc.commit()
            svc.changed()
        except _ERRORS as e:
            await _abort(context, e)
        if live:
            log.info("cancelled %d requests: %s", len(live), ", ".join(live[:20]))
        reply = admin_pb2.CancelResponse(results=[svc.result(rid) for rid in ids])
        await svc.durable(context)
        return reply


def create_server(address: str, service: SchedulerService | None = None, *,
                  credentials: grpc.ServerCredentials | None = None,
                  admin_token: str | None = None,
                  limits=None) -> tuple[grpc.aio.Server, int]:
    """A grpc.aio server (not started) with the Scheduler, Admin, health and reflection
    services bound to ``address`` (port 0 = a free port; mutual TLS with
    ``credentials``, plaintext without; connection bounds ``limits``, a [grpc] section:
    dualpath.rpc.server_options); returns it and the port. Call from inside the
    event loop that will run it. ``service.dualpath_service`` is reachable as
    ``server.dualpath_service`` for tests."""
    svc = service or SchedulerService()
    server = grpc.aio.server(
        interceptors=[tls.AdminAuthInterceptor(admin_token, (ADMIN_PREFIX,),
                                               svc.trust_domain)],
        options=rpc.server_options(limits))
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(SchedulerServicer(svc), server)
    admin_pb2_grpc.add_AdminServicer_to_server(AdminServicer(svc), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (*SERVICE_NAMES, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    port = rpc.bind(server, address, "scheduler.listen", credentials)
    server.dualpath_service = svc  # type: ignore[attr-defined]
    server.dualpath_health = health_servicer  # type: ignore[attr-defined]
    return server, port


async def set_serving(server: grpc.aio.Server, serving: bool) -> None:
    status = (health_pb2.HealthCheckResponse.SERVING if serving
              else health_pb2.HealthCheckResponse.NOT_SERVING)
    h = server.dualpath_health  # type: ignore[attr-defined]
    for name in ("", *SERVICE_NAMES):
        await h.set(name, status)


def tune_gc() -> None:
    """Keep the collector's pauses off the fetch path: what exists once the server is up
    (modules, protobuf descriptors, grpc) moves to the permanent generation, so a full
    collection walks only live requests, and full collections run a tenth as often."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


async def serve(config: SchedulerConfig, tls_config: tls.TlsConfig, *,
                config_path: str | None = None,
                stop: asyncio.Event | None = None,
                limits=None,
                on_ready: Callable[[int, int | None], None] | None = None) -> None:
    """Run the scheduler until SIGTERM/SIGINT (or ``stop`` is set): bind, log how it is
    reachable, sweep leases, serve /metrics, then shut down gracefully."""
    creds = tls.server_credentials(tls_config)
    tls.check_own_identity(tls_config, tls_config.scheduler_identity,
                           "tls.scheduler_identity")
    token = (tls.read_token(config.admin_token_file, "scheduler.admin_token_file")
             if config.admin_token_file else None)
    svc = SchedulerService(config, trust_domain=tls_config.trust_domain)
    server, port = create_server(config.listen, svc, credentials=creds, admin_token=token,
                                 limits=limits)
    metrics_srv = _metrics.start_metrics_server(config.metrics_listen, svc.registry,
                                                 "scheduler.metrics_listen",
                                                 tls.metrics_context(tls_config))
    stop = stop or asyncio.Event()
    svc.on_fatal = stop.set
    notifier, watchdog = Notifier(), None     # systemd's Type=notify (deploy/*.service)
    # Where a blocked loop is blocked (its lag: dualpath_scheduler_event_loop_lag_seconds).
    stall = StallWatch("scheduler").start()
    journald.set_fields(DUALPATH_ROLE="scheduler")
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    try:
        if svc.journal is not None:
            live, ended = svc.recovered
            log.info("journal %s (sync %s): recovered %d unfinished requests (held %d ms "
                     "for the groups to claim what they still run) and %d ended ones",
                     svc.journal.path, svc.journal.sync, live, config.lease_ms, ended)
        else:
            log.warning("journal off (scheduler.journal_file unset): a restart loses every "
                        "queued and running request")
        await server.start()
        await set_serving(server, True)
        svc.start_sweeper()
        tune_gc()
        tls.log_mode(tls_config, "scheduler", log)
        p = svc.core.params
        host = config.listen.rpartition(":")[0]
        log.info("scheduler listening on %s:%d, %s, admin token %s; config %s; model %s, "
                 "alpha %d tokens, beta %d tokens, quota %d ms, split read %s (when it "
                 "saves %d ms), lease %d ms; metrics %s", host, port,
                 tls.mode(tls_config),
                 "set" if token else "not set (admin certificates only)",
                 config_path or "(defaults)", svc.profile.name, p.alpha_tokens, p.beta_tokens,
                 p.compute_quota_ms, p.split_read, config.split_min_saving_ms,
                 config.lease_ms,
                 metrics_srv.url if metrics_srv else "off")
        if on_ready is not None:
            on_ready(port, metrics_srv.port if metrics_srv else None)
        notifier.ready(f"serving on {host}:{port}, {tls.mode(tls_config)}; " + (
            f"journal {svc.journal.path}: {svc.recovered[0]} unfinished requests recovered"
            if svc.journal is not None else "journal off"))
        watchdog = asyncio.create_task(notifier.watchdog(), name="sd-watchdog")
        await stop.wait()
        notifier.stopping("stopping: draining calls (grace 5 s)")
        log.info("scheduler shutting down (grace 5 s)")
        await set_serving(server, False)
        await server.stop(5.0)
    finally:
        stall.close()
        if watchdog is not None:
            watchdog.cancel()
        notifier.close()
        await svc.stop_sweeper()
        svc.close()
        if metrics_srv is not None:
            metrics_srv.close()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.remove_signal_handler(sig)
    if svc.failed is not None:
        raise svc.failed
