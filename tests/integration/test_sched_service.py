"""The scheduler over gRPC on loopback: the leader protocol, status codes, leases with an
injected clock, admin calls, health, reflection and /metrics."""

import asyncio
import contextlib
import dataclasses
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from dualpath import clock as _clock
from dualpath import metrics
from dualpath.paths.payload import Payload, encode_token_ids
from dualpath.scheduler.client import SchedulerClient
from dualpath.scheduler.config import SchedulerConfig
from dualpath.scheduler.service import SchedulerService, create_server, set_serving
from dualpath.v1 import admin_pb2
from dualpath.v1 import scheduler_pb2 as pb

TOKEN = "s3cret-token"
KVB = 61 * 656  # ds660b KV bytes per token (paper appendix), the default profile


class FakeClock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


@contextlib.asynccontextmanager
async def scheduler(cfg: SchedulerConfig | None = None, clock=None):
    svc = SchedulerService(cfg or SchedulerConfig(), clock=clock or FakeClock(),
                           registry=metrics.new_registry(process=False))
    server, port = create_server("127.0.0.1:0", svc, admin_token=TOKEN)
    await server.start()
    await set_serving(server, True)
    client = SchedulerClient(f"127.0.0.1:{port}", admin_token=TOKEN, timeout_s=10)
    try:
        yield svc, client
    finally:
        await client.close()
        await server.stop(None)


def engines(prefix, n, node, hbm_tokens=0):
    return [pb.EngineInfo(engine_id=f"{prefix}.{k}", rank=k, node_id=node,
                          control_address=f"127.0.0.1:{7000 + k}",
                          hbm_bytes=hbm_tokens * KVB) for k in range(n)]


def status(reg_engines, free_tokens=0, tok=0, read_q=0):
    return [pb.EngineStatus(engine_id=e.engine_id, unfinished_tokens=tok,
                            read_queue_tokens=read_q, free_hbm_bytes=free_tokens * KVB)
            for e in reg_engines]


async def code_of(awaitable):
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await awaitable
    return ei.value.code()


def run(coro):
    return asyncio.run(coro)


