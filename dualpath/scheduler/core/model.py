"""The scheduler's records: requests, engines, nodes, groups and the policy constants.

Plain mutable dataclasses (``slots``, identity equality) owned by one
:class:`~dualpath.scheduler.core.scheduler.Scheduler`; the policies in ``policy.py`` read
and update them. Token counts are the currency throughout; the RPC edge converts HBM
bytes to tokens with the model profile.

A request's lifecycle (``Stage``), in the order the scheduler decides (paper §6.1, with
the DE chosen before the PE so that a PE only receives requests whose KV has a home)::

    GLOBAL_QUEUE --(DE fetch, group phase)--> GROUP_QUEUE --(in-group phase)-->
    PREFILL_QUEUE --(PE fetch: PE + read side)--> PREFILLING --(PREFILL_DONE)-->
    DECODING --(DECODE_DONE)--> DONE (a :class:`Finished` record)

An *attempt* is one execution: it starts when a DE is chosen (PREFILL_QUEUE) and ends
with DECODE_DONE or by being given up (a FAILED report, a lost or released lease, a
cancel). Every attempt that is given up cancels both sides and sends the request to the
head of the global queue with the next attempt number; a failed attempt (FAILED, lease
lost) also waits out a backoff in BACKOFF and counts against the request's budget, after
which it ends FAILED. RECOVERING holds what a restarted scheduler read from its journal
until the groups have re-registered and claimed what they still run
(docs/reliability.md).
"""

from __future__ import annotations

import zlib
from collections import deque
from dataclasses import dataclass, field
from enum import IntEnum

from dualpath.roles import CompletionStage, ReadSide

# Enum values equal the protobuf enum values of dualpath.v1 (the RPC edge casts).


class Role(IntEnum):
    PREFILL = 1
    DECODE = 2


class Stage(IntEnum):
    GLOBAL_QUEUE = 1
    GROUP_QUEUE = 2
    PREFILL_QUEUE = 3
    PREFILLING = 4
    DECODING = 5
    DONE = 6
    BACKOFF = 7       # a failed attempt's backoff: not eligible before ``not_before``
    RECOVERING = 8    # read from the journal, waiting for the groups' claims


class Outcome(IntEnum):
    """How a request ended (values equal dualpath.v1.RequestState's)."""

    DECODE_DONE = 5
    FAILED = 7
    CANCELLED = 8


@dataclass(slots=True, eq=False)
class Request:
    """One request. ``prompt_tokens`` is len(r) in the paper; ``hit_tokens`` of them have
    KV in storage (a prefix), the other ``new_tokens`` are computed by the PE."""

    request_id: str
    prompt_tokens: int
    hit_tokens: int
    max_new_tokens: int = 0
    payload: bytes = b""
    seq: int = 0                      # arrival order, the FIFO key (set by the scheduler)
    stage: Stage = Stage.GLOBAL_QUEUE
    de_group: Group | None = None
    de: Engine | None = None
    pe: Engine | None = None
    read_side: ReadSide = ReadSide.UNSPECIFIED
    prefill_read_tokens: int = 0
    decode_read_tokens: int = 0
    attempt: int = 1                  # the current (or next) execution's number
    failures: int = 0                 # failed attempts so far (the budget's count)
    lost: int = 0                     # attempts lost with a node (the lost budget's)
    error: str = ""                   # why the last attempt failed
    since: float = 0.0                # clock time of the last change of stage
    submitted: float | None = None    # clock time of its submission
    prefilled: float | None = None    # clock time its PE last reported PREFILL_DONE
    not_before: float = 0.0           # BACKOFF: eligible again from this time
    # Groups this request keeps away from after failing there: group id -> (lease id,
    # until). A new lease (re-registration) or the time passing lifts it. None = none.
    avoid: dict[str, tuple[int, float]] | None = None
    # RECOVERING: the engines that claimed it at re-registration (PE, DE).
    claim_pe: Engine | None = None
    claim_de: Engine | None = None
    wire_bytes: int = 0               # what its Assignment adds to a fetch reply (at most)
    # Who submitted it ("role/name"; "" over plaintext or after a scheduler restart: the
    # journal does not keep it): the one identity besides an admin that may cancel it.
    submitter: str = ""

    @property
    def new_tokens(self) -> int:
        return self.prompt_tokens - self.hit_tokens

    @property
    def hbm_tokens(self) -> int:
        """KV the DE must hold: the prompt and every token it may generate."""
        return self.prompt_tokens + self.max_new_tokens


