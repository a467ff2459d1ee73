"""The scheduler's domain object: queues, groups, leases, attempts and the §6.1 policies.

Pure (no I/O, no clock: every call that needs time takes ``now`` in seconds) so that the
gRPC service, the simulator, the benchmark and the tests drive the same code. Not
thread-safe: one thread owns it (in the daemon, the asyncio loop).

Where each live request is (the invariant the tests check): exactly one of the global
queue, one DE group's private queue, the prefill queue, an engine (stages PREFILLING and
DECODING), the backoff area (BACKOFF) or the recovery hold (RECOVERING). A request leaves
the live books once: DECODE_DONE, its budget spent (FAILED) or a cancel (CANCELLED); a
:class:`Finished` record of it is kept (``finished_requests_kept`` of them, oldest
forgotten first) for its submitter and for idempotent resubmission.

Attempts (docs/reliability.md). An attempt starts when a DE is chosen and carries its
number in both assignments. It is given up by a FAILED report, by the lease of a group
holding it ending (lapsed, replaced or released), by a cancel, or by the recovery hold
ending unclaimed; then both sides are told to drop it (``pending_cancel``, delivered with
their group's next fetch) and the request goes back to the head of the global queue with
the next attempt number, in arrival order, ahead of newer work. A *failed* attempt
(a FAILED report) also counts against the budget (``max_failed_attempts``), waits a
jittered exponential backoff (BACKOFF), and avoids the groups blamed for
``peer_avoid_s`` unless they register again. An attempt *lost* with a group whose lease
lapsed (its node killed, frozen or cut off) is the node's fault, not the request's: it
counts against a budget of its own (``max_lost_attempts``, larger: a request that takes
its nodes down with it still ends) and goes straight back to the queue head. A graceful
release or a restart counts as neither. Completions that name another attempt are
ignored, so a re-execution can never finish a request twice.

Admission (docs/scheduler.md): each submitted request is admitted or rejected on its
own (INVALID, TOO_LARGE, DUPLICATE, QUEUE_FULL); the queue is bounded by requests and by
the bytes the live ones hold (``held_bytes``). A known id (live or remembered) with the
same content is accepted again without being enqueued twice (idempotent resubmission);
with other content it is rejected (DUPLICATE).

Identity: a group is bound to the identity that first registered it (``owner``, from
its certificate at the RPC edge; "" when the edge has none). Another identity can neither
register that group id, nor fetch, report or release for it; the same identity may (a
restarted node). The binding outlives the lease, not the scheduler process: after a
restart the first registrant of a group id owns it again. A node identity
("node/<name>") names what it registers: group ``<name>``, engines ``<name>/...`` on
node ``<name>`` (:func:`_check_named`), so no node can squat another's group or engine
ids before it registers.

Leases: every leader call renews its group's lease for ``params.lease_s``; a group whose
deadline passes is marked down (by ``expire`` or by its own late call).

Journal: with ``journaling`` on, every change that must survive a restart is appended to
:attr:`Scheduler.journal` as a plain tuple (see :mod:`dualpath.scheduler.journal`, which
writes them and rebuilds a Scheduler from them); the caller writes them before it answers.
"""

from __future__ import annotations

import heapq
import random
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any

from dualpath.errors import UsageError
from dualpath.scheduler.core import policy
from dualpath.scheduler.core.errors import (
    Conflict,
    LeaseError,
    NotFound,
    PermissionDenied,
    UnknownGroup,
)
from dualpath.scheduler.core.model import (
    MAX_ERROR_BYTES,
    MAX_GROUP_ENGINES,
    MAX_NAME_BYTES,
    MAX_REQUEST_ID_BYTES,
    REQUEST_FIXED_BYTES,
    Admission,
    Claim,
    Completion,
    CompletionStage,
    Engine,
    EngineReport,
    EngineSpec,
    FetchResult,
    Finished,
    Group,
    Node,
    Outcome,
    Params,
    ReadSide,
    Rejection,
    RejectReason,
    Request,
    RequestSpec,
    Role,
    Stage,
    backoff_s,
    spec_key,
    wire_bytes,
)

# Stages in which an attempt has started (a DE holds the request).
_STARTED = frozenset({Stage.PREFILL_QUEUE, Stage.PREFILLING, Stage.DECODING})
LATENCIES_KEPT = 65536     # Scheduler.latencies nobody took: the oldest go


def _clamped_hit(s: RequestSpec) -> int:
    """The last prompt token is always computed (its forward pass yields the first output
    token), so at most prompt_tokens - 1 are a hit."""
    return min(s.hit_tokens, s.prompt_tokens - 1)


class Requeue(Enum):
    """Why an attempt is given up (:meth:`Scheduler._requeue`)."""

    FAILED = "failed"            # a node reported it failed: the failure budget
    LOST = "lost"                # its node's lease lapsed: the lost budget
    HANDED_BACK = "handed back"  # its node released its group: no budget


@dataclass
class Counters:
    submitted: int = 0
    completed: int = 0
    rejected: int = 0
    requeued: int = 0
    fetches: int = 0
    decode_assigned: int = 0
    failed_attempts: int = 0          # attempts given up as failures (the failure rate)
    lost_attempts: int = 0            # attempts lost with a node whose lease lapsed
    failed: int = 0                   # requests ended FAILED (budget spent)
    cancelled: int = 0
    by_read_side: dict[ReadSide, int] = field(
        default_factory=lambda: {s: 0 for s in ReadSide if s is not ReadSide.UNSPECIFIED})