def test_leader_protocol_end_to_end():
    async def body():
        async with scheduler() as (_svc, c):
            de_eng = engines("de0", 2, "de-node0", hbm_tokens=100_000)
            pe_eng = engines("pe0", 2, "pe-node0")
            de = await c.register_group("de0", pb.ENGINE_ROLE_DECODE, de_eng)
            pe = await c.register_group("pe0", pb.ENGINE_ROLE_PREFILL, pe_eng)
            assert de.lease_ms == 3000 and pe.compute_quota_ms == 300
            assert de.model_profile == "ds660b"
            turns = [Payload(f"turn-{i}", 0, 1000, 900, 100).encode() for i in range(5)]
            sub = await c.submit([pb.RequestSpec(prompt_tokens=1000, hit_tokens=900,
                                                 max_new_tokens=100, payload=turns[i])
                                  for i in range(5)])
            assert sub.request_ids == [f"r-{i}" for i in range(1, 6)]
            assert sub.queued_requests == 5
            # The DE leader's fetch places them and reserves HBM; PE not chosen yet.
            got = await c.fetch("de0", de.lease_id, status(de_eng, free_tokens=100_000))
            assert [a.request_id for a in got.assignments] == list(sub.request_ids)
            a = got.assignments[0]
            assert a.prefill_engine_id == "" and a.read_side == pb.READ_SIDE_UNSPECIFIED
            assert a.decode_engine_id in ("de0.0", "de0.1")
            # The PE leader's fetch returns complete assignments, FIFO.
            got = await c.fetch("pe0", pe.lease_id, status(pe_eng))
            assert [a.request_id for a in got.assignments] == list(sub.request_ids)
            a = got.assignments[0]
            assert a.prefill_engine_id in ("pe0.0", "pe0.1")
            # Read sides alternate as each read lengthens its node's queue: the first is a
            # tie at 0 (-> PE); then PE 900 > DE 0 (-> DE); 900 = 900 (-> PE); ...
            assert [x.read_side for x in got.assignments] == [
                pb.READ_SIDE_PREFILL, pb.READ_SIDE_DECODE] * 2 + [pb.READ_SIDE_PREFILL]
            assert (got.assignments[1].prefill_read_tokens,
                    got.assignments[1].decode_read_tokens) == (0, 900)
            assert (a.prompt_tokens, a.hit_tokens, a.max_new_tokens) == (1000, 900, 100)
            assert (a.prefill_read_tokens, a.decode_read_tokens) == (900, 0)
            assert a.payload == turns[0]                 # carried untouched
            assert a.decode_control_address.startswith("127.0.0.1:70")
            done = [pb.Completion(request_id=x.request_id, engine_id=x.prefill_engine_id,
                                  stage=pb.COMPLETION_STAGE_PREFILL_DONE)
                    for x in got.assignments]
            r = await c.report("pe0", pe.lease_id, done)
            assert r.accepted == 5 and not r.ignored_request_ids
            done = [pb.Completion(request_id=x.request_id, engine_id=x.decode_engine_id,
                                  stage=pb.COMPLETION_STAGE_DECODE_DONE)
                    for x in got.assignments]
            # DE completions ride on the next fetch; one is sent twice (a retry).
            r = await c.fetch("de0", de.lease_id, status(de_eng, free_tokens=100_000),
                              completions=done + done[:1])
            assert list(r.ignored_request_ids) == [done[0].request_id]
            st = await c.stats()
            assert (st.submitted_requests_total, st.completed_requests_total) == (5, 5)
            assert (st.assignments_prefill_read_total, st.assignments_decode_read_total) \
                == (3, 2)
            assert st.groups_up == 2
            # HBM bytes became tokens with the profile and back.
            views = {e.engine_id: e for e in (await c.list_engines()).engines}
            assert views["de0.0"].free_hbm_bytes % KVB == 0
            # The reads each node was ordered to do, in bytes (ctl top's READ_MB/S).
            assert {v.node_id: v.node_read_bytes_total for v in views.values()} == \
                {"pe-node0": 3 * 900 * KVB, "de-node0": 2 * 900 * KVB}

    run(body())


def test_an_idle_leaders_fetch_is_held_until_work_arrives_for_it():
    """An idle cluster costs no fetch every few ms: a fetch with wait_ms that would answer
    nothing is held until something changes. A submit wakes the DE's held fetch with its
    assignment, and that fetch wakes the PE's with the PE's; a held fetch with nothing
    to wake it ends empty when its wait is over."""
    async def body():
        cfg = SchedulerConfig(lease_ms=30_000)        # holds of up to MAX_FETCH_WAIT_MS
        async with scheduler(cfg, clock=_clock.now) as (_svc, c):
            de_eng = engines("de0", 1, "de-node0", hbm_tokens=100_000)
            pe_eng = engines("pe0", 1, "pe-node0")
            de = await c.register_group("de0", pb.ENGINE_ROLE_DECODE, de_eng)
            pe = await c.register_group("pe0", pb.ENGINE_ROLE_PREFILL, pe_eng)
            # A wait with nothing to wake it: empty, after most of the second.
            t0 = _clock.now()
            got = await c.fetch("pe0", pe.lease_id, status(pe_eng), wait_ms=300)
            assert not got.assignments and _clock.now() - t0 >= 0.25
            de_poll = asyncio.ensure_future(c.fetch(
                "de0", de.lease_id, status(de_eng, free_tokens=100_000), wait_ms=2000))
            pe_poll = asyncio.ensure_future(c.fetch("pe0", pe.lease_id, status(pe_eng),
                                                    wait_ms=2000))
            await asyncio.sleep(0.2)
            assert not de_poll.done() and not pe_poll.done()      # held
            await c.submit([pb.RequestSpec(prompt_tokens=100, max_new_tokens=4)])
            got = await asyncio.wait_for(de_poll, 1.5)   # woken, not at its 2 s
            assert [a.request_id for a in got.assignments] == ["r-1"]
            got = await asyncio.wait_for(pe_poll, 1.5)
            assert [a.prefill_engine_id for a in got.assignments] == ["pe0.0"]

    run(body())


