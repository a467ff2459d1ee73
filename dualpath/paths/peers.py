"""The node's client of other nodes: one object owns the stubs and the protobuf.

The PE and DE paths talk to each other only through :class:`PeerClient`: dataclasses
in, dataclasses out, and a gRPC failure becomes :class:`~dualpath.paths.errors.
PeerUnavailable` naming the peer, the call and the status (so a request fails with a
reason instead of an AioRpcError escaping into domain code).

    prepare      PE -> DE  Node.PrepareRequest: DE-buffer slots for the prompt
    order_load   PE -> DE  Engine.SubmitTransferOrder(LOAD_HIT_KV): the DE read path
    watch        PE -> DE  Engine.WatchTransfers: a RemoteWatch layer source
    prefill_done PE -> DE  Node.PrefillDone: every prompt byte is in the DE buffer
    stop         any       Engine.CancelRequest: the peer stops an attempt and answers
                           once its writes for it ended (fences wait for it); ``cancel``
                           is the same, best effort and bounded
    report       DE -> replay client  ReplaySink.Report: the timings of many requests
                           (those one scheduler acknowledgement recorded), one call

Every request message names its attempt (the assignment's); the peer refuses an older
one than it holds (ABORTED: :class:`~dualpath.paths.errors.PeerUnavailable` here).

Threads: the node's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import grpc

from dualpath import tls
from dualpath.errors import UsageError
from dualpath.kv import placement_wire
from dualpath.kv.placement import KvPlacement
from dualpath.paths.errors import NeverFits, PeerUnavailable
from dualpath.paths.layers import RemoteWatch
from dualpath.paths.payload import MAX_LOGPROBS
from dualpath.transfer.oob_grpc import GrpcChannels
from dualpath.v1 import engine_pb2, engine_pb2_grpc, node_pb2, node_pb2_grpc

#: How long a PrepareRequest may wait on the DE for its buffer slots. Under load a
#: request waits its turn there (the DE's pool serves first come, first served, and
#: each slot goes back when a decode ends); a bound of seconds turned that queue into
#: failed attempts. A DE that stops answering is the lease's business, not this one's.
PREPARE_WAIT_S = 600.0

#: Timings in one ReplaySink.Report call; a sink refuses more (INVALID_ARGUMENT).
REPORTS_PER_CALL = 1024
#: About how many bytes one Report call carries at most (a quarter of gRPC's default
#: 4 MiB receive limit): a real engine's timings carry its generated tokens.
REPORT_BYTES_PER_CALL = 1 << 20

log = logging.getLogger("dualpath.node")


@dataclass(frozen=True)
class PrepareJob:
    request_id: str
    decode_engine_id: str
    prefill_address: str
    prompt_tokens: int
    hit_tokens: int
    payload: bytes
    attempt: int
    decode_read_tokens: int = 0     # the DE's part of the hit (node.proto)


@dataclass(frozen=True)
class Prepared:
    """The DE buffer's placement and the request's Full Block slots in it (None and ()
    for a request that moves no KV)."""

    buffer: KvPlacement | None
    slots: tuple[int, ...]
    held: int = 0       # leading blocks the DE's instance holds: not sent (node.proto)
    base: int = 0       # slots[i] holds prompt block base + i (0 or held)


@dataclass(frozen=True)
class LoadOrder:
    request_id: str
    keys: Sequence[bytes]
    target_peer: str
    target: KvPlacement
    target_units: Sequence[int]
    attempt: int
    first_block: int = 0            # the keys are prompt blocks [first_block, ...) (split)


#: One generated token's top logprobs as vLLM lists them: (token ids, logprobs), the
#: sampled token first, then the most likely ones.
Top = tuple[tuple[int, ...], tuple[float, ...]]
#: Entries of one Top: the sampled token and at most MAX_LOGPROBS others.
MAX_TOP = MAX_LOGPROBS + 1


def top_pb(t: Top) -> node_pb2.TopLogprobs:
    return node_pb2.TopLogprobs(token_ids=list(t[0]), logprobs=list(t[1]))


def top_from_pb(pb: node_pb2.TopLogprobs) -> Top:
    """A peer's TopLogprobs, bounded (UsageError when malformed)."""
    if len(pb.token_ids) != len(pb.logprobs) or len(pb.token_ids) > MAX_TOP:
        raise UsageError(f"top logprobs: {len(pb.token_ids)} token ids and "
                         f"{len(pb.logprobs)} logprobs (equal, at most {MAX_TOP})")
    return tuple(int(i) for i in pb.token_ids), tuple(float(x) for x in pb.logprobs)


