"""Drive an agentic trace through a running cluster and collect per-request timings.

The driver submits each due round (dualpath/trace/arrivals.py's ReplaySchedule: offline =
every agent at once, online = Poisson arrivals) to the scheduler with a payload naming
its trajectory, round and mode (dualpath/paths/payload.py), and runs a ReplaySink gRPC
server the DEs send each round's timings to. A report of mismatching KV aborts the
replay loudly (:class:`KvMismatch`). The scheduler is reached over mutual TLS with the
replay client's identity (``tls_config``); the sink serves with ``node_tls``.

Exactly once, as this client sees it (docs/reliability.md): a round is finished when the
*scheduler* says so (GetResults, long-polled), which it does only after it recorded the
DECODE_DONE; its timings are the sink report of the attempt the scheduler recorded (the
nodes send a result only once the scheduler recorded it, naming its attempt). A request the scheduler ended
twice, or two reports of one attempt, count as ``requests_duplicated`` and fail the run
(:class:`ReplayAborted`); sink reports of other attempts (a re-execution after a fault)
count as ``reexecutions``. A request that ended FAILED (its budget spent) counts in
``requests_failed`` and its trajectory goes on. A scheduler that knows a submitted id no
more (one that ran without its journal) gets it again, counted in ``requests_lost``.

Submission is idempotent by request id (a resubmitted identical request is accepted, not
queued twice), so UNAVAILABLE (a scheduler restarting) is retried with jittered
exponential backoff; after ``give_up_s`` of it the replay stops with the partial run
(:class:`ReplayAborted`), as on its timeout. So is QUEUE_FULL (backpressure: the queue
holds other clients' work), for the rejected requests only, counted in
``submit_retries``. A request the scheduler rejects otherwise (per-request admission:
invalid, too large, another request under its id) ends the replay
(:class:`DualPathError` naming it and why).

Trajectory names get a per-run tag, so two runs (modes) never read each other's blocks.

Threads: one asyncio loop (the caller's).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc

from dualpath import rpc, tls
from dualpath.errors import DualPathError, RemoteUnavailable
from dualpath.paths.payload import (
    MODE_LAYERWISE,
    MODE_READ_POLICY,
    Payload,
    encode_token_ids,
)
from dualpath.paths.peers import refuse_oversized
from dualpath.trace.arrivals import ReplaySchedule, arrival_times
from dualpath.trace.model import Trace, stream_token_ids
from dualpath.trace.progress import Progress
from dualpath.trace.report import ModeResult, RequestRecord, io_lower_bound_s, ttft_breakdown
from dualpath.v1 import node_pb2, node_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

log = logging.getLogger("dualpath.replay")


class KvMismatch(DualPathError):
    """A DE found KV bytes that differ from what the generator says they must be."""


class ReplayAborted(DualPathError):
    """The replay stopped before every round finished (timeout, the scheduler unreachable
    for ``give_up_s``, or results reported twice); ``run`` holds what it measured."""

    def __init__(self, message: str, run: ReplayRun, unavailable: bool = False):
        super().__init__(message)
        self.run = run
        self.unavailable = unavailable


class SchedulerGone(RemoteUnavailable):
    """UNAVAILABLE for longer than the replay's give_up_s."""


# CANCELLED: a scheduler stopping on SIGTERM cancels the calls still in flight when its
# grace ends (every call retried here is idempotent: a request submitted again with the
# same content is accepted, not a duplicate).
_RETRIED = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                      grpc.StatusCode.CANCELLED})
_DONE = (scheduler_pb2.REQUEST_STATE_DECODE_DONE, scheduler_pb2.REQUEST_STATE_REPORTED)
_ENDED_BADLY = (scheduler_pb2.REQUEST_STATE_FAILED, scheduler_pb2.REQUEST_STATE_CANCELLED)