@dataclass(slots=True, eq=False)
class Node:
    """A host. ``read_q`` is its storage read queue in tokens: the last value one of its
    engines reported plus the reads the scheduler ordered since."""

    node_id: str
    read_tokens_per_s: float
    read_q: int = 0
    read_tokens_total: int = 0        # hit tokens the scheduler ordered it to read, ever


@dataclass(slots=True, eq=False)
class Engine:
    """One PE or DE. ``seq``/``tok``/``free_hbm_tokens`` are the last report plus the
    assignments made since (each fetch's report replaces them)."""

    engine_id: str
    group: Group
    node: Node
    rank: int
    role: Role
    control_address: str = ""
    hbm_tokens: int = 0               # capacity (DEs)
    seq: int = 0                      # seq_e
    _tok: int = 0                     # tok_e: read and set as ``tok``
    free_hbm_tokens: int = 0
    drained: bool = False
    assigned_total: int = 0

    @property
    def tok(self) -> int:
        """tok_e. Setting it keeps its group's Σ tok_e (``Group.tok_sum``) in step, so the
        group phase reads a group's load without walking its engines."""
        return self._tok

    @tok.setter
    def tok(self, value: int) -> None:
        self.group.tok_sum += value - self._tok
        self._tok = value


@dataclass(slots=True, eq=False)
class Group:
    """Engines that fetch together through their leader (rank 0). All PEs or all DEs."""

    group_id: str
    role: Role
    lease_id: int
    deadline: float                   # clock seconds; past it the group is marked down
    engines: list[Engine] = field(default_factory=list)
    up: bool = True
    last_fetch: float = 0.0
    # DE groups: the private queue filled by the group phase, and its prompt tokens.
    private_queue: deque[Request] = field(default_factory=deque)
    private_tokens: int = 0
    tok_sum: int = 0                  # Σ tok_e of its engines (kept by Engine.tok)
    # Requests this group's engines must drop, delivered with its next fetch.
    pending_cancel: list[str] = field(default_factory=list)
    # The identity that registered it ("node/p0"; "" = unauthenticated): only it may
    # register, fetch or report for this group id again, for as long as the scheduler runs.
    owner: str = ""

    @property
    def total_tok(self) -> int:
        """The group phase's load: Σ tok_e plus what waits in the private queue."""
        return self.tok_sum + self.private_tokens


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """One engine as its leader registers it."""

    engine_id: str
    rank: int
    node_id: str
    control_address: str = ""
    hbm_tokens: int = 0


@dataclass(frozen=True, slots=True)
class EngineReport:
    """One engine's load in a fetch (paper §6.1: seq_e, tok_e, read_q of its node)."""

    engine_id: str
    seq: int
    tok: int
    read_q: int
    free_hbm_tokens: int = 0


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """A request as submitted. ``request_id`` "" = the scheduler names it."""

    prompt_tokens: int
    hit_tokens: int = 0
    max_new_tokens: int = 0
    request_id: str = ""
    payload: bytes = b""
    submitter: str = ""               # the identity that submitted it (mutual TLS)


class RejectReason(IntEnum):
    INVALID = 1
    TOO_LARGE = 2
    DUPLICATE = 3     # known with other content, or twice in one call
    QUEUE_FULL = 4


@dataclass(frozen=True, slots=True)
class Rejection:
    """One submitted request that was not enqueued, and why (``detail``: one line)."""

    index: int
    request_id: str
    reason: RejectReason
    detail: str