@dataclass(frozen=True)
class PrefillReport:
    request_id: str
    prefill_engine_id: str
    prefill_node_id: str
    done_unix_s: float
    read_bytes: int
    read_span: tuple[float, float]
    attempt: int
    computed_from_tokens: int       # hit_tokens unless hit blocks had to be recomputed
    kv_blocks: int = 0              # vLLM: leading prompt blocks complete in the DE buffer
    # vLLM: the prefill's token, its logprob, whether it ended the answer
    first_token: tuple[int, float, bool] | None = None
    first_top: Top | None = None    # its top logprobs, when the request asks for them
    # When the PE fetched it, when its buffers were allocated (the DE's and the PE's),
    # and when its hit was staged (read): the TTFT breakdown (paper Fig. 12 left).
    phases: tuple[float, float, float] = (0.0, 0.0, 0.0)


@dataclass
class Timings:
    """A finished (or failed) request's timings for the replay client."""

    request_id: str
    decode_engine_id: str
    prefill_node_id: str
    decode_node_id: str
    prefill_read_bytes: int = 0
    decode_read_bytes: int = 0
    read_span: tuple[float, float] = (0.0, 0.0)
    first_token_unix_s: float = 0.0
    second_token_unix_s: float = 0.0
    finish_unix_s: float = 0.0
    bytes_verified: int = 0
    bytes_mismatched: int = 0
    failed: bool = False
    error: str = ""
    attempt: int = 0
    output_token_ids: tuple[int, ...] = ()     # a real engine's generated tokens
    output_logprobs: tuple[float, ...] = ()
    output_top: tuple[Top, ...] = ()    # when the request asks for top logprobs
    phases: tuple[float, float, float] = (0.0, 0.0, 0.0)   # PrefillReport.phases
    finish_reason: str = ""                    # a real engine's: "stop" or "length"


