"""Drive an agentic trace through a running cluster and collect per-request timings.

The driver submits each due round (dualpath/trace/arrivals.py's ReplaySchedule: offline =
every agent at once, online = Poisson arrivals) to the scheduler with a payload naming
its trajectory, round and mode (dualpath/engine/payload.py), and runs a ReplaySink gRPC
server the DEs report to when a round finishes. A round whose DE died never reports; the
scheduler requeues it and another DE does. A report of mismatching KV aborts the replay
loudly (:class:`KvMismatch`).

Trajectory names get a per-run tag, so two runs (modes) never read each other's blocks.

Threads: one asyncio loop (the caller's).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc

from dualpath import tls
from dualpath.engine.payload import MODE_READ_POLICY, Payload, encode_token_ids
from dualpath.errors import DualPathError
from dualpath.trace.arrivals import ReplaySchedule, RoundRequest, arrival_times
from dualpath.trace.model import Trace, stream_token_ids
from dualpath.trace.progress import Progress
from dualpath.trace.report import ModeResult, RequestRecord, io_lower_bound_s
from dualpath.v1 import node_pb2, node_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

log = logging.getLogger("dualpath.replay")


class KvMismatch(DualPathError):
    """A DE found KV bytes that differ from what the generator says they must be."""


@dataclass
class ReplayOptions:
    mode: str = "dualpath"              # basic | dualpath | oracle
    replay_mode: str = "offline"        # offline | online
    aps: float | None = None            # online: agents per second
    layerwise: bool = True
    read_policy: str = ""               # "" = the mode's (payload.MODE_READ_POLICY)
    seed: int = 0
    timeout_s: float = 600.0
    progress: bool = True
    window_s: float = 0.5               # storage-NIC balance windows
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
    extra: dict = field(default_factory=dict)

    def mode_result(self, rate_bytes_per_s: float, snic_nodes: int) -> ModeResult:
        lb = None
        if self.mode != "oracle" and rate_bytes_per_s > 0:
            lb = io_lower_bound_s(self.hit_bytes, snic_nodes, rate_bytes_per_s)
        return ModeResult(self.mode, self.records, self.snic_bytes, self.snic_windows, lb,
                          {"bytes_verified": self.bytes_verified,
                           "bytes_mismatched": self.bytes_mismatched,
                           "decode_failures": self.decode_failures, **self.extra})


class _Sink(node_pb2_grpc.ReplaySinkServicer):
    def __init__(self):
        self.queue: asyncio.Queue = asyncio.Queue()

    async def Report(self, request, context):
        self.queue.put_nowait(request)
        return node_pb2.ReportAck()


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


async def replay(scheduler: str, trace: Trace, nodes: Sequence[str], *,
                 block_tokens: int, kv_bytes_per_token: int, tls_config: tls.TlsConfig,
                 node_tls: tls.TlsConfig, opts: ReplayOptions | None = None,
                 node_addresses: dict[str, str] | None = None) -> ReplayRun:
    """Replay ``trace`` on the cluster whose scheduler is at ``scheduler`` (reached with
    ``tls_config``; the nodes and the sink they report to use ``node_tls``). ``nodes``
    lists its node ids (prefill first) for the storage-NIC figures; with
    ``node_addresses`` (id -> control address) the balance windows come from the nodes'
    own storage-NIC counters, else from each request's read span. A request the
    scheduler rejects ends the replay (:class:`DualPathError` naming it and why)."""
    o = opts or ReplayOptions()
    trajs = list(trace.trajectories)
    arrivals = arrival_times(len(trajs), o.replay_mode, aps=o.aps, seed=o.seed)
    sched = ReplaySchedule(trajs, arrivals, block_tokens=block_tokens)
    tag = f"{o.mode}-{uuid.uuid4().hex[:8]}"
    policy = o.read_policy or MODE_READ_POLICY[o.mode]
    sink = _Sink()
    server = grpc.aio.server()
    node_pb2_grpc.add_ReplaySinkServicer_to_server(sink, server)
    from dualpath.rpc import bind

    port = bind(server, "127.0.0.1:0", "replay sink", tls.server_credentials(node_tls))
    await server.start()
    sink_addr = f"127.0.0.1:{port}"
    channel = tls.channel(scheduler, tls_config)
    stub = scheduler_pb2_grpc.SchedulerStub(channel)
    inflight: dict[str, tuple[RoundRequest, float, int]] = {}
    records: list[RequestRecord] = []
    timings: list[node_pb2.RequestTimings] = []
    verified = mismatched = failures = 0
    hit_bytes = 0
    bar = Progress(sched.total_rounds, f"replay {o.mode}") if o.progress else None
    sched.start()
    t_start = time.time()
    deadline = time.monotonic() + o.timeout_s
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
                                layerwise=o.layerwise, read_policy=policy, token_ids_b64=ids)
                    specs.append(scheduler_pb2.RequestSpec(
                        request_id=rid, prompt_tokens=plan.prompt_tokens, hit_tokens=hit,
                        max_new_tokens=plan.gen_tokens, payload=p.encode()))
                    inflight[rid] = (req, time.time(), hit)
                    if o.mode != "oracle":
                        hit_bytes += hit * kv_bytes_per_token
                reply = await stub.SubmitRequest(
                    scheduler_pb2.SubmitRequestRequest(requests=specs), timeout=10)
                if reply.rejected:
                    x = reply.rejected[0]
                    raise DualPathError(
                        f"the scheduler rejected {len(reply.rejected)} of {len(specs)} "
                        f"requests, first {x.request_id}: "
                        f"{scheduler_pb2.RejectReason.Name(x.reason)}: {x.detail}")
            nxt = sched.next_due_s()
            wait = 1.0 if nxt is None else max(0.0, nxt - sched.elapsed())
            wait = min(wait, deadline - time.monotonic())
            if wait <= 0 and time.monotonic() >= deadline:
                raise DualPathError(f"replay ({o.mode}) did not finish within {o.timeout_s:g} s;"
                                    f" {len(inflight)} rounds in flight: {', '.join(sorted(inflight)[:8])}")
            try:
                t = await asyncio.wait_for(sink.queue.get(), wait if wait > 0 else 0.001)
            except TimeoutError:
                continue
            while True:
                got = inflight.get(t.request_id)
                if t.bytes_mismatched:
                    mismatched += t.bytes_mismatched
                    raise KvMismatch(f"{t.request_id} on {t.decode_engine_id}: {t.error}")
                if got is not None and t.failed:
                    failures += 1
                    log.warning("%s failed on %s (%s); the scheduler requeues it",
                                t.request_id, t.decode_engine_id, t.error)
                elif got is not None:
                    req, submit, hit = inflight.pop(t.request_id)
                    plan = req.plan
                    second = t.second_token_unix_s if plan.gen_tokens >= 2 else None
                    first = max(t.first_token_unix_s, submit)
                    records.append(RequestRecord(
                        req.agent, plan.index, submit, first,
                        max(second, first) if second is not None else None,
                        max(t.finish_unix_s, second or first), plan.prompt_tokens,
                        hit, plan.gen_tokens))
                    timings.append(t)
                    verified += t.bytes_verified
                    if o.observer is not None:
                        o.observer(t)
                    sched.finish(req)
                    if bar is not None:
                        bar.advance()
                if sink.queue.empty():
                    break
                t = sink.queue.get_nowait()
    finally:
        if bar is not None:
            bar.close()
        await channel.close()
        await server.stop(0.5)
    snic = {n: 0 for n in nodes}
    for t in timings:
        if t.prefill_node_id in snic:
            snic[t.prefill_node_id] += t.prefill_read_bytes
        if t.decode_node_id in snic:
            snic[t.decode_node_id] += t.decode_read_bytes
    if node_addresses:
        windows = await node_windows(node_addresses, t_start, time.time(), o.window_s,
                                     node_tls)
    else:
        windows = _windows(timings, nodes, t_start, o.window_s)
    return ReplayRun(o.mode, records, timings, t_start, snic, windows, hit_bytes, verified,
                     mismatched, failures)
