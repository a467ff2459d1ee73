"""A real `dualpath scheduler` process with a journal, SIGKILLed and restarted on the same
port: what it acknowledged survives (queued, running and finished requests, attempt
numbers), its leaders are told to register again (FAILED_PRECONDITION) and reconcile by
claiming what their engines run, resubmission is idempotent, the unclaimed requests run
again under a new attempt, and every request finishes exactly once. The leaders are
played by this test over gRPC. No timed assertions: waits poll the scheduler's own state
and only a generous deadline turns a hang into a failure."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from dualpath.cluster.local import free_port, write_toml
from dualpath.paths.payload import Payload
from dualpath.scheduler.client import SchedulerClient
from dualpath.v1 import scheduler_pb2 as pb

TOKEN = "restart-token"
KVB = 61 * 656          # ds660b KV bytes per token, the scheduler's default profile
LEASE_MS = 1000
HANG_S = 60             # only a hang reaches this


class SchedulerProcess:
    """The daemon as its own process: start, SIGKILL, start again on the same port."""

    def __init__(self, tmp: Path, **settings):
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        (tmp / "token").write_text(TOKEN + "\n")
        self.config = tmp / "scheduler.toml"
        write_toml(self.config, {"scheduler": {
            "listen": self.address, "lease_ms": LEASE_MS, "retry_backoff_ms": 0,
            "journal_file": str(tmp / "state" / "scheduler.sqlite"),
            "admin_token_file": str(tmp / "token"), **settings},
            "tls": {"plaintext": True}})   # identities across a restart: test_sched_tls.py
        self.log = tmp / "scheduler.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        seen = self.log.read_text().count("scheduler listening on") if self.log.exists() \
            else 0
        with open(self.log, "ab") as fh:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "dualpath.cli", "scheduler", "--config",
                 str(self.config)], stdout=fh, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + HANG_S
        while self.log.read_text().count("scheduler listening on") == seen:
            assert self.proc.poll() is None, self.log.read_text()
            assert time.monotonic() < deadline, "the scheduler did not start"
            time.sleep(0.05)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        with open(self.log, "a") as fh:
            fh.write("--- SIGKILL ---\n")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)


@pytest.fixture
def sched(tmp_path):
    p = SchedulerProcess(tmp_path, peer_avoid_ms=0)   # one PE: retries go back at once
    p.start()
    yield p
    p.stop()


DE = [pb.EngineInfo(engine_id="d0.0", rank=0, node_id="d0", hbm_bytes=10**6 * KVB)]
PE = [pb.EngineInfo(engine_id="p0.0", rank=0, node_id="p0")]


def status(engines, free=0):
    return [pb.EngineStatus(engine_id=e.engine_id, free_hbm_bytes=free * KVB) for e in engines]


async def until(cond, what):
    deadline = time.monotonic() + HANG_S
    while not await cond():
        assert time.monotonic() < deadline, f"never: {what}"
        await asyncio.sleep(0.05)


def test_sigkill_and_restart_recovers_reconciles_and_finishes_each_request_once(sched):
    ids = [f"job-{i}" for i in range(6)]
    specs = [pb.RequestSpec(request_id=rid, prompt_tokens=100 + i, hit_tokens=10,
                            max_new_tokens=5,
                            payload=Payload(rid, 0, 100 + i, 10, 5).encode())
             for i, rid in enumerate(ids)]

    async def before_the_kill(c):
        sub = await c.submit(specs[:1])
        assert sub.waiting_for_engines        # accepted, and it says why nothing runs
        de = await c.register_group("d0", pb.ENGINE_ROLE_DECODE, DE)
        pe = await c.register_group("p0", pb.ENGINE_ROLE_PREFILL, PE)
        sub = await c.submit(specs[1:])
        assert not sub.waiting_for_engines and list(sub.request_ids) == ids[1:]
        await c.fetch("d0", de.lease_id, status(DE, 10**6), max_assignments=4)
        got = await c.fetch("p0", pe.lease_id, status(PE), max_assignments=3)
        running = {a.request_id: a.attempt for a in got.assignments}
        assert len(running) == 3 and set(running.values()) == {1}
        first, second, third = sorted(running)
        # job-a finishes (durable), job-b is decoding, job-c is still prefilling.
        await c.fetch("p0", pe.lease_id, status(PE), max_assignments=0, completions=[
            pb.Completion(request_id=r, engine_id="p0.0", attempt=1,
                          stage=pb.COMPLETION_STAGE_PREFILL_DONE) for r in (first, second)])
        done = await c.report("d0", de.lease_id, [pb.Completion(
            request_id=first, engine_id="d0.0", attempt=1,
            stage=pb.COMPLETION_STAGE_DECODE_DONE)])
        assert done.accepted == 1
        return de, pe, first, second, third

    async def after_the_restart(c, de, first, second, third):
        # The old lease means nothing to the new incarnation: register again.
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await c.fetch("d0", de.lease_id, status(DE, 10**6))
        assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        res = {x.request_id: x for x in (await c.get_results(ids)).results}
        assert res[first].state == pb.REQUEST_STATE_DECODE_DONE      # the journal wins
        assert all(res[r].state == pb.REQUEST_STATE_QUEUED for r in ids if r != first)
        # Retried submissions change nothing.
        again = await c.submit(specs)
        assert sorted(again.resubmitted_request_ids) == sorted(ids)
        assert (await c.stats()).submitted_requests_total == len(ids)
        # The DE claims what it runs (one stale attempt among them), the PE its prefill.
        de2 = await c.register_group("d0", pb.ENGINE_ROLE_DECODE, DE, running=[
            pb.RunningRequest(request_id=second, engine_id="d0.0", attempt=1,
                              prefill_done=True),
            pb.RunningRequest(request_id=third, engine_id="d0.0", attempt=1),
            pb.RunningRequest(request_id=first, engine_id="d0.0", attempt=1)])
        assert list(de2.cancelled_request_ids) == [first]     # it ended: drop it
        assert de2.lease_id > de.lease_id                     # lease ids never repeat
        pe2 = await c.register_group("p0", pb.ENGINE_ROLE_PREFILL, PE, running=[
            pb.RunningRequest(request_id=third, engine_id="p0.0", attempt=1)])
        res = {x.request_id: x for x in (await c.get_results(ids)).results}
        assert res[second].state == pb.REQUEST_STATE_PREFILL_DONE
        assert res[third].state == pb.REQUEST_STATE_ASSIGNED
        # The rest wait out the recovery hold (one lease), then run as attempt 2.

        leases = {"d0": de2.lease_id, "p0": pe2.lease_id}

        async def hold_over():
            for gid, lease in leases.items():   # an empty report renews a lease
                await c.report(gid, lease, [])
            return (await c.stats()).recovering_requests == 0
        await until(hold_over, "the recovery hold ends")
        finished: dict[str, int] = {}

        async def run_some():
            d = await c.fetch("d0", leases["d0"], status(DE, 10**6))
            p = await c.fetch("p0", leases["p0"], status(PE))
            for a in p.assignments:
                assert a.attempt == 2, "an unclaimed request must run as a new attempt"
                await c.report("p0", leases["p0"], [pb.Completion(
                    request_id=a.request_id, engine_id="p0.0", attempt=a.attempt,
                    stage=pb.COMPLETION_STAGE_PREFILL_DONE)])
                r = await c.report("d0", leases["d0"], [pb.Completion(
                    request_id=a.request_id, engine_id="d0.0", attempt=a.attempt,
                    stage=pb.COMPLETION_STAGE_DECODE_DONE)])
                finished[a.request_id] = finished.get(a.request_id, 0) + r.accepted
            return len(finished) == len(ids) - 1 and not d.assignments
        for rid in (second, third):     # the claimed ones finish as attempt 1
            await c.report("p0", leases["p0"], [pb.Completion(
                request_id=rid, engine_id="p0.0", attempt=1,
                stage=pb.COMPLETION_STAGE_PREFILL_DONE)])
            r = await c.report("d0", leases["d0"], [pb.Completion(
                request_id=rid, engine_id="d0.0", attempt=1,
                stage=pb.COMPLETION_STAGE_DECODE_DONE)])
            finished[rid] = r.accepted
        await until(run_some, "the unclaimed requests run")
        assert all(n == 1 for n in finished.values())
        res = (await c.get_results(ids, wait_ms=100)).results
        assert [x.state for x in res] == [pb.REQUEST_STATE_DECODE_DONE] * len(ids)
        # Acknowledged results are REPORTED, and stay so across another kill.
        await c.get_results([], acknowledged=ids)
        return leases

    async def phase(fn, *a):
        async with SchedulerClient(sched.address, admin_token=TOKEN, timeout_s=10) as c:
            return await fn(c, *a)

    de, _pe, first, second, third = asyncio.run(phase(before_the_kill))
    sched.kill()
    sched.start()
    asyncio.run(phase(after_the_restart, de, first, second, third))
    sched.kill()
    sched.start()

    async def reported(c):
        res = (await c.get_results(ids)).results
        assert [x.state for x in res] == [pb.REQUEST_STATE_REPORTED] * len(ids)
    asyncio.run(phase(reported))
    log = sched.log.read_text()
    assert log.count("recovered 5 unfinished requests") == 1, log


def run_ctl(sched, *argv):
    env = dict(os.environ, DUALPATH_ADMIN_TOKEN=TOKEN)
    return subprocess.run([sys.executable, "-m", "dualpath.cli", *argv, "--scheduler",
                           sched.address, "--config", str(sched.config)],
                          capture_output=True, text=True, env=env,
                          check=False)


def test_budget_failed_listed_and_cancel_from_the_command_line(sched):
    async def body(c):
        de = await c.register_group("d0", pb.ENGINE_ROLE_DECODE, DE)
        pe = await c.register_group("p0", pb.ENGINE_ROLE_PREFILL, PE)
        await c.submit([pb.RequestSpec(request_id="poison", prompt_tokens=10)])
        for _ in range(5):         # max_failed_attempts (default 5)
            await c.fetch("d0", de.lease_id, status(DE, 10**6))
            (a,) = (await c.fetch("p0", pe.lease_id, status(PE))).assignments
            await c.report("p0", pe.lease_id, [pb.Completion(
                request_id="poison", engine_id="p0.0", attempt=a.attempt,
                stage=pb.COMPLETION_STAGE_FAILED, error=f"no payload (attempt {a.attempt})")])
        # "waits" gets its DE but no PE fetches: it waits in the prefill queue.
        await c.submit([pb.RequestSpec(request_id="waits", prompt_tokens=10)])
        await c.fetch("d0", de.lease_id, status(DE, 10**6))
        (x,) = (await c.get_results(["poison"])).results
        assert (x.state, x.failed_attempts, x.error) == (pb.REQUEST_STATE_FAILED, 5,
                                                         "no payload (attempt 5)")
    asyncio.run(_with_client(sched, body))
    out = run_ctl(sched, "ctl", "requests", "--stuck-after", "0")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[1].split()[:5] == ["poison", "failed", "failed", "5", "5"]
    assert lines[2].split()[:3] == ["waits", "assigned", "prefill_queue"]
    out = run_ctl(sched, "ctl", "cancel", "waits", "poison", "nope")
    assert out.returncode == 0, out.stderr
    assert [ln.split() for ln in out.stdout.splitlines()[1:]] == [
        ["waits", "cancelled"], ["poison", "failed"], ["nope", "unknown"]]
    log = sched.log.read_text()
    assert log.count("request poison failed after 5 failed attempts") == 1   # once
    assert "cancelled 1 requests: waits" in log


async def _with_client(sched, body):
    async with SchedulerClient(sched.address, admin_token=TOKEN, timeout_s=10) as c:
        return await body(c)