class PeerClient:
    """See the module docstring. ``channels`` is the node's channel cache (owned by it)."""

    def __init__(self, channels: GrpcChannels, *, timeout_s: float = 10.0):
        self.channels = channels
        self.timeout_s = timeout_s

    def expect(self, peer: str, identity: str) -> None:
        """The scheduler said ``identity`` serves at ``peer`` (GrpcChannels.expect)."""
        self.channels.expect(peer, identity)

    def _node(self, peer: str) -> node_pb2_grpc.NodeStub:
        return node_pb2_grpc.NodeStub(self.channels.channel(peer))

    def _engine(self, peer: str, expect: str = "") -> engine_pb2_grpc.EngineStub:
        return engine_pb2_grpc.EngineStub(self.channels.channel(peer, expect))

    async def _call(self, peer: str, what: str, call, expect: str = ""):
        try:
            return await call
        except grpc.aio.AioRpcError as e:
            why = await tls.explained(e, peer, self.channels.tls,
                                      self.channels.expected(peer, expect))
            msg = f"{what} to {peer}: {e.code().name} {why}"
            if e.code() == grpc.StatusCode.OUT_OF_RANGE:    # larger than its buffer
                raise NeverFits(msg) from None
            raise PeerUnavailable(msg) from None

    async def prepare(self, de: str, job: PrepareJob) -> Prepared:
        r = await self._call(de, "PrepareRequest", self._node(de).PrepareRequest(
            node_pb2.PrepareRequestRequest(
                request_id=job.request_id, decode_engine_id=job.decode_engine_id,
                prefill_control_address=job.prefill_address, prompt_tokens=job.prompt_tokens,
                hit_tokens=job.hit_tokens, payload=job.payload,
                attempt=job.attempt, decode_read_tokens=job.decode_read_tokens),
            timeout=PREPARE_WAIT_S))
        if not r.slots:
            return Prepared(None, ())
        held, base = int(r.held_blocks), int(r.first_slot_block)
        if base not in (0, held):
            raise PeerUnavailable(f"{job.request_id}: {de} answered slots from block {base} "
                                  f"with {held} blocks held")
        return Prepared(placement_wire.from_pb(r.buffer, f"DE buffer of {de}"), tuple(r.slots),
                        held, base)

    async def order_load(self, de: str, o: LoadOrder) -> None:
        await self._call(de, "SubmitTransferOrder", self._engine(de).SubmitTransferOrder(
            engine_pb2.TransferOrder(
                request_id=o.request_id, kind=engine_pb2.TRANSFER_KIND_LOAD_HIT_KV,
                block_keys=list(o.keys), target_peer=o.target_peer,
                target=placement_wire.to_pb(o.target), target_units=list(o.target_units),
                attempt=o.attempt, first_block=o.first_block),
            timeout=self.timeout_s))

    def watch(self, de: str, request_id: str, attempt: int) -> RemoteWatch:
        call = self._engine(de).WatchTransfers(
            engine_pb2.WatchTransfersRequest(request_id=request_id, attempt=attempt))
        return RemoteWatch(call, de)

    async def prefill_done(self, de: str, r: PrefillReport) -> None:
        await self._call(de, "PrefillDone", self._node(de).PrefillDone(
            node_pb2.PrefillDoneRequest(
                request_id=r.request_id, prefill_engine_id=r.prefill_engine_id,
                prefill_done_unix_s=r.done_unix_s, prefill_node_id=r.prefill_node_id,
                prefill_read_bytes=r.read_bytes, read_start_unix_s=r.read_span[0],
                read_end_unix_s=r.read_span[1], attempt=r.attempt,
                computed_from_tokens=r.computed_from_tokens, kv_blocks=r.kv_blocks,
                has_first_token=r.first_token is not None,
                first_token_id=r.first_token[0] if r.first_token else 0,
                first_token_logprob=r.first_token[1] if r.first_token else 0.0,
                first_token_stops=bool(r.first_token and r.first_token[2]),
                first_token_top=top_pb(r.first_top) if r.first_top else None,
                assigned_unix_s=r.phases[0], allocated_unix_s=r.phases[1],
                staged_unix_s=r.phases[2]),
            timeout=self.timeout_s))

    async def stop(self, peer: str, request_id: str, attempt: int,
                   timeout_s: float | None = None, expect: str = "") -> None:
        """``peer`` stops ``attempt`` of ``request_id`` and answers once its writes for it
        ended (PeerUnavailable when it does not answer in time, or is not ``expect``)."""
        await self._call(peer, "CancelRequest", self._engine(peer, expect).CancelRequest(
            engine_pb2.CancelRequestRequest(request_id=request_id, attempt=attempt),
            timeout=timeout_s or self.timeout_s), expect)

    async def cancel(self, peer: str, request_id: str, attempt: int) -> bool:
        """Best effort and bounded: the peer may be gone (its lease then ends the request
        there). True when it answered."""
        with contextlib.suppress(PeerUnavailable):
            await self.stop(peer, request_id, attempt, timeout_s=2.0)
            return True
        return False

    async def cancel_until_answered(self, peer: str, request_id: str, attempt: int,
                                    tries: int = 6) -> bool:
        """:meth:`cancel`, tried again (1, 2, 4... s apart; about a minute in all) until
        the peer answers: for a PrepareRequest whose answer never came, which may still
        arrive there (through a partition) and prepare a state nobody would end; the
        peer refuses it once it knows the attempt cancelled. True when it answered."""
        for i in range(tries):
            if await self.cancel(peer, request_id, attempt):
                return True
            if i + 1 < tries:
                await asyncio.sleep(2.0 ** i)
        log.warning("%s: %s never answered the cancel of attempt %d (its lease ends what "
                    "it holds)", request_id, peer, attempt)
        return False

    async def partial(self, sink: str, request_id: str, attempt: int, offset: int,
                      ids: Sequence[int], logprobs: Sequence[float],
                      top: Sequence[Top] = (), expect: str = "") -> None:
        """Tokens so far to the sink, which must be ``expect`` (the submitter) if said."""
        stub = node_pb2_grpc.ReplaySinkStub(self.channels.channel(sink, expect))
        await self._call(sink, "ReplaySink.Partial", stub.Partial(
            node_pb2.PartialTokens(request_id=request_id, attempt=attempt, offset=offset,
                                   token_ids=list(ids), logprobs=list(logprobs),
                                   top=[top_pb(t) for t in top]),
            timeout=self.timeout_s), expect)

    async def report(self, sink: str, timings: Sequence[Timings], expect: str = "") -> None:
        """``timings`` (at most REPORTS_PER_CALL) to the sink in one call; the sink must
        be ``expect`` (their submitter) if said."""
        if len(timings) > REPORTS_PER_CALL:
            raise UsageError(f"{len(timings)} reports in one call; at most "
                             f"{REPORTS_PER_CALL}")
        stub = node_pb2_grpc.ReplaySinkStub(self.channels.channel(sink, expect))
        await self._call(sink, "ReplaySink.Report", stub.Report(
            node_pb2.RequestTimingsBatch(timings=[_timings_pb(t) for t in timings]),
            timeout=self.timeout_s), expect)