@dataclass
class ReplayOptions:
    mode: str = "dualpath"              # basic | dualpath | oracle
    replay_mode: str = "offline"        # offline | online
    aps: float | None = None            # online: agents per second
    layerwise: bool | None = None       # None = the mode's (payload.MODE_LAYERWISE)
    read_policy: str = ""               # "" = the mode's (payload.MODE_READ_POLICY)
    seed: int = 0
    timeout_s: float = 600.0
    progress: bool = True
    window_s: float = 0.5               # storage-NIC balance windows
    give_up_s: float = 60.0             # the scheduler UNAVAILABLE this long: stop
    timings_grace_s: float = 10.0       # a recorded end whose timings never come: record
                                        # it with the time the scheduler told us
    sink_listen: str = "127.0.0.1:0"    # the ReplaySink's listen address
    sink_host: str = ""                 # the host the nodes reach it at ("" = listen host)
    # Called on the loop with each accepted RequestTimings (tests: kill a node mid-run).
    observer: Callable[[node_pb2.RequestTimings], None] | None = None


@dataclass
class ReplayRun:
    mode: str
    records: list[RequestRecord]
    timings: list[node_pb2.RequestTimings]
    start_unix_s: float
    snic_bytes: dict[str, int]
    snic_windows: list[dict[str, int]]
    hit_bytes: int
    bytes_verified: int
    bytes_mismatched: int
    decode_failures: int
    requests_submitted: int = 0
    requests_failed: int = 0            # ended FAILED or CANCELLED at the scheduler
    requests_duplicated: int = 0        # ended twice as this client saw it (must be 0)
    requests_lost: int = 0              # submitted, then unknown to the scheduler
    reexecutions: int = 0               # sink reports of attempts that did not count
    submit_retries: int = 0             # requests submitted again after QUEUE_FULL
    results_without_timings: int = 0
    # Prompt tokens of those rounds: their DE verified the KV before it reported the
    # result, but its count came with the timings that never did.
    unverified_prompt_tokens: int = 0
    partial: str = ""                   # why the run stopped early ("" = it did not)
    extra: dict = field(default_factory=dict)

    def mode_result(self, rate_bytes_per_s: float, snic_nodes: int) -> ModeResult:
        lb = None
        if self.mode != "oracle" and rate_bytes_per_s > 0:
            lb = io_lower_bound_s(self.hit_bytes, snic_nodes, rate_bytes_per_s)
        extra = {"bytes_verified": self.bytes_verified,
                 "bytes_mismatched": self.bytes_mismatched,
                 "decode_failures": self.decode_failures,
                 "requests_submitted": self.requests_submitted,
                 "requests_failed": self.requests_failed,
                 "requests_duplicated": self.requests_duplicated,
                 "requests_lost": self.requests_lost, "reexecutions": self.reexecutions,
                 "submit_retries": self.submit_retries,
                 "results_without_timings": self.results_without_timings,
                 "ttft_breakdown_s": ttft_breakdown(
                     (r.submit_s, t.assigned_unix_s, t.allocated_unix_s, t.staged_unix_s,
                      r.first_token_s) for r, t in zip(self.records, self.timings)),
                 **self.extra}
        if self.partial:
            extra["partial"] = self.partial
        return ModeResult(self.mode, self.records, self.snic_bytes, self.snic_windows, lb,
                          extra)


class _Sink(node_pb2_grpc.ReplaySinkServicer):
    """Timings from the DEs; the poller's results and failures share its queue as
    ("timings", t), ("results", [RequestResult]) and ("error", exception)."""

    def __init__(self, node_tls: tls.TlsConfig):
        self.queue: asyncio.Queue = asyncio.Queue()
        self.node_tls = node_tls

    async def Report(self, request, context):
        await tls.require_role(context, self.node_tls, "node", "the replay sink")
        await refuse_oversized(request, context)
        for t in request.timings:
            self.queue.put_nowait(("timings", t))
        return node_pb2.ReportAck()