def test_domain_errors_become_status_codes():
    async def body():
        cfg = SchedulerConfig(max_queued_requests=2)
        async with scheduler(cfg) as (_svc, c):
            de_eng = engines("de0", 1, "n0", hbm_tokens=5000)
            de = await c.register_group("de0", pb.ENGINE_ROLE_DECODE, de_eng)
            C = grpc.StatusCode
            assert await code_of(c.fetch("nope", 1, [])) == C.FAILED_PRECONDITION  # register again
            assert await code_of(c.fetch("de0", de.lease_id + 7, [])) == C.FAILED_PRECONDITION
            assert await code_of(c.fetch("de0", de.lease_id, status(engines("x", 1, "n"))))\
                == C.INVALID_ARGUMENT  # an engine of another group
            assert await code_of(c.register_group("g", pb.ENGINE_ROLE_UNSPECIFIED, de_eng)) \
                == C.INVALID_ARGUMENT
            assert await code_of(c.register_group("g2", pb.ENGINE_ROLE_DECODE, de_eng)) \
                == C.ALREADY_EXISTS  # de0.0 is taken by an up group
            await c.submit([pb.RequestSpec(request_id="a", prompt_tokens=10)])
            # Admission is per request: refusals come back as reasons, the call succeeds.
            # The same id with the same content is a retry (idempotent: accepted, not
            # queued again); with other content, or twice in one call, a DUPLICATE.
            r = await c.submit([pb.RequestSpec(request_id="a", prompt_tokens=10),
                                pb.RequestSpec(prompt_tokens=0),
                                pb.RequestSpec(prompt_tokens=6000),  # > any DE's HBM
                                pb.RequestSpec(request_id="b", prompt_tokens=1),
                                pb.RequestSpec(prompt_tokens=1),   # a, b queued: full
                                pb.RequestSpec(request_id="b", prompt_tokens=1)])
            assert list(r.request_ids) == ["a", "b"] and r.queued_requests == 2
            assert list(r.resubmitted_request_ids) == ["a"]
            assert [(x.index, x.reason) for x in r.rejected] == [
                (1, pb.REJECT_REASON_INVALID), (2, pb.REJECT_REASON_TOO_LARGE),
                (4, pb.REJECT_REASON_QUEUE_FULL), (5, pb.REJECT_REASON_DUPLICATE)]
            assert "largest decode engine has 5000" in r.rejected[1].detail
            other = await c.submit([pb.RequestSpec(request_id="a", prompt_tokens=11)])
            assert not other.request_ids and [x.reason for x in other.rejected] == [
                pb.REJECT_REASON_DUPLICATE]
            assert "known with other content" in other.rejected[0].detail
            # A retry is accepted even when the queue is full.
            again = await c.submit([pb.RequestSpec(request_id="a", prompt_tokens=10)])
            assert list(again.resubmitted_request_ids) == ["a"] and not again.rejected
            assert await code_of(c.drain("nope")) == C.NOT_FOUND
            assert await code_of(c.set_params(compute_quota_ms=0)) == C.INVALID_ARGUMENT
            bad = pb.Completion(request_id="a", engine_id="de0.0", stage=0)
            assert await code_of(c.report("de0", de.lease_id, [bad])) == C.INVALID_ARGUMENT

    run(body())


