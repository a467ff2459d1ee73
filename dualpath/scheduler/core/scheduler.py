"""The scheduler's domain object: queues, groups, leases and the §6.1 policies.

Pure (no I/O, no clock: every call that needs time takes ``now`` in seconds) so that the
gRPC service, the simulator, the benchmark and the tests drive the same code. Not
thread-safe: one thread owns it (in the daemon, the asyncio loop).

Where each live request is (the invariant the tests check): exactly one of the global
queue, one DE group's private queue, the prefill queue, or an engine (stages PREFILLING
and DECODING). Requests leave the books only with DECODE_DONE.

Identity: a group is bound to the identity that first registered it (``owner``, from
its certificate at the RPC edge; "" when the edge has none). Another identity can neither
register that group id, nor fetch or report for it; the same identity may (a restarted
node). The binding outlives the lease.

Leases: every leader call renews its group's lease for ``params.lease_s``. A group whose
deadline passes is marked down (by ``expire`` or by its own late call) and every
unfinished request it held goes back to the head of an earlier queue in arrival order:

* a PE group: its PREFILLING requests -> head of the prefill queue (their DE keeps the HBM);
* a DE group: every request placed on it or in its private queue -> head of the global
  queue; a PE already prefilling one of them is told to drop it on its next fetch.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any

from dualpath.errors import UsageError
from dualpath.scheduler.core import policy
from dualpath.scheduler.core.errors import Conflict, LeaseError, NotFound, PermissionDenied
from dualpath.scheduler.core.model import (
    ASSIGNMENT_FIXED_BYTES,
    MAX_GROUP_ENGINES,
    MAX_NAME_BYTES,
    MAX_REQUEST_ID_BYTES,
    REQUEST_FIXED_BYTES,
    Admission,
    Completion,
    CompletionStage,
    Engine,
    EngineReport,
    EngineSpec,
    FetchResult,
    Group,
    Node,
    Params,
    ReadSide,
    Rejection,
    RejectReason,
    Request,
    RequestSpec,
    Role,
    Stage,
)


@dataclass
class Counters:
    submitted: int = 0
    completed: int = 0
    rejected: int = 0
    requeued: int = 0
    fetches: int = 0
    decode_assigned: int = 0
    by_read_side: dict[ReadSide, int] = field(
        default_factory=lambda: {s: 0 for s in ReadSide if s is not ReadSide.UNSPECIFIED})


class Scheduler:
    """Owns every request from submission to DECODE_DONE. See the module docstring."""

    def __init__(self, params: Params):
        params.validate()
        self.params = params
        self.global_queue: deque[Request] = deque()
        self.prefill_queue: deque[Request] = deque()
        self.groups: dict[str, Group] = {}
        self.engines: dict[str, Engine] = {}
        self.nodes: dict[str, Node] = {}
        self.requests: dict[str, Request] = {}
        self.counters = Counters()
        self._next_seq = 0
        self._next_lease = 0
        self.held_bytes = 0   # live requests' bytes (ids, payloads, bookkeeping)
        self._prefilling = 0  # requests in stage PREFILLING, kept so stats are O(groups)
        self._decode_groups: list[Group] | None = None  # up DE groups with a usable engine

    # ------------------------------------------------------------ registration

    def register_group(self, group_id: str, role: Role, specs: list[EngineSpec], now: float,
                       read_tokens_per_s: float = 0.0, owner: str = "") -> Group:
        """Start a lease for a group. Re-registering an up group ends its old lease first.
        ``owner`` is the caller's identity; a group id stays bound to its first owner."""
        if not group_id:
            raise UsageError("group_id must not be empty")
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
        if old is not None:
            if old.up:
                self._mark_down(old)
            for e in old.engines:
                if self.engines.get(e.engine_id) is e:
                    del self.engines[e.engine_id]
        rate = read_tokens_per_s or self.params.default_read_tokens_per_s
        self._next_lease += 1
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
        self._decode_groups = None
        return g

    # ------------------------------------------------------------ requests

    def submit(self, specs: list[RequestSpec]) -> Admission:
        """Admit each request on its own, in order: a valid one is enqueued at the tail
        of the global queue, the others come back as rejections with a reason. Bounds:
        the model's context (whether or not a DE is up), the largest up DE's HBM, the
        request id and payload sizes, and the queue (requests waiting, bytes held).
        UsageError, nothing enqueued, for more than ``max_submit_requests`` in one call."""
        p = self.params
        if len(specs) > p.max_submit_requests:
            raise UsageError(f"{len(specs)} requests in one submit; at most "
                             f"{p.max_submit_requests} per call (max_submit_requests)")
        max_hbm = max((e.hbm_tokens for e in self.engines.values()
                       if e.role is Role.DECODE and e.group.up), default=0)
        queued = self.queued_requests()
        seen: set[str] = set()
        accepted: list[Request] = []
        rejected: list[Rejection] = []
        for i, s in enumerate(specs):
            reason, detail = self._check_spec(s, max_hbm, seen)
            wire = len(s.request_id.encode()) + len(s.payload) + ASSIGNMENT_FIXED_BYTES
            held = wire + REQUEST_FIXED_BYTES
            if reason is None and (queued >= p.max_queued_requests
                                   or self.held_bytes + held > p.max_held_bytes):
                reason, detail = RejectReason.QUEUE_FULL, (
                    f"{queued} requests wait, {self.held_bytes} bytes held (max_queued_"
                    f"requests {p.max_queued_requests}, max_held_bytes {p.max_held_bytes})")
            if reason is not None:
                rejected.append(Rejection(i, s.request_id[:MAX_REQUEST_ID_BYTES], reason,
                                          detail[:160]))
                continue
            if s.request_id:
                seen.add(s.request_id)
            self._next_seq += 1
            rid = s.request_id or self._auto_id(self._next_seq)
            r = Request(rid, s.prompt_tokens, min(s.hit_tokens, s.prompt_tokens - 1),
                        s.max_new_tokens, s.payload, self._next_seq,
                        wire_bytes=wire + (len(rid) - len(s.request_id)))
            self.requests[rid] = r
            self.held_bytes += r.wire_bytes + REQUEST_FIXED_BYTES
            accepted.append(r)
            queued += 1
        self.global_queue.extend(accepted)
        self.counters.submitted += len(accepted)
        self.counters.rejected += len(rejected)
        return Admission(accepted, rejected)

    def _check_spec(self, s: RequestSpec, max_hbm: int, seen: set[str]
                    ) -> tuple[RejectReason | None, str]:
        p = self.params
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
        need = s.prompt_tokens + s.max_new_tokens
        if need > p.context_tokens:
            return RejectReason.TOO_LARGE, (f"request {name}: {need} tokens; the model's "
                                            f"context is {p.context_tokens}")
        if max_hbm and need > max_hbm:
            return RejectReason.TOO_LARGE, (f"request {name} needs {need} tokens of HBM; "
                                            f"the largest decode engine has {max_hbm}")
        if s.request_id and (s.request_id in self.requests or s.request_id in seen):
            return RejectReason.DUPLICATE, f"request {name} is already queued or running"
        return None, ""

    def _auto_id(self, seq: int) -> str:
        rid = f"r-{seq}"
        n = 0
        while rid in self.requests:
            n += 1
            rid = f"r-{seq}.{n}"
        return rid

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
            e.tok = rep.tok
            e.node.read_q = rep.read_q
            e.free_hbm_tokens = rep.free_hbm_tokens
        p = self.params
        limit = min(limit, p.max_assignments_per_fetch) if limit > 0 else \
            p.max_assignments_per_fetch
        self.counters.fetches += 1
        if g.role is Role.PREFILL:
            out = policy.assign_prefill(self.prefill_queue, g.engines, p, limit)
            self._prefilling += len(out)
            by_side = self.counters.by_read_side
            for r in out:
                by_side[r.read_side] += 1
        else:
            if self.global_queue:
                policy.distribute_to_groups(self.global_queue, self._up_decode_groups())
            out = policy.assign_in_group(g, p, limit)
            self.prefill_queue.extend(out)
            self.counters.decode_assigned += len(out)
        # Cancellations share the reply's byte budget; what does not fit waits for the next.
        room = p.max_fetch_reply_bytes - sum(r.wire_bytes for r in out)
        cut = 0
        for rid in g.pending_cancel:
            room -= len(rid) + 8
            if room < 0:
                break
            cut += 1
        cancelled = g.pending_cancel[:cut]
        del g.pending_cancel[:cut]
        return FetchResult(out, cancelled, g.role)

    def report(self, group_id: str, lease_id: int, completions: list[Completion],
               now: float, caller: str = "") -> tuple[int, list[str]]:
        """Completions from a leader: ``(accepted, ignored request ids)``. Unknown,
        finished or foreign requests are ignored, so a retried report is harmless."""
        g = self._leased_group(group_id, lease_id, now, caller)
        accepted = 0
        ignored: list[str] = []
        to_global: list[Request] = []
        to_prefill: list[Request] = []
        for c in completions:
            r = self.requests.get(c.request_id)
            pe_here = r is not None and r.pe is not None and r.pe.group is g and \
                r.pe.engine_id == c.engine_id and r.stage is Stage.PREFILLING
            de_here = r is not None and r.de is not None and r.de.group is g and \
                r.de.engine_id == c.engine_id and r.stage in (Stage.PREFILLING, Stage.DECODING)
            if c.stage is CompletionStage.PREFILL_DONE and pe_here:
                r.stage = Stage.DECODING
                self._prefilling -= 1
            elif c.stage is CompletionStage.DECODE_DONE and de_here:
                if r.stage is Stage.PREFILLING:
                    self._prefilling -= 1
                r.stage = Stage.DONE
                del self.requests[r.request_id]
                self.held_bytes -= r.wire_bytes + REQUEST_FIXED_BYTES
                self.counters.completed += 1
            elif c.stage is CompletionStage.FAILED and pe_here:
                to_prefill.append(r)
            elif c.stage is CompletionStage.FAILED and (de_here or (
                    r is not None and r.stage is Stage.PREFILL_QUEUE and r.de is not None
                    and r.de.group is g and r.de.engine_id == c.engine_id)):
                to_global.append(r)
            else:
                ignored.append(c.request_id)
                continue
            accepted += 1
        if to_global:
            self._requeue_global(to_global)
        if to_prefill:
            self._requeue_prefill(to_prefill)
        return accepted, ignored

    def _leased_group(self, group_id: str, lease_id: int, now: float, caller: str) -> Group:
        g = self.groups.get(group_id)
        if g is None:
            raise NotFound(f"group {group_id} is not registered")
        if g.owner != caller:   # before the lease: a stranger learns nothing about it
            raise PermissionDenied(f"group {group_id} is bound to {_who(g.owner)}; "
                                   f"{_who(caller)} cannot act for it")
        if not g.up or g.lease_id != lease_id:
            raise LeaseError(f"group {group_id}: lease {lease_id} is not current "
                             "(expired or replaced); register again")
        if now > g.deadline:
            self._mark_down(g)
            raise LeaseError(f"group {group_id}: lease {lease_id} expired "
                             f"{now - g.deadline:.3f} s ago; register again")
        g.deadline = now + self.params.lease_s
        g.last_fetch = now
        return g

    # ------------------------------------------------------------ leases

    def expire(self, now: float) -> list[Group]:
        """Mark down every up group whose lease deadline has passed; returns them."""
        late = [g for g in self.groups.values() if g.up and now > g.deadline]
        if late:
            self._mark_down(*late)
        return late

    def _mark_down(self, *groups: Group) -> None:
        """Take groups out of service and requeue what they held, all groups together so
        that the requeued requests keep their arrival order."""
        down = set(groups)
        for g in groups:
            g.up = False
            g.pending_cancel.clear()
        self._decode_groups = None
        to_global = [r for r in self.requests.values() if r.de_group in down]
        to_prefill = [r for r in self.requests.values()
                      if r.stage is Stage.PREFILLING and r.pe.group in down  # type: ignore[union-attr]
                      and r.de_group not in down]
        for g in groups:
            g.private_queue.clear()
            g.private_tokens = 0
        if to_global:
            self._requeue_global(to_global)
        if to_prefill:
            self._requeue_prefill(to_prefill)

    def _requeue_global(self, reqs: list[Request]) -> None:
        """Back to the head of the global queue, in arrival order, forgetting DE and PE."""
        reqs.sort(key=lambda r: r.seq)
        ids = {id(r) for r in reqs}
        if any(r.stage is Stage.PREFILL_QUEUE for r in reqs):
            self.prefill_queue = deque(r for r in self.prefill_queue if id(r) not in ids)
        for r in reqs:
            if r.stage is Stage.GROUP_QUEUE and r.de_group is not None and r.de_group.up:
                r.de_group.private_queue.remove(r)
                r.de_group.private_tokens -= r.prompt_tokens
            if r.stage is Stage.PREFILLING:
                self._prefilling -= 1
                if r.pe.group.up:  # type: ignore[union-attr]
                    r.pe.group.pending_cancel.append(r.request_id)  # type: ignore[union-attr]
            r.stage = Stage.GLOBAL_QUEUE
            r.de_group = r.de = r.pe = None
            self._forget_read(r)
        self.global_queue.extendleft(reversed(reqs))
        self.counters.requeued += len(reqs)

    def _requeue_prefill(self, reqs: list[Request]) -> None:
        """Back to the head of the prefill queue, in arrival order, keeping their DE."""
        reqs.sort(key=lambda r: r.seq)
        self._prefilling -= len(reqs)  # every caller passes PREFILLING requests
        for r in reqs:
            r.stage = Stage.PREFILL_QUEUE
            r.pe = None
            self._forget_read(r)
        self.prefill_queue.extendleft(reversed(reqs))
        self.counters.requeued += len(reqs)

    @staticmethod
    def _forget_read(r: Request) -> None:
        r.read_side = ReadSide.UNSPECIFIED
        r.prefill_read_tokens = r.decode_read_tokens = 0

    def _up_decode_groups(self) -> list[Group]:
        if self._decode_groups is None:
            self._decode_groups = [g for g in self.groups.values()
                                   if g.up and g.role is Role.DECODE
                                   and any(not e.drained for e in g.engines)]
        return self._decode_groups

    # ------------------------------------------------------------ admin

    def drain(self, engine_id: str, undo: bool = False) -> Engine:
        e = self.engines.get(engine_id)
        if e is None:
            raise NotFound(f"engine {engine_id} is not registered")
        e.drained = not undo
        self._decode_groups = None
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
        """Requests waiting for a DE or a PE (all queues)."""
        return len(self.global_queue) + len(self.prefill_queue) + sum(
            len(g.private_queue) for g in self.groups.values() if g.role is Role.DECODE)

    def stage_counts(self) -> dict[Stage, int]:
        counts = {s: 0 for s in Stage if s is not Stage.DONE}
        counts[Stage.GLOBAL_QUEUE] = len(self.global_queue)
        counts[Stage.PREFILL_QUEUE] = len(self.prefill_queue)
        counts[Stage.GROUP_QUEUE] = sum(len(g.private_queue) for g in self.groups.values()
                                        if g.role is Role.DECODE)
        held = len(self.requests) - sum(counts.values())
        counts[Stage.PREFILLING] = self._prefilling
        counts[Stage.DECODING] = held - self._prefilling
        return counts


def _who(identity: str) -> str:
    return identity or "an unauthenticated caller"