async def _retrying(call, address: str, what: str, give_up_s: float):
    """``await call()``, retrying UNAVAILABLE / DEADLINE_EXCEEDED with jittered exponential
    backoff (50 ms doubling to 2 s) for at most ``give_up_s``; one log line per outage."""
    delay, since = 0.05, None
    while True:
        try:
            out = await call()
        except grpc.aio.AioRpcError as e:
            if e.code() not in _RETRIED:
                raise
            now = time.monotonic()
            if since is None:
                since = now
                log.warning("%s: scheduler %s %s; retrying for up to %g s", what, address,
                            e.code().name, give_up_s)
            if now - since >= give_up_s:
                raise SchedulerGone(f"scheduler {address}: {e.code().name} for {give_up_s:g} "
                                    f"s ({what}): {e.details()}") from None
            await asyncio.sleep(delay * random.uniform(0.5, 1.0))
            delay = min(2 * delay, 2.0)
            continue
        if since is not None:
            log.info("%s: the scheduler answers again after %.1f s", what,
                     time.monotonic() - since)
        return out


def _windows(timings: Sequence, nodes: Sequence[str], t0: float, width: float
             ) -> list[dict[str, int]]:
    """Per-node storage bytes in windows of ``width`` s, each request's reads spread
    evenly over its read span (the DE reports when the reads began and ended)."""
    out: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for t in timings:
        for node, nbytes in ((t.prefill_node_id, t.prefill_read_bytes),
                             (t.decode_node_id, t.decode_read_bytes)):
            if not nbytes or node not in nodes:
                continue
            s = max(0.0, t.read_start_unix_s - t0)
            e = max(s + 1e-6, t.read_end_unix_s - t0)
            w = int(s // width)
            while w * width < e:
                lo, hi = max(s, w * width), min(e, (w + 1) * width)
                out[w][node] += nbytes * (hi - lo) / (e - s)
                w += 1
    return [{n: int(v) for n, v in out[w].items()} for w in sorted(out)]


async def node_windows(addresses: dict[str, str], t0: float, t1: float, width: float,
                       node_tls: tls.TlsConfig) -> list[dict[str, int]]:
    """Per-node storage-NIC bytes in windows of ``width`` s over ``[t0, t1)``, from the
    bytes each node's token bucket granted (Node.StorageReads)."""
    out: dict[int, dict[str, int]] = defaultdict(dict)
    for node, addr in addresses.items():
        async with tls.channel(addr, node_tls) as ch:
            r = await node_pb2_grpc.NodeStub(ch).StorageReads(node_pb2.StorageReadsRequest(),
                                                              timeout=10)
        for start, nbytes in zip(r.slot_start_unix_s, r.slot_bytes):
            if t0 <= start < t1:
                w = int((start - t0) // width)
                out[w][node] = out[w].get(node, 0) + nbytes
    return [out[w] for w in sorted(out)]


async def forward_steps(addresses: dict[str, str], t0: float, t1: float,
                        node_tls: tls.TlsConfig) -> dict[str, list[node_pb2.ForwardStep]]:
    """Each prefill node's forward steps that began in ``[t0, t1)`` (Node.ForwardSteps,
    paged): node id -> its steps, oldest first."""
    out: dict[str, list[node_pb2.ForwardStep]] = {}
    for node, addr in addresses.items():
        steps: list[node_pb2.ForwardStep] = []
        since = t0
        async with tls.channel(addr, node_tls) as ch:
            stub = node_pb2_grpc.NodeStub(ch)
            while True:
                r = await stub.ForwardSteps(node_pb2.ForwardStepsRequest(since_unix_s=since),
                                            timeout=10)
                page = [s for s in r.steps if s.start_unix_s < t1 and
                        (not steps or s.start_unix_s > steps[-1].start_unix_s)]
                steps += page
                if len(page) < len(r.steps) or not page:
                    break
                since = page[-1].start_unix_s
        out[node] = steps
    return out


def replay_local(cluster, trace: Trace, profile, **opts) -> ReplayRun:
    """:func:`replay` of ``trace`` on a LocalCluster (its scheduler, nodes and TLS),
    blocking; ``profile`` gives the block size and KV bytes per token, ``opts`` are
    :class:`ReplayOptions` fields (progress off unless given)."""
    return asyncio.run(replay(
        cluster.scheduler_address, trace, cluster.node_ids(),
        block_tokens=profile.block_tokens, kv_bytes_per_token=profile.kv_bytes_per_token,
        tls_config=cluster.client_tls, node_tls=cluster.node_tls,
        opts=ReplayOptions(**{"progress": False, **opts})))


async def replay(scheduler: str, trace: Trace, nodes: Sequence[str], *,
                 block_tokens: int, kv_bytes_per_token: int, tls_config: tls.TlsConfig,
                 node_tls: tls.TlsConfig, opts: ReplayOptions | None = None,
                 node_addresses: dict[str, str] | None = None) -> ReplayRun:
    """Replay ``trace`` on the cluster whose scheduler is at ``scheduler`` (reached with
    ``tls_config``; the nodes and the sink they report to use ``node_tls``). ``nodes``
    lists its node ids (prefill first) for the storage-NIC figures; with
    ``node_addresses`` (id -> control address) the balance windows come from the nodes'
    own storage-NIC counters, else from each request's read span. Raises
    :class:`ReplayAborted` (with the partial run) when it cannot finish, and
    :class:`DualPathError` when the scheduler rejects a request (naming it and why)."""
    o = opts or ReplayOptions()
    trajs = list(trace.trajectories)
    arrivals = arrival_times(len(trajs), o.replay_mode, aps=o.aps, seed=o.seed)
    sched = ReplaySchedule(trajs, arrivals, block_tokens=block_tokens)
    tag = f"{o.mode}-{uuid.uuid4().hex[:8]}"
    policy = o.read_policy or MODE_READ_POLICY[o.mode]
    layerwise = MODE_LAYERWISE[o.mode] if o.layerwise is None else o.layerwise
    sink = _Sink(node_tls)
    server = grpc.aio.server(options=rpc.server_options())
    node_pb2_grpc.add_ReplaySinkServicer_to_server(sink, server)
    port = rpc.bind(server, o.sink_listen, "replay sink (--report-listen)",
                    tls.server_credentials(node_tls))
    await server.start()
    sink_addr = f"{o.sink_host or o.sink_listen.rpartition(':')[0]}:{port}"
    channel = tls.channel(scheduler, tls_config, options=rpc.CHANNEL_OPTIONS,
                          expect=tls_config.scheduler_identity)
    stub = scheduler_pb2_grpc.SchedulerStub(channel)
    st = _ReplayState(o)
    bar = Progress(sched.total_rounds, f"replay {o.mode}") if o.progress else None

    def finish(reqs) -> None:
        for req in reqs:
            sched.finish(req)
            if bar is not None:
                bar.advance()
    sched.start()
    t_start = time.time()
    deadline = time.monotonic() + o.timeout_s
    poller = asyncio.get_running_loop().create_task(
        _poll_results(stub, scheduler, st, sink.queue, o))
    try:
        while not sched.done:
            due = sched.due()
            if due:
                specs = []
                for req in due:
                    rid = f"{tag}-{req.request_id}"
                    plan = req.plan
                    ids = ""
                    if req.trajectory.token_ids is not None:
                        ids = encode_token_ids(stream_token_ids(
                            req.trajectory, 0, plan.prompt_tokens + plan.gen_tokens))
                    hit = min(plan.hit_tokens, plan.prompt_tokens - 1)
                    hit -= hit % block_tokens
                    p = Payload(f"{tag}/{req.trajectory.id}", plan.index, plan.prompt_tokens,
                                hit, plan.gen_tokens, mode=o.mode, sink=sink_addr,
                                layerwise=layerwise, read_policy=policy, token_ids_b64=ids)
                    spec = scheduler_pb2.RequestSpec(
                        request_id=rid, prompt_tokens=plan.prompt_tokens, hit_tokens=hit,
                        max_new_tokens=plan.gen_tokens, payload=p.encode())
                    specs.append(spec)
                    st.inflight[rid] = (req, time.time(), hit, spec)
                    if o.mode != "oracle":
                        st.hit_bytes += hit * kv_bytes_per_token
                st.submitted += len(specs)
                await _submit(stub, scheduler, specs, o, st)
            nxt = sched.next_due_s()
            wait = 1.0 if nxt is None else max(0.0, nxt - sched.elapsed())
            wait = min(wait, deadline - time.monotonic())
            if wait <= 0 and time.monotonic() >= deadline:
                raise ReplayAborted(
                    f"replay ({o.mode}) did not finish within {o.timeout_s:g} s; "
                    f"{len(st.inflight)} rounds in flight: "
                    f"{', '.join(sorted(st.inflight)[:8])}", st.run(tag, t_start, nodes))
            try:
                ev = await asyncio.wait_for(sink.queue.get(), wait if wait > 0 else 0.001)
            except TimeoutError:
                # Nothing came: the ends whose timings are overdue are done all the same
                # (once only checked after an event, so a last lost report hung the run).
                finish(st.without_timings_due())
                continue
            while True:
                kind, x = ev
                if kind == "error":
                    raise ReplayAborted(f"replay ({o.mode}) gave up: {x}",
                                        st.run(tag, t_start, nodes),
                                        unavailable=isinstance(x, RemoteUnavailable))
                done = []
                if kind == "timings":
                    done = st.on_timings(x)
                else:
                    for res in x:
                        done += st.on_result(res)
                        if res.state == scheduler_pb2.REQUEST_STATE_UNKNOWN and \
                                res.request_id in st.inflight:
                            # Known no more (a scheduler without its journal restarted).
                            st.lost += 1
                            await _submit(stub, scheduler, [st.inflight[res.request_id][3]], o,
                                          st)
                finish(done)
                if sink.queue.empty():
                    break
                ev = sink.queue.get_nowait()
            finish(st.without_timings_due())
        if st.duplicated:
            raise ReplayAborted(f"replay ({o.mode}): {st.duplicated} requests were reported "
                                "finished twice", st.run(tag, t_start, nodes))
    except SchedulerGone as e:
        gone = ReplayAborted(f"replay ({o.mode}) gave up: {e}", st.run(tag, t_start, nodes),
                             unavailable=True)
        gone.run.partial = str(gone)
        raise gone from None
    except ReplayAborted as e:
        e.run.partial = e.run.partial or str(e)
        raise
    finally:
        poller.cancel()
        await asyncio.gather(poller, return_exceptions=True)
        if bar is not None:
            bar.close()
        if st.acked:
            with contextlib.suppress(grpc.aio.AioRpcError):
                await stub.GetResults(scheduler_pb2.GetResultsRequest(
                    acknowledged_request_ids=st.acked), timeout=5)
        await channel.close()
        await server.stop(0.5)
    run = st.run(tag, t_start, nodes)
    if node_addresses:
        run.snic_windows = await node_windows(node_addresses, t_start, time.time(),
                                              o.window_s, node_tls)
    return run


async def _submit(stub, address: str, specs: list, o: ReplayOptions,
                  st: _ReplayState | None = None) -> None:
    """Submit ``specs`` until each is accepted. While a request is being submitted the
    poller does not ask about it: a scheduler that restarted mid-call rightly knows it
    not (yet), which is no loss."""
    delay, since = 0.05, time.monotonic()
    if st is not None:
        st.submitting.update(x.request_id for x in specs)
    try:
        await _submit_until_accepted(stub, address, specs, o, st, delay, since)
    finally:
        if st is not None:
            st.submitting.difference_update(x.request_id for x in specs)


async def _submit_until_accepted(stub, address, specs, o, st, delay, since) -> None:
    while True:
        reply = await _retrying(lambda specs=specs: stub.SubmitRequest(
            scheduler_pb2.SubmitRequestRequest(requests=specs), timeout=10),
            address, "SubmitRequest", o.give_up_s)
        full = [x for x in reply.rejected if x.reason == scheduler_pb2.REJECT_REASON_QUEUE_FULL]
        if len(full) < len(reply.rejected):
            x = next(x for x in reply.rejected if x not in full)
            raise DualPathError(
                f"the scheduler rejected {len(reply.rejected)} of {len(specs)} "
                f"requests, first {x.request_id}: "
                f"{scheduler_pb2.RejectReason.Name(x.reason)}: {x.detail}")
        if not full:
            return
        if time.monotonic() - since >= o.give_up_s:
            raise SchedulerGone(f"scheduler {address}: the queue stayed full for "
                                f"{o.give_up_s:g} s ({len(full)} requests not accepted)")
        if st is not None:
            st.submit_retries += len(full)
        log.info("SubmitRequest: queue full for %d of %d requests; retrying", len(full),
                 len(specs))
        specs = [specs[x.index] for x in full]
        await asyncio.sleep(delay * random.uniform(0.5, 1.0))
        delay = min(2 * delay, 2.0)


async def _poll_results(stub, address: str, st: _ReplayState, queue: asyncio.Queue,
                        o: ReplayOptions) -> None:
    """Long-poll the scheduler for the ends of the requests in flight; what it says goes
    to ``queue``, and so does the error that ends the polling."""
    try:
        while True:
            ids = [rid for rid in st.inflight
                   if rid not in st.told and rid not in st.submitting]
            ack, st.acked = st.acked, []
            if not ids and not ack:
                await asyncio.sleep(0.05)
                continue
            r = await _retrying(lambda ids=ids, ack=ack: stub.GetResults(
                scheduler_pb2.GetResultsRequest(request_ids=ids,
                                                acknowledged_request_ids=ack,
                                                wait_ms=500), timeout=10),
                address, "GetResults", o.give_up_s)
            ended = [x for x in r.results if x.state in _DONE or x.state in _ENDED_BADLY
                     or x.state == scheduler_pb2.REQUEST_STATE_UNKNOWN]
            if ended:
                st.told.update(x.request_id for x in ended
                               if x.state != scheduler_pb2.REQUEST_STATE_UNKNOWN)
                queue.put_nowait(("results", ended))
                await asyncio.sleep(0)       # let the replay take them in first
    except asyncio.CancelledError:
        raise
    except Exception as e:  # noqa: BLE001 - handed to the replay loop, which raises it
        queue.put_nowait(("error", e))


class _ReplayState:
    """What one replay has seen; loop-owned."""

    def __init__(self, o: ReplayOptions):
        self.o = o
        self.inflight: dict[str, tuple] = {}   # rid -> (round, submit time, hit, spec)
        self.ended: set[str] = set()           # told by the scheduler (waiting timings)
        self.told: set[str] = set()            # the poller has an end for it: ask no more
        self.submitting: set[str] = set()      # not acknowledged yet: do not ask
        self.outcome: dict[str, tuple[bool, int]] = {}   # rid -> (finished well, attempt)
        self.waiting: dict[str, tuple[scheduler_pb2.RequestResult, float]] = {}
        self.finished: set[str] = set()
        self.timings: dict[str, list] = defaultdict(list)   # successful sink reports
        self.acked: list[str] = []
        self.records: list[RequestRecord] = []
        self.used: list[node_pb2.RequestTimings] = []
        self.hit_bytes = self.verified = self.mismatched = self.failures = 0
        self.submitted = self.failed = self.duplicated = self.lost = 0
        self.reexecutions = self.without_timings = self.submit_retries = 0
        self.unverified_tokens = 0

    def on_timings(self, t) -> list:
        """A DE's report: the rounds it completes (one whose end the scheduler told)."""
        if t.bytes_mismatched:
            self.mismatched += t.bytes_mismatched
            raise KvMismatch(f"{t.request_id} on {t.decode_engine_id}: {t.error}")
        if t.failed:
            self.failures += 1
            log.warning("%s failed on %s (%s); the scheduler retries it", t.request_id,
                        t.decode_engine_id, t.error)
            return []
        got = self.timings[t.request_id]
        attempt = t.attempt
        if attempt and any(x.attempt == attempt for x in got):
            self.duplicated += 1
            log.error("%s: attempt %d reported twice", t.request_id, attempt)
        elif got or t.request_id in self.finished:
            self.reexecutions += 1
        got.append(t)
        res = self.waiting.pop(t.request_id, None)
        return [] if res is None else [self._finish(res[0], t)]

    def on_result(self, res) -> list:
        """The scheduler says ``res.request_id`` ended: the rounds that are now done."""
        rid = res.request_id
        if res.state == scheduler_pb2.REQUEST_STATE_UNKNOWN:
            self.told.discard(rid)
            return []
        end = (res.state in _DONE, res.attempt)
        if rid in self.outcome:     # asked again: the same end is no news, another one is
            if self.outcome[rid] != end:
                self.duplicated += 1
                log.error("%s: the scheduler reported two ends: %s, then %s", rid,
                          self.outcome[rid], end)
            return []
        if rid not in self.inflight:
            return []
        self.outcome[rid] = end
        self.ended.add(rid)
        self.acked.append(rid)
        if res.state in _ENDED_BADLY:
            self.failed += 1
            log.error("%s ended %s after %d failed attempts: %s", rid,
                      scheduler_pb2.RequestState.Name(res.state), res.failed_attempts,
                      res.error)
            self.finished.add(rid)
            self.ended.discard(rid)
            return [self.inflight.pop(rid)[0]]
        if not self.timings.get(rid):
            self.waiting[rid] = (res, time.monotonic())   # its DE's report is on its way
            return []
        got = self.timings[rid]
        return [self._finish(res, next((x for x in reversed(got) if x.attempt == res.attempt),
                                       got[-1]))]

    def without_timings_due(self) -> list:
        """Recorded ends whose timings did not come within the grace: recorded with the
        time the scheduler told us (counted in results_without_timings)."""
        now, grace = time.monotonic(), self.o.timings_grace_s
        late = [rid for rid, (_, t) in self.waiting.items() if now - t >= grace]
        out = []
        for rid in late:
            res, told = self.waiting.pop(rid)
            self.without_timings += 1
            self.unverified_tokens += self.inflight[rid][0].plan.prompt_tokens
            # When the scheduler told us it had ended, not when the grace ran out (that
            # read a fault's recovery as 10 s longer than it was).
            at = time.time() - (now - told)
            out.append(self._finish(res, node_pb2.RequestTimings(
                request_id=rid, first_token_unix_s=at, second_token_unix_s=at,
                finish_unix_s=at, attempt=res.attempt), observe=False))
        return out

    def _finish(self, res, t, observe: bool = True):
        rid = res.request_id
        req, submit, hit, _ = self.inflight.pop(rid)
        self.ended.discard(rid)
        self.finished.add(rid)
        plan = req.plan
        second = t.second_token_unix_s if plan.gen_tokens >= 2 else None
        first = max(t.first_token_unix_s, submit)
        self.records.append(RequestRecord(
            req.agent, plan.index, submit, first,
            max(second, first) if second is not None else None,
            max(t.finish_unix_s, second or first), plan.prompt_tokens, hit, plan.gen_tokens))
        self.used.append(t)
        self.verified += t.bytes_verified
        if observe and self.o.observer is not None:
            self.o.observer(t)
        return req

    def run(self, tag: str, t_start: float, nodes: Sequence[str]) -> ReplayRun:
        snic = {n: 0 for n in nodes}
        for t in self.used:
            if t.prefill_node_id in snic:
                snic[t.prefill_node_id] += t.prefill_read_bytes
            if t.decode_node_id in snic:
                snic[t.decode_node_id] += t.decode_read_bytes
        return ReplayRun(self.o.mode, list(self.records), list(self.used), t_start, snic,
                         _windows(self.used, nodes, t_start, self.o.window_s),
                         self.hit_bytes, self.verified, self.mismatched, self.failures,
                         requests_submitted=self.submitted, requests_failed=self.failed,
                         requests_duplicated=self.duplicated, requests_lost=self.lost,
                         reexecutions=self.reexecutions, submit_retries=self.submit_retries,
                         results_without_timings=self.without_timings,
                         unverified_prompt_tokens=self.unverified_tokens, extra={"tag": tag})