@dataclass(slots=True)
class Admission:
    """What one submit did: the requests it enqueued (in order), the known ids it
    accepted again without enqueuing them (idempotent resubmission), every accepted id
    in submission order (both kinds), and the rest."""

    accepted: list[Request]
    rejected: list[Rejection]
    resubmitted: list[str] = field(default_factory=list)
    ids: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Completion:
    request_id: str
    engine_id: str
    stage: CompletionStage
    attempt: int = 0                  # 0 = not said (then the engine id alone must match)
    error: str = ""                   # FAILED: why
    suspect_engine_id: str = ""       # FAILED: the engine the reporter blames ("" = unknown)
    final: bool = False               # FAILED: no attempt can succeed; end it now


@dataclass(frozen=True, slots=True)
class Claim:
    """A request a re-registering group's engine still runs (reconciliation)."""

    request_id: str
    engine_id: str
    attempt: int
    prefill_done: bool = False        # DE: all prompt KV arrived, it is decoding


@dataclass(slots=True)
class Finished:
    """What is kept of a request that ended: enough to answer its submitter, ``ctl
    requests`` and an idempotent resubmission (``spec_key``)."""

    request_id: str
    outcome: Outcome
    attempt: int
    failures: int
    error: str
    spec_key: tuple[int, int, int, int]
    finished_at: float
    finish_seq: int = 0               # order of ending (the journal trims by it)
    reported: bool = False            # the submitter acknowledged the result
    seq: int = 0                      # the request's arrival number (its journal key)
    final: bool = False               # FAILED by a final failure (not journaled)
    lost: int = 0                     # attempts lost with a node


@dataclass(frozen=True, slots=True)
class Params:
    """Policy constants; ``Scheduler.set_params`` replaces them at run time."""

    alpha_tokens: int                 # short read-queue threshold α (A.4: readable in 3 s)
    beta_tokens: int                  # unfinished-token cap β per PE (A.4: 5 s of one GPU)
    compute_quota_ms: int = 300       # PE forward-batch quota (§6.2, A.4), for engines
    split_read: bool = False          # beyond the paper: read a request from both sides
    split_align_tokens: int = 64      # a split falls on a KV block boundary
    split_min_saving_s: float = 0.0   # a split must end the reads this much sooner
    z_slack: float = 1.05             # the 1.05 in Z (paper §6.1, DE in-group phase)
    lease_s: float = 3.0
    max_assignments_per_fetch: int = 4096
    max_queued_requests: int = 1_000_000
    default_read_tokens_per_s: float = 1.0  # node read rate when a group gives none
    max_failed_attempts: int = 5      # the budget: this many failed attempts end it FAILED
    # Attempts lost with a node whose lease lapsed (killed, frozen or cut off while it
    # held the request) count apart: the node's fault, not the request's; still a budget
    # with an end (a request that takes its nodes down with it ends FAILED).
    max_lost_attempts: int = 20
    retry_backoff_s: float = 0.0      # first backoff (doubles per failure, jittered)
    retry_backoff_max_s: float = 0.0
    peer_avoid_s: float = 0.0         # how long a failed request avoids the groups blamed
    finished_requests_kept: int = 100_000  # ended requests remembered (idempotency)
    # Admission bounds (paper-independent; see Scheduler.submit).
    context_tokens: int = 1 << 30     # prompt + max_new_tokens of one request (the model's)
    max_held_bytes: int = 2 << 30     # bytes of live requests the scheduler holds
    max_payload_bytes: int = 256 << 10
    max_submit_requests: int = 4096   # per SubmitRequest call (its reply must fit)
    # A fetch reply stops adding assignments (and cancellations) at this many bytes, so it
    # fits gRPC's default 4 MiB receive limit of every client with room to spare.
    max_fetch_reply_bytes: int = 3 << 20

    def validate(self) -> None:
        from dualpath.errors import UsageError

        for name, least in _PARAM_MINIMUM.items():
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < least:
                raise UsageError(f"scheduler parameter {name} = {v!r}: must be an integer "
                                 f">= {least}")
        if self.z_slack < 1.0:
            raise UsageError(f"scheduler parameter z_slack = {self.z_slack!r}: must be >= 1")
        if self.lease_s <= 0 or self.default_read_tokens_per_s <= 0:
            raise UsageError("scheduler parameters lease_s and default_read_tokens_per_s "
                             "must be > 0")
        if min(self.retry_backoff_s, self.retry_backoff_max_s, self.peer_avoid_s,
               self.split_min_saving_s) < 0:
            raise UsageError("scheduler parameters retry_backoff_s, retry_backoff_max_s, "
                             "peer_avoid_s and split_min_saving_s must be >= 0")
        one = self.max_payload_bytes + MAX_REQUEST_ID_BYTES + ASSIGNMENT_FIXED_BYTES
        if one > self.max_fetch_reply_bytes:
            raise UsageError(f"scheduler parameter max_payload_bytes = "
                             f"{self.max_payload_bytes}: one assignment would not fit a "
                             f"fetch reply of {self.max_fetch_reply_bytes} bytes")