class Scheduler:
    """Owns every request from submission to its end. See the module docstring."""

    def __init__(self, params: Params, *, rng: random.Random | None = None,
                 journaling: bool = False,
                 payload_check: Callable[[RequestSpec], str | None] | None = None):
        params.validate()
        self.params = params
        # Why a request's payload disagrees with what it asks to be admitted (None: it
        # agrees); the service's is dualpath/scheduler/admitted.py. None: no check.
        self.payload_check = payload_check
        self.rng = rng or random.Random()
        self.global_queue: deque[Request] = deque()
        self.prefill_queue: deque[Request] = deque()
        self.groups: dict[str, Group] = {}
        self.engines: dict[str, Engine] = {}
        self.nodes: dict[str, Node] = {}
        self.requests: dict[str, Request] = {}
        self.finished: OrderedDict[str, Finished] = OrderedDict()
        self.counters = Counters()
        self.journal: list[tuple] | None = [] if journaling else None
        # Requests that ended FAILED since the caller last took them (one log line each).
        self.newly_failed: list[Finished] = []
        # Latencies as the reports show them, until the caller takes them (the metrics):
        # ("ttft", submission to the first PREFILL_DONE), ("tpot", that attempt's
        # PREFILL_DONE to DECODE_DONE per generated token after the first). Bounded.
        self.latencies: deque[tuple[str, float]] = deque(maxlen=LATENCIES_KEPT)
        self.backoff: dict[str, Request] = {}
        self._backoff_heap: list[tuple[float, int, Request]] = []
        self.recovering: dict[str, Request] = {}
        self.recover_until = 0.0
        self._next_seq = 0
        self._next_lease = 0
        self._finish_seq = 0
        self.held_bytes = 0   # live requests' bytes (ids, payloads, bookkeeping)
        self._prefilling = 0  # requests in stage PREFILLING, kept so stats are O(groups)
        self._decode_groups: list[Group] | None = None  # up DE groups with a usable engine
        self._shares: tuple[int, int] | None = None     # up (PE nodes, DE nodes)
        self._max_hbm: int | None = None                 # the largest up DE's HBM

    def _log(self, *event: Any) -> None:
        if self.journal is not None:
            self.journal.append(event)

    # ------------------------------------------------------------ registration

    def register_group(self, group_id: str, role: Role, specs: list[EngineSpec], now: float,
                       read_tokens_per_s: float = 0.0, claims: list[Claim] = (),
                       owner: str = "") -> Group:
        """Start a lease for a group. ``claims`` are the requests its engines still run:
        each one that matches what the scheduler holds (same engine or, after a restart,
        a recovered request, and the current attempt) is kept; the others are refused
        and listed in the new group's ``pending_cancel`` (for the registration answer).
        Re-registering an up group ends its old lease first, giving back what no claim
        kept. ``owner`` is the caller's identity; a group id stays bound to its first
        owner (PermissionDenied for another, before anything changes)."""
        if not group_id:
            raise UsageError("group_id must not be empty")
        _check_named(owner, group_id, specs)
        old = self.groups.get(group_id)
        if old is not None and old.owner != owner:
            raise PermissionDenied(f"group {group_id} is bound to {_who(old.owner)}; "
                                   f"{_who(owner)} cannot register it")
        if role not in (Role.PREFILL, Role.DECODE):
            raise UsageError(f"group {group_id}: role must be PREFILL or DECODE, got {role!r}")
        if not specs:
            raise UsageError(f"group {group_id}: a group needs at least one engine")
        if len(specs) > MAX_GROUP_ENGINES:
            raise UsageError(f"group {group_id[:MAX_NAME_BYTES]}: {len(specs)} engines; at "
                             f"most {MAX_GROUP_ENGINES}")
        for name in (group_id, *(x for sp in specs
                                 for x in (sp.engine_id, sp.node_id, sp.control_address))):
            if len(name.encode()) > MAX_NAME_BYTES:
                raise UsageError(f"group {group_id[:MAX_NAME_BYTES]}: a group, engine or node "
                                 f"id or control address of {len(name.encode())} bytes; at "
                                 f"most {MAX_NAME_BYTES}")
        ids = [s.engine_id for s in specs]
        ranks = sorted(s.rank for s in specs)
        if len(set(ids)) != len(ids) or "" in ids:
            raise UsageError(f"group {group_id}: engine ids must be unique and non-empty")
        if ranks != list(range(len(specs))):
            raise UsageError(f"group {group_id}: ranks must be 0..{len(specs) - 1}, got {ranks}")
        for s in specs:
            if not s.node_id:
                raise UsageError(f"group {group_id}: engine {s.engine_id} has no node_id")
            if role is Role.DECODE and s.hbm_tokens <= 0:
                raise UsageError(f"group {group_id}: decode engine {s.engine_id} reports "
                                 "no HBM")
            other = self.engines.get(s.engine_id)
            if other is not None and other.group.up and other.group.group_id != group_id:
                raise Conflict(f"engine {s.engine_id} belongs to group {other.group.group_id}")
        node_ids = {s.node_id for s in specs}
        for g in self.groups.values():
            if g.up and g.group_id != group_id:
                taken = node_ids & {e.node.node_id for e in g.engines}
                if taken:
                    raise Conflict(f"node {min(taken)} already belongs to group "
                                   f"{g.group_id} (all engines of a node are in one group)")
        kept: dict[str, Claim] = {}      # request id -> its claim, held by the old lease
        carried: list[str] = []
        if old is not None:
            if old.up:
                for c in claims:
                    r = self.requests.get(c.request_id)
                    if r is not None and r.attempt == c.attempt and (
                            (r.pe is not None and r.pe.group is old and r.stage is
                             Stage.PREFILLING and r.pe.engine_id == c.engine_id) or
                            (r.de is not None and r.de.group is old
                             and r.de.engine_id == c.engine_id)):
                        kept[c.request_id] = c
                self._mark_down(old, now=now, keep=set(kept),
                                error=f"group {group_id} registered again")
            carried = old.pending_cancel
            for e in old.engines:
                if self.engines.get(e.engine_id) is e:
                    del self.engines[e.engine_id]
        rate = read_tokens_per_s or self.params.default_read_tokens_per_s
        self._next_lease += 1
        self._log("lease", self._next_lease)
        g = Group(group_id, role, self._next_lease, now + self.params.lease_s, last_fetch=now,
                  owner=owner)
        for s in sorted(specs, key=lambda s: s.rank):
            node = self.nodes.get(s.node_id)
            if node is None:
                node = self.nodes[s.node_id] = Node(s.node_id, rate)
            node.read_tokens_per_s, node.read_q = rate, 0
            e = Engine(s.engine_id, g, node, s.rank, role, s.control_address, s.hbm_tokens,
                       free_hbm_tokens=s.hbm_tokens)
            g.engines.append(e)
            self.engines[e.engine_id] = e
        self.groups[group_id] = g
        self._topology_changed()
        g.pending_cancel = list(dict.fromkeys(carried))
        for c in claims:
            self._claim(g, c, kept, now)
        return g

    def _claim(self, g: Group, c: Claim, kept: dict[str, Claim], now: float) -> None:
        e = self.engines.get(c.engine_id)
        r = self.requests.get(c.request_id)
        if e is None or e.group is not g or r is None or r.attempt != c.attempt:
            g.pending_cancel.append(c.request_id)
            return
        if kept.get(c.request_id) is c:          # held by the old lease: re-point
            if r.pe is not None and r.pe.engine_id == c.engine_id and g.role is Role.PREFILL:
                r.pe = e
            elif r.de is not None and r.de.engine_id == c.engine_id:
                r.de, r.de_group = e, g
            return
        if r.stage is not Stage.RECOVERING:
            g.pending_cancel.append(c.request_id)
            return
        if g.role is Role.DECODE:
            if c.prefill_done:
                pe = r.claim_pe
                if pe is not None and pe.group.up:
                    pe.group.pending_cancel.append(r.request_id)   # its part is done
                self._adopt(r, None, e, Stage.DECODING, now)
                return
            r.claim_de = e
        else:
            r.claim_pe = e
        if r.claim_pe is not None and r.claim_de is not None:
            self._adopt(r, r.claim_pe, r.claim_de, Stage.PREFILLING, now)

    def _adopt(self, r: Request, pe: Engine | None, de: Engine, stage: Stage,
               now: float) -> None:
        """A recovered request claimed by its engines resumes where it was."""
        del self.recovering[r.request_id]
        r.pe, r.de, r.de_group, r.stage, r.since = pe, de, de.group, stage, now
        r.claim_pe = r.claim_de = None
        if stage is Stage.PREFILLING:
            self._prefilling += 1

    # ------------------------------------------------------------ requests

    def submit(self, specs: list[RequestSpec], now: float = 0.0) -> Admission:
        """Admit each request on its own, in order: a valid new one is enqueued at the
        tail of the global queue, a known id (live or remembered) with the same content
        is accepted again without being enqueued twice (idempotent resubmission, even
        when the queue is full), the others come back as rejections with a reason.
        Bounds: the model's context (whether or not a DE is up), the largest up DE's
        HBM, the request id and payload sizes, and the queue (requests waiting, bytes
        held). UsageError, nothing enqueued, for more than ``max_submit_requests`` in
        one call."""
        p = self.params
        if len(specs) > p.max_submit_requests:
            raise UsageError(f"{len(specs)} requests in one submit; at most "
                             f"{p.max_submit_requests} per call (max_submit_requests)")
        max_hbm = self._largest_hbm()
        # Every queued request is held, so fewer held than the bound needs no count
        # (queued_requests walks every DE group's queue: at 96 DE nodes, most of a
        # submit's time).
        queued = len(self.requests) if len(self.requests) + len(specs) < \
            p.max_queued_requests else self.queued_requests()   # or a bound above it
        exact: int | None = None
        seen: set[str] = set()
        adm = Admission([], [], [], [])
        for i, s in enumerate(specs):
            reason, detail = self._check_spec(s, max_hbm, seen)
            if reason is None and s.request_id:
                seen.add(s.request_id)
                have = self._spec_key_of(s.request_id)
                if have is not None:
                    if have == spec_key(s.prompt_tokens, _clamped_hit(s), s.max_new_tokens,
                                        s.payload):
                        adm.resubmitted.append(s.request_id)
                        adm.ids.append(s.request_id)
                        continue
                    reason, detail = RejectReason.DUPLICATE, (
                        f"request {s.request_id} is known with other content (prompt, hit, "
                        "max_new_tokens or payload)")
            if reason is None:
                reason, detail = self._check_size(s, max_hbm)
            wire = wire_bytes(s.request_id, s.payload)
            if reason is None and (queued >= p.max_queued_requests
                                   or self.held_bytes + wire + REQUEST_FIXED_BYTES
                                   > p.max_held_bytes):
                if exact is None:       # the walk once a call, and only when refusing
                    exact = self.queued_requests()
                reason, detail = RejectReason.QUEUE_FULL, (
                    f"{exact + len(adm.accepted)} requests wait, "
                    f"{self.held_bytes} bytes held (max_queued_"
                    f"requests {p.max_queued_requests}, max_held_bytes {p.max_held_bytes})")
            if reason is not None:
                adm.rejected.append(Rejection(i, s.request_id[:MAX_REQUEST_ID_BYTES], reason,
                                              detail[:160]))
                continue
            self._next_seq += 1
            rid = s.request_id or self._auto_id(self._next_seq)
            r = Request(rid, s.prompt_tokens, _clamped_hit(s), s.max_new_tokens, s.payload,
                        self._next_seq, since=now, submitted=now,
                        wire_bytes=wire if s.request_id else wire_bytes(rid, s.payload),
                        submitter=s.submitter)
            self.requests[rid] = r
            self.held_bytes += r.wire_bytes + REQUEST_FIXED_BYTES
            adm.accepted.append(r)
            adm.ids.append(rid)
            queued += 1
            self._log("new", r)
        self.global_queue.extend(adm.accepted)
        self.counters.submitted += len(adm.accepted)
        self.counters.rejected += len(adm.rejected)
        return adm

    def _check_spec(self, s: RequestSpec, max_hbm: int, seen: set[str]
                    ) -> tuple[RejectReason | None, str]:
        """What a request must satisfy before its id is looked up (INVALID, DUPLICATE
        within the call)."""
        p = self.params
        if not s.request_id.isprintable():
            # A control character (NUL, newline) in an id would split or forge the log
            # lines and journal records that name it.
            return RejectReason.INVALID, (f"request id {s.request_id[:32]!r}: only "
                                          "printable characters")
        name = s.request_id[:MAX_REQUEST_ID_BYTES] or "(unnamed)"
        if s.prompt_tokens <= 0 or s.hit_tokens < 0 or s.max_new_tokens < 0:
            return RejectReason.INVALID, (f"request {name}: prompt_tokens must be > 0, "
                                          "hit_tokens and max_new_tokens >= 0")
        if len(s.request_id.encode()) > MAX_REQUEST_ID_BYTES:
            return RejectReason.INVALID, (f"request id of {len(s.request_id.encode())} bytes;"
                                          f" at most {MAX_REQUEST_ID_BYTES}")
        if len(s.payload) > p.max_payload_bytes:
            return RejectReason.INVALID, (f"request {name}: payload of {len(s.payload)} "
                                          f"bytes; at most {p.max_payload_bytes}")
        if s.request_id and s.request_id in seen:
            return RejectReason.DUPLICATE, (f"request {name} appears more than once in "
                                            "this submission")
        if self.payload_check is not None:
            why = self.payload_check(s)
            if why is not None:
                return RejectReason.INVALID, f"request {name}: {why}"
        return None, ""

    def _check_size(self, s: RequestSpec, max_hbm: int) -> tuple[RejectReason | None, str]:
        """A new request's tokens against the model's context and the largest DE."""
        p = self.params
        name = s.request_id[:MAX_REQUEST_ID_BYTES] or "(unnamed)"
        need = s.prompt_tokens + s.max_new_tokens
        if need > p.context_tokens:
            return RejectReason.TOO_LARGE, (f"request {name}: {need} tokens; the model's "
                                            f"context is {p.context_tokens}")
        if max_hbm and need > max_hbm:
            return RejectReason.TOO_LARGE, (f"request {name} needs {need} tokens of HBM; "
                                            f"the largest decode engine has {max_hbm}")
        return None, ""

    def _spec_key(self, r: Request) -> tuple[int, int, int, int]:
        return spec_key(r.prompt_tokens, r.hit_tokens, r.max_new_tokens, r.payload)

    def _spec_key_of(self, rid: str) -> tuple[int, int, int, int] | None:
        r = self.requests.get(rid)
        if r is not None:
            return self._spec_key(r)
        f = self.finished.get(rid)
        return f.spec_key if f is not None else None

    def _auto_id(self, seq: int) -> str:
        rid = f"r-{seq}"
        n = 0
        while rid in self.requests or rid in self.finished:
            n += 1
            rid = f"r-{seq}.{n}"
        return rid

    def waiting_for_engines(self) -> bool:
        """No up group of one role has an undrained engine: submissions only queue."""
        roles = {e.role for e in self.engines.values() if e.group.up and not e.drained}
        return roles != {Role.PREFILL, Role.DECODE}

    # ------------------------------------------------------------ leader calls

    def fetch(self, group_id: str, lease_id: int, reports: list[EngineReport], now: float,
              limit: int = 0, caller: str = "") -> FetchResult:
        """A leader's fetch: record its engines' load, then run the policy of its role."""
        g = self._leased_group(group_id, lease_id, now, caller)
        engines = self.engines
        for rep in reports:
            e = engines.get(rep.engine_id)
            if e is None or e.group is not g:
                raise UsageError(f"engine {rep.engine_id} is not in group {group_id}")
            e.seq = rep.seq
            if rep.tok != e._tok:           # Engine.tok's setter, inline (hot: every fetch)
                g.tok_sum += rep.tok - e._tok
                e._tok = rep.tok
            e.node.read_q = rep.read_q
            e.free_hbm_tokens = rep.free_hbm_tokens
        self._timers(now)
        p = self.params
        limit = min(limit, p.max_assignments_per_fetch) if limit > 0 else \
            p.max_assignments_per_fetch
        self.counters.fetches += 1
        if g.role is Role.PREFILL:
            out = policy.assign_prefill(self.prefill_queue, g.engines, p, limit, g, now,
                                        self._role_shares() if p.split_read else (1, 1))
            self._prefilling += len(out)
            by_side = self.counters.by_read_side
            for r in out:
                by_side[r.read_side] += 1
                r.since = now
        else:
            if self.global_queue:
                policy.distribute_to_groups(self.global_queue, self._up_decode_groups(), now)
            out = policy.assign_in_group(g, p, limit)
            for r in out:
                r.since = now
            self.prefill_queue.extend(out)
            self.counters.decode_assigned += len(out)
        # Cancellations share the reply's byte budget; what does not fit waits for the next.
        room = p.max_fetch_reply_bytes - sum(r.wire_bytes for r in out)
        return FetchResult(out, self.take_cancelled(g, room), g.role)

    def take_cancelled(self, g: Group, room: int | None = None) -> list[str]:
        """The request ids ``g``'s engines must drop, once (fetch or registration answer),
        as many as fit ``room`` bytes of the reply (default: a whole reply's budget); the
        rest wait for the next fetch."""
        if room is None:
            room = self.params.max_fetch_reply_bytes
        cut = 0
        for rid in g.pending_cancel:
            room -= len(rid) + 8
            if room < 0:
                break
            cut += 1
        cancelled = g.pending_cancel[:cut]
        del g.pending_cancel[:cut]
        return cancelled

    def report(self, group_id: str, lease_id: int, completions: list[Completion],
               now: float, caller: str = "") -> tuple[int, list[str]]:
        """Completions from a leader: ``(accepted, ignored request ids)``. Unknown,
        finished or foreign requests, and other attempts than the current one, are
        ignored, so a retried report or a stale execution's is harmless."""
        g = self._leased_group(group_id, lease_id, now, caller)
        accepted = 0
        ignored: list[str] = []
        failed: list[tuple[Request, Completion]] = []
        for c in completions:
            r = self.requests.get(c.request_id)
            if r is None or (c.attempt and c.attempt != r.attempt):
                ignored.append(c.request_id)
                continue
            pe_here = r.pe is not None and r.pe.group is g and \
                r.pe.engine_id == c.engine_id and r.stage is Stage.PREFILLING
            de_here = r.de is not None and r.de.group is g and \
                r.de.engine_id == c.engine_id and r.stage in _STARTED
            if c.stage is CompletionStage.PREFILL_DONE and pe_here:
                r.stage = Stage.DECODING
                r.since = now
                self._prefilling -= 1
                if r.submitted is not None and r.prefilled is None:
                    self.latencies.append(("ttft", now - r.submitted))
                r.prefilled = now
            elif c.stage is CompletionStage.DECODE_DONE and de_here and \
                    r.stage is not Stage.PREFILL_QUEUE:
                if r.stage is Stage.PREFILLING:
                    self._prefilling -= 1
                elif r.prefilled is not None and r.max_new_tokens > 1:
                    self.latencies.append(("tpot", (now - r.prefilled) / (r.max_new_tokens - 1)))
                self._finish(r, Outcome.DECODE_DONE, now)
                self.counters.completed += 1
            elif c.stage is CompletionStage.FAILED and (pe_here or de_here):
                failed.append((r, c))
            else:
                ignored.append(c.request_id)
                continue
            accepted += 1
        for r, c in failed:   # one by one: each has its own reason and suspects
            why = c.error.encode()[:MAX_ERROR_BYTES].decode(errors="ignore")
            self._requeue([r], now, Requeue.FAILED, reporter=g,
                          error=why or f"{c.engine_id} reported a failure",
                          avoid=self._blamed(r, c), final=c.final)
        return accepted, ignored

    def _blamed(self, r: Request, c: Completion) -> list[Group]:
        """Groups a failed attempt avoids: the suspect's when it is one of the request's
        own engines (a reporter cannot steer work away from a group it has nothing to do
        with), else both sides'."""
        suspect = self.engines.get(c.suspect_engine_id) if c.suspect_engine_id else None
        if suspect is not None and (suspect is r.pe or suspect is r.de):
            return [suspect.group]
        return [e.group for e in (r.pe, r.de) if e is not None]

    def release_group(self, group_id: str, lease_id: int, now: float,
                      caller: str = "") -> int:
        """A leader shutting down gives its lease back: the group is marked down at once
        and what it held is requeued without counting as a failure. Idempotent: an
        unknown group or a lease that is not current changes nothing. Only the group's
        owner may release it (PermissionDenied). Returns how many requests it gave back."""
        g = self.groups.get(group_id)
        if g is None:
            return 0
        self._check_owner(g, caller)
        if not g.up or g.lease_id != lease_id:
            return 0
        return self._mark_down(g, now=now, error=f"group {group_id} released its lease")

    @staticmethod
    def _check_owner(g: Group, caller: str) -> None:
        if g.owner != caller:   # before the lease: a stranger learns nothing about it
            raise PermissionDenied(f"group {g.group_id} is bound to {_who(g.owner)}; "
                                   f"{_who(caller)} cannot act for it")

    def _leased_group(self, group_id: str, lease_id: int, now: float, caller: str) -> Group:
        g = self.groups.get(group_id)
        if g is None:
            raise UnknownGroup(f"group {group_id} is not registered (a restarted "
                               "scheduler knows no groups); register again")
        self._check_owner(g, caller)
        if not g.up or g.lease_id != lease_id:
            raise LeaseError(f"group {group_id}: lease {lease_id} is not current "
                             "(expired, replaced or released); register again")
        if now > g.deadline:
            self._mark_down(g, now=now, lost=True)
            raise LeaseError(f"group {group_id}: lease {lease_id} expired "
                             f"{now - g.deadline:.3f} s ago; register again")
        g.deadline = now + self.params.lease_s
        g.last_fetch = now
        return g

    # ------------------------------------------------------------ leases and timers

    def expire(self, now: float) -> list[Group]:
        """Mark down every up group whose lease deadline has passed (returns them); end
        backoffs that are due and the recovery hold once it is over."""
        late = [g for g in self.groups.values() if g.up and now > g.deadline]
        if late:
            self._mark_down(*late, now=now, lost=True)
        self._timers(now)
        return late

    def next_due(self) -> float | None:
        """When the earliest backoff ends (None: none waits)."""
        heap = self._backoff_heap
        while heap and not (heap[0][2].stage is Stage.BACKOFF
                            and heap[0][2].not_before == heap[0][0]):
            heapq.heappop(heap)              # a stale entry (cancelled, re-queued)
        return heap[0][0] if heap else None

    def _timers(self, now: float) -> None:
        heap = self._backoff_heap
        if heap and heap[0][0] <= now:
            due = []
            while heap and heap[0][0] <= now:
                t, _, r = heapq.heappop(heap)
                if r.stage is Stage.BACKOFF and r.not_before == t:
                    due.append(r)
                    del self.backoff[r.request_id]
            if due:
                due.sort(key=lambda r: r.seq)
                for r in due:
                    r.stage, r.since = Stage.GLOBAL_QUEUE, now
                self.global_queue.extendleft(reversed(due))
        if self.recovering and now >= self.recover_until:
            left = sorted(self.recovering.values(), key=lambda r: r.seq)
            self.recovering.clear()
            for r in left:
                for e in (r.claim_pe, r.claim_de):
                    if e is not None and e.group.up:
                        e.group.pending_cancel.append(r.request_id)
                r.claim_pe = r.claim_de = None
                r.stage, r.since = Stage.GLOBAL_QUEUE, now
                r.attempt += 1    # fences any execution of the old attempt still running
                self._log("attempt", r)
            self.global_queue.extendleft(reversed(left))

    def _mark_down(self, *groups: Group, now: float = 0.0, keep: set[str] = frozenset(),
                   lost: bool = False, error: str = "") -> int:
        """Take groups out of service and give up what they held (all groups together so
        that the requeued requests keep their arrival order), except the ``keep`` ids;
        ``lost``: their leases lapsed, and the attempts count as lost. Returns how many
        requests were given back."""
        down = set(groups)
        for g in groups:
            g.up = False
            g.pending_cancel.clear()
        self._topology_changed()
        held = [r for r in self.requests.values() if r.request_id not in keep and (
            r.de_group in down or (r.stage is Stage.PREFILLING and r.pe.group in down))]  # type: ignore[union-attr]
        for g in groups:
            g.private_queue.clear()
            g.private_tokens = 0
        for r in self.recovering.values():
            if r.claim_pe is not None and r.claim_pe.group in down:
                r.claim_pe = None
            if r.claim_de is not None and r.claim_de.group in down:
                r.claim_de = None
        if held:
            names = ", ".join(sorted(g.group_id for g in groups))
            self._requeue(held, now, Requeue.LOST if lost else Requeue.HANDED_BACK,
                          error=error or f"group {names} lost its lease")
        return len(held)

    def _requeue(self, reqs: list[Request], now: float, why: Requeue, *,
                 reporter: Group | None = None, error: str = "",
                 avoid: list[Group] = (), final: bool = False) -> None:
        """Give up the current attempt of each request (``why``) and send it to the head
        of the global queue, in arrival order; the other side (not ``reporter``) is told
        to drop it. A failed attempt counts against the budget (ending FAILED when it is spent),
        avoids the ``avoid`` groups and waits out its backoff first; a ``final`` one
        (no attempt can succeed) ends it FAILED at once. A ``lost`` one (its node's
        lease lapsed) counts against the lost budget only; one handed back (its node
        released its group) against none."""
        failed, lost = why is Requeue.FAILED, why is Requeue.LOST
        reqs.sort(key=lambda r: r.seq)
        p = self.params
        ids = {id(r) for r in reqs}
        if any(r.stage is Stage.PREFILL_QUEUE for r in reqs):
            self.prefill_queue = deque(r for r in self.prefill_queue if id(r) not in ids)
        back: list[Request] = []
        for r in reqs:
            st = r.stage
            if st is Stage.GROUP_QUEUE and r.de_group is not None and r.de_group.up:
                r.de_group.private_queue.remove(r)
                r.de_group.private_tokens -= r.prompt_tokens
            started = st in _STARTED
            if st is Stage.PREFILLING:
                self._prefilling -= 1
            if started:
                # A PE whose prefill is done holds nothing of it any more.
                for e in (r.pe if st is Stage.PREFILLING else None, r.de):
                    if e is not None and e.group.up and e.group is not reporter:
                        e.group.pending_cancel.append(r.request_id)
            r.de_group = r.de = r.pe = None
            r.read_side = ReadSide.UNSPECIFIED
            r.prefill_read_tokens = r.decode_read_tokens = 0
            r.since = now
            if failed and started:
                r.failures += 1
                r.error = error
                self.counters.failed_attempts += 1
                if final or r.failures >= p.max_failed_attempts:
                    self._finish(r, Outcome.FAILED, now, error, final)   # ends with it
                    continue
            elif lost and started:
                r.lost += 1
                r.error = error
                self.counters.lost_attempts += 1
                if r.lost >= p.max_lost_attempts:
                    self._finish(r, Outcome.FAILED, now, f"{error} (attempt lost with its "
                                 f"node {r.lost} times: max_lost_attempts)")
                    continue
            if started:
                r.attempt += 1
                self._log("attempt", r)
            if failed and started:
                if p.peer_avoid_s > 0 and avoid:
                    if r.avoid is None:
                        r.avoid = {}
                    for g in avoid:
                        r.avoid[g.group_id] = (g.lease_id, now + p.peer_avoid_s)
                delay = backoff_s(p, r.failures, self.rng.uniform(0.5, 1.0))
                if delay > 0:
                    r.stage, r.not_before = Stage.BACKOFF, now + delay
                    self.backoff[r.request_id] = r
                    heapq.heappush(self._backoff_heap, (r.not_before, r.seq, r))
                    self.counters.requeued += 1
                    continue
            r.stage = Stage.GLOBAL_QUEUE
            back.append(r)
        self.global_queue.extendleft(reversed(back))
        self.counters.requeued += len(back)

    def _finish(self, r: Request, outcome: Outcome, now: float, error: str = "",
                final: bool = False) -> Finished:
        """Take ``r`` off the live books (it is in no queue and on no engine any more)."""
        del self.requests[r.request_id]
        self.held_bytes -= r.wire_bytes + REQUEST_FIXED_BYTES
        r.stage = Stage.DONE
        self._finish_seq += 1
        f = Finished(r.request_id, outcome, r.attempt, r.failures, error or r.error,
                     self._spec_key(r), now, self._finish_seq, seq=r.seq, final=final,
                     lost=r.lost)
        self._remember(f)
        self._log("end", f)
        if outcome is Outcome.FAILED:
            self.counters.failed += 1
            self.newly_failed.append(f)
        elif outcome is Outcome.CANCELLED:
            self.counters.cancelled += 1
        return f

    def _remember(self, f: Finished) -> None:
        kept = self.finished
        kept[f.request_id] = f
        if len(kept) > self.params.finished_requests_kept:
            last = 0
            while len(kept) > self.params.finished_requests_kept:
                last = kept.popitem(last=False)[1].finish_seq
            self._log("trim", last)

    def _role_shares(self) -> tuple[int, int]:
        """(PE nodes, DE nodes) of the up groups: a split's weights (policy)."""
        if self._shares is None:
            nodes: dict[Role, set[str]] = {Role.PREFILL: set(), Role.DECODE: set()}
            for g in self.groups.values():
                if g.up:
                    nodes[g.role].update(e.node.node_id for e in g.engines)
            self._shares = (len(nodes[Role.PREFILL]) or 1, len(nodes[Role.DECODE]) or 1)
        return self._shares

    def _topology_changed(self) -> None:
        """A group registered, went down or an engine was drained: the caches of the up
        groups (DE groups, role shares, the largest DE's HBM) are rebuilt when next read."""
        self._decode_groups = self._shares = self._max_hbm = None

    def _largest_hbm(self) -> int:
        """The largest HBM (tokens) of a DE in an up group: submit's bound on a request."""
        if self._max_hbm is None:
            self._max_hbm = max((e.hbm_tokens for e in self.engines.values()
                                 if e.role is Role.DECODE and e.group.up), default=0)
        return self._max_hbm

    def _up_decode_groups(self) -> list[Group]:
        if self._decode_groups is None:
            self._decode_groups = [g for g in self.groups.values()
                                   if g.up and g.role is Role.DECODE
                                   and any(not e.drained for e in g.engines)]
        return self._decode_groups

    # ------------------------------------------------------------ submitters

    def lookup(self, request_id: str) -> Request | Finished | None:
        return self.requests.get(request_id) or self.finished.get(request_id)

    def acknowledge(self, request_ids: list[str]) -> None:
        """The submitter has taken these results: they are REPORTED."""
        for rid in request_ids:
            f = self.finished.get(rid)
            if f is not None and not f.reported:
                f.reported = True
                self._log("reported", f)

    # ------------------------------------------------------------ admin

    def cancel(self, request_ids: list[str], now: float,
               submitter: str | None = None) -> list[Request | Finished | None]:
        """End queued or running requests CANCELLED (their engines are told to drop
        them); an ended or unknown id is left as it is. What each id is now. With
        ``submitter`` (a client withdrawing its own requests), a live request someone
        else submitted is left as it is too (and answered None: nothing is said of it)."""
        out: list[Request | Finished | None] = []
        for rid in request_ids:
            r = self.requests.get(rid)
            if r is None or (submitter is not None and r.submitter != submitter):
                out.append(self.finished.get(rid) if r is None and submitter is None
                           else None)
                continue
            st = r.stage
            if st is Stage.GLOBAL_QUEUE:
                self.global_queue.remove(r)
            elif st is Stage.GROUP_QUEUE:
                r.de_group.private_queue.remove(r)  # type: ignore[union-attr]
                r.de_group.private_tokens -= r.prompt_tokens  # type: ignore[union-attr]
            elif st is Stage.PREFILL_QUEUE:
                self.prefill_queue.remove(r)
            elif st is Stage.BACKOFF:
                del self.backoff[rid]
            elif st is Stage.RECOVERING:
                del self.recovering[rid]
            if st is Stage.PREFILLING:
                self._prefilling -= 1
            pe = r.pe if st is Stage.PREFILLING else None
            for e in (pe, r.de, r.claim_pe, r.claim_de):
                if e is not None and e.group.up:
                    e.group.pending_cancel.append(rid)
            out.append(self._finish(r, Outcome.CANCELLED, now,
                                    "cancelled by an operator" if submitter is None
                                    else "withdrawn by its submitter"))
        return out

    def drain(self, engine_id: str, undo: bool = False) -> Engine:
        e = self.engines.get(engine_id)
        if e is None:
            raise NotFound(f"engine {engine_id} is not registered")
        e.drained = not undo
        self._topology_changed()
        return e

    def set_params(self, **changes: Any) -> Params:
        """Replace some constants (alpha_tokens, beta_tokens, compute_quota_ms, ...)."""
        unknown = sorted(set(changes) - set(Params.__dataclass_fields__))
        if unknown:
            raise UsageError(f"unknown scheduler parameter {unknown[0]}")
        p = replace(self.params, **changes)
        p.validate()
        self.params = p
        return p

    def queued_requests(self) -> int:
        """Requests waiting for a DE or a PE (all queues, backoff and recovery hold)."""
        return len(self.global_queue) + len(self.prefill_queue) + sum(
            len(g.private_queue) for g in self.groups.values() if g.role is Role.DECODE) \
            + len(self.backoff) + len(self.recovering)

    def stage_counts(self) -> dict[Stage, int]:
        counts = {s: 0 for s in Stage if s is not Stage.DONE}
        counts[Stage.GLOBAL_QUEUE] = len(self.global_queue)
        counts[Stage.PREFILL_QUEUE] = len(self.prefill_queue)
        counts[Stage.GROUP_QUEUE] = sum(len(g.private_queue) for g in self.groups.values()
                                        if g.role is Role.DECODE)
        counts[Stage.BACKOFF] = len(self.backoff)
        counts[Stage.RECOVERING] = len(self.recovering)
        held = len(self.requests) - sum(counts.values())
        counts[Stage.PREFILLING] = self._prefilling
        counts[Stage.DECODING] = held - self._prefilling
        return counts

    # ------------------------------------------------------------ recovery

    def restore(self, live: list[Request], finished: list[Finished], *, next_seq: int,
                next_lease: int, now: float) -> None:
        """Load what a journal recorded into a fresh scheduler: live requests wait in the
        recovery hold for one lease (the groups re-register within it and claim what they
        still run), ended ones are remembered. The live ones count against
        ``max_held_bytes`` as they did before the restart (even past it, if the bound
        was lowered meanwhile: new submissions wait until they drain)."""
        if self.requests or self.groups or self.finished:
            raise UsageError("restore needs a fresh scheduler")
        for r in sorted(live, key=lambda r: r.seq):
            r.stage, r.since = Stage.RECOVERING, now
            r.wire_bytes = wire_bytes(r.request_id, r.payload)
            self.held_bytes += r.wire_bytes + REQUEST_FIXED_BYTES
            self.requests[r.request_id] = r
            self.recovering[r.request_id] = r
        for f in sorted(finished, key=lambda f: f.finish_seq):
            self.finished[f.request_id] = f
        c = self.counters   # as if this incarnation had seen what it recovered
        c.submitted = len(live) + len(finished)
        ends = [f.outcome for f in finished]
        c.completed, c.failed, c.cancelled = (ends.count(o) for o in (
            Outcome.DECODE_DONE, Outcome.FAILED, Outcome.CANCELLED))
        self._finish_seq = max((f.finish_seq for f in finished), default=0)
        self._next_seq = max(next_seq, max((r.seq for r in live), default=0))
        self._next_lease = next_lease
        self.recover_until = now + self.params.lease_s


def _who(identity: str) -> str:
    return identity or "an unauthenticated caller"


def _check_named(owner: str, group_id: str, specs: list[EngineSpec]) -> None:
    """A node identity ``node/<name>`` registers group ``<name>``, its engines
    ``<name>/...`` on node ``<name>`` only (PermissionDenied otherwise); other callers
    (plaintext: "") are not bound to names."""
    role, _, name = owner.partition("/")
    if role != "node":
        return
    bad = f"group {group_id!r}" if group_id != name else next(
        (f"engine {s.engine_id!r} on node {s.node_id!r}" for s in specs
         if s.node_id != name or not s.engine_id.startswith(name + "/")), None)
    if bad is not None:
        raise PermissionDenied(f"{owner} registers only group {name!r} with engines "
                               f"'{name}/...' on node {name!r}, not {bad[:200]}")
