"""Generation through the scheduler: a token-id prompt in, the tokens a real engine
(vLLM) generated out.

:class:`Generator` submits a request to the scheduler (its token ids in the payload,
greedy, exactly ``gen`` tokens) and serves a ReplaySink the decode node reports the
result to: the tokens and their logprobs, sent only once the scheduler recorded that
attempt's DECODE_DONE, so a result is never taken twice. A failed attempt's report is
passed over (the scheduler runs the next attempt); a request the scheduler ended FAILED
(its retry budget spent) raises :class:`GenerationFailed` with its reason. This is the
path the front end's requests and ``dualpath replay --engine vllm`` take.

One poller long-polls GetResults for every waiting request at once (up to
RESULTS_PER_CALL ids a call) and carries the acknowledgements of results received, so
the scheduler sees one call in flight however many requests wait.

Threads: one asyncio loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from dualpath import rpc, tls
from dualpath.errors import DualPathError, UsageError
from dualpath.node.leader import RESULTS_PER_CALL
from dualpath.paths.payload import Payload, encode_token_ids
from dualpath.paths.peers import Top, refuse_oversized, top_from_pb
from dualpath.v1 import node_pb2, node_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

log = logging.getLogger("dualpath.generate")

_ENDED = (scheduler_pb2.REQUEST_STATE_FAILED, scheduler_pb2.REQUEST_STATE_CANCELLED)
_RETRIED = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
POLL_WAIT_MS = 500


#: GenerationFailed.reason of a request ended by a failure no retry can mend (too large
#: for a node's buffer: the message names the key to raise).
FINAL = "BUFFER_TOO_SMALL"


class GenerationFailed(DualPathError):
    """The scheduler rejected the request or ended it failed (the message says why);
    ``reason``: the scheduler's RejectReason name for a rejection, :data:`FINAL` for a
    request no attempt can serve, else ""."""

    def __init__(self, message: str, reason: str = ""):
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Generated:
    request_id: str
    token_ids: list[int]
    logprobs: list[float]
    attempt: int
    prefill_node_id: str
    decode_node_id: str
    prefill_read_bytes: int
    decode_read_bytes: int
    submit_unix_s: float
    first_token_unix_s: float
    second_token_unix_s: float
    finish_unix_s: float
    finish_reason: str = ""          # vLLM's ("stop" or "length"); "" = not said
    assigned_unix_s: float = 0.0     # when a prefill node took it up (0 = not said)
    # Each token's top logprobs (the sampled token first), when the sampling asked for
    # them ("logprobs"); else empty.
    top: list[Top] = field(default_factory=list)


class _Sink(node_pb2_grpc.ReplaySinkServicer):
    """Where the decode nodes send a request's tokens: node identities only (a client
    certificate put its own tokens into another user's live request: issue 38)."""

    def __init__(self, gen: Generator):
        self.gen = gen

    async def Report(self, request, context):
        await tls.require_role(context, self.gen.node_tls, "node", "the generation sink")
        await refuse_oversized(request, context)
        for t in request.timings:
            f = self.gen._waiting.get(t.request_id)
            if f is not None and not f.done() and not t.failed:
                f.set_result(t)
        return node_pb2.ReportAck()

    async def Partial(self, request, context):
        await tls.require_role(context, self.gen.node_tls, "node", "the generation sink")
        cb = self.gen._partials.get(request.request_id)
        if cb is not None:
            try:
                top = [top_from_pb(t) for t in request.top]
            except UsageError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            cb(request.attempt, request.offset, list(request.token_ids),
               list(request.logprobs), top)
        return node_pb2.ReportAck()