def test_lease_expiry_through_the_service_with_an_injected_clock():
    async def body():
        clock = FakeClock()
        async with scheduler(SchedulerConfig(lease_ms=2000), clock) as (svc, c):
            de_eng = engines("de0", 1, "n0", hbm_tokens=10**6)
            pe_eng = engines("pe0", 1, "n1")
            de = await c.register_group("de0", pb.ENGINE_ROLE_DECODE, de_eng)
            pe = await c.register_group("pe0", pb.ENGINE_ROLE_PREFILL, pe_eng)
            await c.submit([pb.RequestSpec(prompt_tokens=100) for _ in range(3)])
            await c.fetch("de0", de.lease_id, status(de_eng, free_tokens=10**6))
            got = await c.fetch("pe0", pe.lease_id, status(pe_eng))
            assert len(got.assignments) == 3
            clock.t += 1.5
            await c.fetch("de0", de.lease_id, status(de_eng, free_tokens=10**6))
            clock.t += 1.0  # pe0 silent for 2.5 s > 2 s; de0 for 1 s
            assert [g.group_id for g in svc.housekeeping()] == ["pe0"]
            groups = {g.group_id: g for g in (await c.list_groups()).groups}
            assert groups["pe0"].state == admin_pb2.GROUP_STATE_DOWN
            assert groups["de0"].state == admin_pb2.GROUP_STATE_UP
            # Their attempts were lost with pe0 (not failed: no backoff, the lost budget
            # counts them), and the DE is told to drop the attempt that was given up.
            st = await c.stats()
            assert (st.prefill_queue_requests, st.prefilling_requests) == (0, 0)
            assert (st.backoff_requests, st.failed_attempts_total) == (0, 0)
            assert st.lost_attempts_total == 3
            assert st.requeued_requests_total == 3
            assert await code_of(c.fetch("pe0", pe.lease_id, status(pe_eng))) == \
                grpc.StatusCode.FAILED_PRECONDITION
            pe = await c.register_group("pe0", pb.ENGINE_ROLE_PREFILL, pe_eng)
            clock.t += 0.2
            placed = await c.fetch("de0", de.lease_id, status(de_eng, free_tokens=10**6))
            assert sorted(placed.cancelled_request_ids) == sorted(a.request_id
                                                                  for a in got.assignments)
            again = await c.fetch("pe0", pe.lease_id, status(pe_eng))
            assert [a.request_id for a in again.assignments] == \
                [a.request_id for a in got.assignments]
            assert [a.attempt for a in got.assignments] == [1, 1, 1]
            assert [a.attempt for a in again.assignments] == [2, 2, 2]

    run(body())


def test_admin_drain_and_params_at_run_time():
    async def body():
        async with scheduler() as (svc, c):
            de_eng = engines("de0", 2, "n0", hbm_tokens=10**6)
            de = await c.register_group("de0", pb.ENGINE_ROLE_DECODE, de_eng)
            r = await c.drain("de0.0")
            assert r.engine.drained and r.engine.engine_id == "de0.0"
            await c.submit([pb.RequestSpec(prompt_tokens=100) for _ in range(4)])
            got = await c.fetch("de0", de.lease_id, status(de_eng, free_tokens=10**6))
            assert {a.decode_engine_id for a in got.assignments} == {"de0.1"}
            assert not (await c.drain("de0.0", undo=True)).engine.drained
            p = (await c.set_params(alpha_tokens=123, compute_quota_ms=250)).params
            assert (p.alpha_tokens, p.compute_quota_ms) == (123, 250)
            assert p.beta_tokens == svc.core.params.beta_tokens  # unchanged
            got = await c.fetch("de0", de.lease_id, status(de_eng, free_tokens=10**6))
            assert got.compute_quota_ms == 250
            assert (await c.stats()).params.alpha_tokens == 123

    run(body())