def report_bytes(t: Timings) -> int:
    """About how many bytes ``t`` adds to a Report call, at most: ~256 bytes and up to 16
    a generated token."""
    return 256 + 16 * len(t.output_token_ids)


def report_calls(timings: Sequence[Timings]) -> Iterator[list[Timings]]:
    """``timings`` cut into Report calls: at most REPORTS_PER_CALL each, and about
    REPORT_BYTES_PER_CALL (:func:`report_bytes`; one larger than that goes alone)."""
    call: list[Timings] = []
    size = 0
    for t in timings:
        n = report_bytes(t)
        if call and (len(call) == REPORTS_PER_CALL or size + n > REPORT_BYTES_PER_CALL):
            yield call
            call, size = [], 0
        call.append(t)
        size += n
    if call:
        yield call


async def refuse_oversized(request: node_pb2.RequestTimingsBatch,
                           context: grpc.aio.ServicerContext) -> None:
    """A sink's bound on one Report call: more than REPORTS_PER_CALL timings is
    INVALID_ARGUMENT (nothing of it taken)."""
    if len(request.timings) > REPORTS_PER_CALL:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                            f"{len(request.timings)} timings in one Report; at most "
                            f"{REPORTS_PER_CALL}")


def _timings_pb(t: Timings) -> node_pb2.RequestTimings:
    return node_pb2.RequestTimings(
        request_id=t.request_id, decode_engine_id=t.decode_engine_id,
        first_token_unix_s=t.first_token_unix_s, second_token_unix_s=t.second_token_unix_s,
        finish_unix_s=t.finish_unix_s, bytes_verified=t.bytes_verified,
        bytes_mismatched=t.bytes_mismatched, failed=t.failed, error=t.error,
        prefill_node_id=t.prefill_node_id, decode_node_id=t.decode_node_id,
        prefill_read_bytes=t.prefill_read_bytes, decode_read_bytes=t.decode_read_bytes,
        read_start_unix_s=t.read_span[0], read_end_unix_s=t.read_span[1], attempt=t.attempt,
        output_token_ids=list(t.output_token_ids), output_logprobs=list(t.output_logprobs),
        output_top=[top_pb(x) for x in t.output_top],
        assigned_unix_s=t.phases[0], allocated_unix_s=t.phases[1], staged_unix_s=t.phases[2],
        finish_reason=t.finish_reason)