class Generator:
    """See the module docstring. ``await start()``, ``await generate(...)``,
    ``await close()``. ``tls_config`` towards the scheduler; the sink serves
    ``node_tls`` (the decode nodes call it)."""

    def __init__(self, scheduler: str, tls_config: tls.TlsConfig, node_tls: tls.TlsConfig,
                 *, sink_listen: str = "127.0.0.1:0", sink_host: str = ""):
        self.scheduler = scheduler
        self.tls_config = tls_config
        self.node_tls = node_tls
        self.sink_listen = sink_listen
        self.sink_host = sink_host
        self._waiting: dict[str, asyncio.Future] = {}
        self._partials: dict[str, Callable[[int, int, list[int], list[float], list[Top]],
                                           None]] = {}
        self._acks: list[str] = []      # results received, not yet acknowledged
        self._decoded: set[str] = set()  # DECODE_DONE recorded: only the sink's report due
        self._submitted: set[str] = set()  # accepted by the scheduler: polled
        self._poller: asyncio.Task | None = None
        self._withdrawing: set[asyncio.Task] = set()
        self._closed = False
        self.server = None
        self.channel = None

    async def start(self) -> Generator:
        self.server = grpc.aio.server(options=rpc.server_options())
        node_pb2_grpc.add_ReplaySinkServicer_to_server(_Sink(self), self.server)
        port = rpc.bind(self.server, self.sink_listen, "generation sink",
                        tls.server_credentials(self.node_tls))
        await self.server.start()
        self.sink = f"{self.sink_host or self.sink_listen.rpartition(':')[0]}:{port}"
        self.channel = tls.channel(self.scheduler, self.tls_config, options=rpc.CHANNEL_OPTIONS,
                                   expect=self.tls_config.scheduler_identity)
        self.stub = scheduler_pb2_grpc.SchedulerStub(self.channel)
        return self

    async def generate(self, request_id: str, prompt: list[int], gen: int, *,
                       hit_tokens: int = 0, block_tokens: int = 1, mode: str = "dualpath",
                       read_policy: str = "scheduler", timeout_s: float = 600.0,
                       temperature: float = 0.0, top_p: float = 1.0, seed: int = -1,
                       ignore_eos: bool = True, layerwise: bool = True,
                       cache_salt: str = "", tenant: str = "",
                       sampling: dict | None = None,
                       on_partial: Callable[[int, int, list[int], list[float], list[Top]],
                                            None] | None = None) -> Generated:
        """Generate ``gen`` tokens after ``prompt`` (exactly, with ``ignore_eos``; else
        up to); ``hit_tokens`` is what the caller knows to be stored (rounded down to
        ``block_tokens``, below the prompt). ``on_partial(attempt, offset, ids,
        logprobs, top)``: the tokens as they are generated (``top``: their top logprobs,
        when the sampling asks for them) (streaming; an attempt that
        fails may be followed by the next one's from offset 0)."""
        if self._closed:
            raise GenerationFailed(f"request {request_id}: the generator is closed")
        n = len(prompt)
        hit = min(hit_tokens, n - 1)
        hit -= hit % block_tokens
        p = Payload(request_id, 0, n, max(0, hit), gen, mode=mode, sink=self.sink,
                    read_policy=read_policy, token_ids_b64=encode_token_ids(prompt),
                    temperature=temperature, top_p=top_p, seed=seed, ignore_eos=ignore_eos,
                    stream=on_partial is not None, layerwise=layerwise,
                    cache_salt=cache_salt, tenant=tenant, sampling=dict(sampling or {}))
        spec = scheduler_pb2.RequestSpec(request_id=request_id, prompt_tokens=n,
                                         hit_tokens=max(0, hit), max_new_tokens=gen,
                                         payload=p.encode())
        fut = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = fut
        if on_partial is not None:
            self._partials[request_id] = on_partial
        t0 = time.time()
        answered = False                # the scheduler said accepted or rejected
        try:
            r = await self.stub.SubmitRequest(
                scheduler_pb2.SubmitRequestRequest(requests=[spec]), timeout=10)
            answered = True
            if r.rejected:
                rej = r.rejected[0]
                name = scheduler_pb2.RejectReason.Name(rej.reason)
                raise GenerationFailed(f"request {request_id} rejected: {name}: "
                                       f"{rej.detail}", reason=name)
            self._submitted.add(request_id)
            self._kick()
            await asyncio.wait([fut], timeout=timeout_s)
            if not fut.done():
                raise GenerationFailed(f"request {request_id}: no result within "
                                       f"{timeout_s:g} s")
            t = fut.result()            # or the poller's error for this request
            self._acks.append(request_id)
            self._kick()
        except (asyncio.CancelledError, GenerationFailed):
            # The caller went away or gave up waiting: withdraw what the scheduler took
            # (or may have: its answer never came), never a rejected submission (a
            # DUPLICATE's original lives on).
            if not fut.done() and (request_id in self._submitted or not answered):
                self._withdraw(request_id)
            raise
        finally:
            self._waiting.pop(request_id, None)
            self._partials.pop(request_id, None)
            self._decoded.discard(request_id)
            self._submitted.discard(request_id)
        return Generated(request_id, list(t.output_token_ids), list(t.output_logprobs),
                         t.attempt, t.prefill_node_id, t.decode_node_id,
                         int(t.prefill_read_bytes), int(t.decode_read_bytes), t0,
                         t.first_token_unix_s, t.second_token_unix_s, t.finish_unix_s,
                         t.finish_reason, t.assigned_unix_s,
                         [top_from_pb(x) for x in t.output_top])

    def _kick(self) -> None:
        if not self._closed and (self._poller is None or self._poller.done()):
            self._poller = asyncio.ensure_future(self._poll())

    async def _poll(self) -> None:
        """Until nothing waits and nothing is left to acknowledge: one GetResults for
        the waiting requests; one the scheduler ended FAILED or CANCELLED fails its
        waiter. An outage is retried (each request ends at its own deadline); another
        refusal fails the requests of that call and drops its acknowledgements."""
        while self._submitted or self._acks:
            # Ids and acknowledgements together stay within one call's bound.
            half = RESULTS_PER_CALL // 2
            ack, self._acks = self._acks[:half], self._acks[half:]
            ids = [rid for rid in self._submitted
                   if rid in self._waiting and not self._waiting[rid].done()
                   and rid not in self._decoded][:RESULTS_PER_CALL - len(ack)]
            if not ids and not ack:
                await asyncio.sleep(0.05)
                continue
            try:
                res = await self.stub.GetResults(scheduler_pb2.GetResultsRequest(
                    request_ids=ids, acknowledged_request_ids=ack,
                    wait_ms=POLL_WAIT_MS if ids else 0), timeout=10)
            except grpc.aio.AioRpcError as e:
                if e.code() in _RETRIED:
                    self._acks[:0] = ack
                    await asyncio.sleep(POLL_WAIT_MS / 1000)
                    continue
                # Refused: those acknowledgements are dropped (the scheduler keeps an
                # unacknowledged result until it expires), the waiters told.
                for rid in ids:
                    f = self._waiting.get(rid)
                    if f is not None and not f.done():
                        f.set_exception(e)
                await asyncio.sleep(0.05)
                continue
            for st in res.results:
                f = self._waiting.get(st.request_id)
                if f is None or f.done():
                    continue
                if st.state in _ENDED:
                    f.set_exception(GenerationFailed(
                        f"request {st.request_id} failed after {st.failed_attempts} "
                        f"attempt(s): {st.error}", reason=FINAL if st.final else ""))
                elif st.state == scheduler_pb2.REQUEST_STATE_UNKNOWN:
                    f.set_exception(GenerationFailed(
                        f"request {st.request_id} is unknown to the scheduler"))
                elif st.state >= scheduler_pb2.REQUEST_STATE_DECODE_DONE:
                    self._decoded.add(st.request_id)

    def _withdraw(self, request_id: str) -> None:
        """The cluster stops serving ``request_id`` (its caller, a front end's client,
        went away): Scheduler.WithdrawRequests, in the background, best effort (the
        request's own bounds end it otherwise)."""
        async def go() -> None:
            try:
                r = await self.stub.WithdrawRequests(scheduler_pb2.WithdrawRequestsRequest(
                    request_ids=[request_id]), timeout=5)
                if r.withdrawn_request_ids:
                    log.info("request %s withdrawn: its caller went away", request_id)
            except grpc.aio.AioRpcError as e:
                log.warning("request %s: could not withdraw it (%s %s); it runs to its "
                            "end", request_id, e.code().name, e.details())
        t = asyncio.get_running_loop().create_task(go())
        self._withdrawing.add(t)
        t.add_done_callback(self._withdrawing.discard)

    async def close(self) -> None:
        """Fail what still waits, send the acknowledgements due (bounded), stop."""
        self._closed = True
        if self._withdrawing:
            await asyncio.wait(self._withdrawing, timeout=5)
        for rid, f in self._waiting.items():
            if not f.done():
                f.set_exception(GenerationFailed(f"request {rid}: the generator closed"))
        if self._poller is not None:
            if self._acks:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(asyncio.shield(self._poller), 5)
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._poller
            self._poller = None
        if self.channel is not None:
            await self.channel.close()
            self.channel = None
        if self.server is not None:
            await self.server.stop(0.5)
            self.server = None