def test_health_and_reflection_are_served():
    async def body():
        async with scheduler() as (_svc, c):
            assert await c.health() == health_pb2.HealthCheckResponse.SERVING
            assert await c.health("dualpath.v1.Scheduler") == \
                health_pb2.HealthCheckResponse.SERVING
            stub = reflection_pb2_grpc.ServerReflectionStub(c.channel)

            async def requests():
                yield reflection_pb2.ServerReflectionRequest(list_services="")

            names = set()
            async for resp in stub.ServerReflectionInfo(requests()):
                names |= {s.name for s in resp.list_services_response.service}
            assert {"dualpath.v1.Scheduler", "dualpath.v1.Admin",
                    "grpc.health.v1.Health"} <= names

    run(body())


def test_metrics_endpoint_serves_the_scheduler_metrics():
    async def body():
        async with scheduler() as (svc, c):
            with metrics.start_metrics_server("127.0.0.1:0", svc.registry) as srv:
                de_eng = engines("de0", 1, "n0", hbm_tokens=10**6)
                pe_eng = engines("pe0", 1, "n1")
                de = await c.register_group("de0", pb.ENGINE_ROLE_DECODE, de_eng)
                pe = await c.register_group("pe0", pb.ENGINE_ROLE_PREFILL, pe_eng)
                await c.submit([pb.RequestSpec(prompt_tokens=100, hit_tokens=64)
                                for _ in range(3)])
                await c.submit([pb.RequestSpec(prompt_tokens=100)])
                await c.fetch("de0", de.lease_id, status(de_eng, free_tokens=10**6))
                await c.fetch("pe0", pe.lease_id, status(pe_eng))
                svc.housekeeping()
                text = await asyncio.to_thread(
                    lambda: urllib.request.urlopen(srv.url, timeout=10).read().decode())
        for name in ("dualpath_scheduler_queue_requests",
                     "dualpath_scheduler_tokens_in_flight",
                     "dualpath_scheduler_read_queue_tokens",
                     "dualpath_scheduler_fetch_duration_seconds_bucket",
                     "dualpath_scheduler_requests_submitted_total",
                     "dualpath_scheduler_event_loop_lag_seconds_bucket"):
            assert name in text, name
        # Hits of 64 tokens: PE (tie at 0), DE (64 > 0), PE (64 = 64); one without a hit.
        assert 'dualpath_scheduler_assignments_total{path="pe_read"} 2.0' in text
        assert 'dualpath_scheduler_assignments_total{path="de_read"} 1.0' in text
        assert 'dualpath_scheduler_assignments_total{path="none"} 1.0' in text
        assert 'dualpath_scheduler_assignments_total{path="split"} 0.0' in text
        assert 'dualpath_scheduler_tokens_in_flight{role="prefill"} 400.0' in text
        assert 'dualpath_scheduler_read_queue_tokens{role="prefill"} 128.0' in text
        assert 'dualpath_scheduler_read_queue_tokens{role="decode"} 64.0' in text
        assert 'dualpath_scheduler_fetch_duration_seconds_count{role="prefill"} 1.0' in text
        assert "request_id" not in text  # no per-request labels

    run(body())


def test_config_defaults_are_valid_and_documented():
    from dualpath import config

    cfg = config.load(None)
    assert cfg.scheduler == SchedulerConfig()
    sample = config.load(Path(__file__).parents[2] / "deploy" / "scheduler.toml")
    assert sample.tls.ca_file and sample.tls.cert_file and sample.scheduler.admin_token_file
    assert config.load(Path(__file__).parents[2] / "deploy" / "cluster-multinode.toml").tls.key_file
    docs = config.docs()
    for f in dataclasses.fields(SchedulerConfig):
        assert f"`scheduler.{f.name}`" in docs and f.metadata["doc"]