_PARAM_MINIMUM = {"alpha_tokens": 0, "beta_tokens": 0, "compute_quota_ms": 1,
                  "split_align_tokens": 1, "max_assignments_per_fetch": 1,
                  "max_queued_requests": 1, "context_tokens": 1, "max_held_bytes": 1,
                  "max_payload_bytes": 0, "max_submit_requests": 1,
                  "max_fetch_reply_bytes": 1, "max_failed_attempts": 1,
                  "max_lost_attempts": 1,
                  "finished_requests_kept": 0}

#: Longest request id (bytes of UTF-8) a submit accepts.
MAX_REQUEST_ID_BYTES = 128
#: Longest group/engine/node id or control address a registration accepts, and the most
#: engines in one group.
MAX_NAME_BYTES = 256
MAX_GROUP_ENGINES = 1024
#: Longest failure reason (bytes of UTF-8) kept from a FAILED completion (longer ones are
#: cut): it lives in the request, its ended record, the journal and GetResults answers.
MAX_ERROR_BYTES = 256
#: What one Assignment carries besides the request id and payload, at most: two engine
#: ids and two control addresses (each bounded at registration) and the numbers.
ASSIGNMENT_FIXED_BYTES = 4 * MAX_NAME_BYTES + 128
#: Bookkeeping of one live request in the scheduler besides its id and payload (its
#: attempt counters and last failure's reason included).
REQUEST_FIXED_BYTES = 512


def wire_bytes(request_id: str, payload: bytes) -> int:
    """What the Assignment of a request adds to a fetch reply, at most."""
    return len(request_id.encode()) + len(payload) + ASSIGNMENT_FIXED_BYTES


@dataclass(slots=True)
class FetchResult:
    """What one fetch hands to the leader: new assignments (live request objects, to be
    converted before the loop runs again) and request ids its engines must drop."""

    assignments: list[Request]
    cancelled: list[str]
    role: Role


def spec_key(prompt_tokens: int, hit_tokens: int, max_new_tokens: int,
             payload: bytes) -> tuple[int, int, int, int]:
    """What must match for a resubmission under a known id to be the same request (the
    payload by CRC-32: cheap, and stable across processes unlike hash())."""
    return (prompt_tokens, hit_tokens, max_new_tokens, zlib.crc32(payload))


def backoff_s(params: Params, failures: int, jitter: float) -> float:
    """Backoff after the ``failures``-th failed attempt: the base doubled per failure,
    capped, times ``jitter`` in [0.5, 1] ("equal jitter": never less than half, so a
    burst of failures spreads out without any retry coming back at once)."""
    d = min(params.retry_backoff_max_s, params.retry_backoff_s * 2.0 ** (failures - 1))
    return d * jitter