def test_answers_wait_for_the_journal_and_a_failed_write_stops_the_scheduler(tmp_path):
    """Group commit over gRPC: SubmitRequest answers only once its batch is committed;
    a write that fails answers UNAVAILABLE, stops the service (fail-stop) and refuses
    every later call; a restart holds what was acknowledged."""
    from dualpath.scheduler.journal import Journal, JournalError, open_scheduler
    from dualpath.scheduler.service import params_from_config

    cfg = SchedulerConfig(journal_file=str(tmp_path / "j.sqlite"))

    def spec(rid):
        return pb.RequestSpec(prompt_tokens=1000, hit_tokens=0, max_new_tokens=10,
                              request_id=rid)

    async def body():
        async with scheduler(cfg) as (svc, c):
            stops = []
            svc.on_fatal = lambda: stops.append(1)
            j = svc.journal
            real = j.write_batches
            seen = []

            def watched(batches):
                written = {r[1] for b in batches for kind, rows in b.runs if kind == "new"
                           for r in rows}
                answered = {f"ok{i}" for i, x in enumerate(calls) if x.done()}
                seen.append(written & answered)   # answered before written: none
                real(batches)

            j.write_batches = watched
            calls = [asyncio.ensure_future(c.submit([spec(f"ok{i}")])) for i in range(3)]
            assert [list((await x).request_ids) for x in calls] == [["ok0"], ["ok1"],
                                                                   ["ok2"]]
            assert seen and not any(seen)

            def broken(batches):
                raise JournalError(f"journal {j.path}: write failed: disk I/O error")

            j.write_batches = broken
            assert await code_of(c.submit([spec("lost")])) == grpc.StatusCode.UNAVAILABLE
            assert svc.failed is not None and stops == [1]
            assert await code_of(c.submit([spec("later")])) == grpc.StatusCode.UNAVAILABLE
            assert await code_of(c.get_results(["ok0"])) == grpc.StatusCode.UNAVAILABLE
        svc.close()
        j = Journal(cfg.journal_file)
        assert sorted(open_scheduler(params_from_config(cfg), j, 0.0).requests) == [
            "ok0", "ok1", "ok2"]
        j.close()

    run(body())


@pytest.mark.parametrize("what, payload, says", [
    # admitted at 1 token, the payload asks the decode node for 16,100
    ("generation", Payload("t", 0, 1000, 512, 16100),
     "gen_tokens 16100 disagrees with the request's max_new_tokens 1"),
    ("prompt", Payload("t", 0, 4000, 512, 1), "prompt_tokens 4000 disagrees"),
    ("hit", Payload("t", 0, 1000, 0, 1), "hit_tokens 0 disagrees"),
    ("token ids", Payload("t", 0, 1000, 512, 1, token_ids_b64=encode_token_ids(
        list(range(10)))), "carries 10 token ids for a prompt of 1000"),
    ("not json", None, "malformed request payload"),
])
def test_a_payload_that_disagrees_with_what_is_admitted_is_refused_at_submit(
        what, payload, says):
    """The scheduler admits a request by its prompt, hit and max_new_tokens; a payload
    (what the nodes run) that says other figures is refused as INVALID, naming the field,
    and nothing is queued. (Before, four requests admitted at 1 token ran 16,100 each.)"""
    async def body():
        async with scheduler() as (_svc, c):
            raw = payload.encode() if payload is not None else b"not json"
            sub = await c.submit([pb.RequestSpec(request_id=f"bad-{what}", prompt_tokens=1000,
                                                 hit_tokens=512, max_new_tokens=1,
                                                 payload=raw),
                                  pb.RequestSpec(request_id="good", prompt_tokens=1000,
                                                 hit_tokens=512, max_new_tokens=1,
                                                 payload=Payload("t", 0, 1000, 512, 1)
                                                 .encode())])
            assert list(sub.request_ids) == ["good"] and sub.queued_requests == 1
            [r] = sub.rejected
            assert (r.index, r.request_id, r.reason) == (0, f"bad-{what}",
                                                         pb.REJECT_REASON_INVALID)
            assert says in r.detail, r.detail
    asyncio.run(body())
