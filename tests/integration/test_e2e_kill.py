"""The kill test: SIGKILL one DE node process in the middle of a replay. Its group's lease
lapses, the scheduler requeues everything it held (paper §6.1 leases), the PE drops what
the scheduler cancels, the surviving DE takes the work over, the replay completes, and
every completed request's prompt KV still verified at its DE.
"""

from __future__ import annotations

import time

import pytest

from dualpath.cluster.local import LocalCluster
from dualpath.cluster.replay import replay_local
from dualpath.cluster.run import make_trace
from dualpath.kv.profiles import get_profile

pytestmark = pytest.mark.slow

PROFILE = get_profile("demo")


def test_sigkill_one_decode_node_mid_replay(tmp_path):
    trace = make_trace(6, context_scale=0.05, max_rounds=4, seed=2)
    rounds = sum(len(t.rounds) for t in trace.trajectories)
    settings = {"transport": {"kind": "tcp"},
                "scheduler": {"lease_ms": 1000},
                "transfer": {"timeout_s": 5.0, "recover_attempts": 1},
                # Slow storage NICs keep requests in flight on both DEs when the kill lands.
                "storage": {"snic_gbit_per_s": 0.5}}
    killed: list[int] = []
    with LocalCluster(1, 2, work_dir=str(tmp_path), settings=settings) as cluster:
        def observer(t):
            # After the victim has finished two rounds it is busy with more: kill it.
            seen.append((t.decode_node_id, t.finish_unix_s))
            if not killed and sum(1 for n, _ in seen if n == "d1") >= 2:
                cluster.kill("d1")
                killed.append(time.time())

        seen: list[tuple[str, float]] = []
        run = replay_local(cluster, trace, PROFILE, timeout_s=180, observer=observer)
        sched_log = (tmp_path / "logs" / "scheduler.log").read_text()
    assert killed, "the victim never finished two rounds"
    assert len(run.records) == rounds                      # the replay completed
    assert run.requests_duplicated == 0                    # no result reported twice
    assert run.bytes_mismatched == 0
    # Every round's prompt KV verified at its DE. A round the victim finished and
    # reported to the scheduler just before the kill is recorded without the sink's
    # timings, which carry the verified count: those tokens are counted apart.
    prompt = sum(r.prompt_tokens for r in run.records)
    assert (run.unverified_prompt_tokens > 0) == (run.results_without_timings > 0)
    assert run.bytes_verified == ((prompt - run.unverified_prompt_tokens)
                                  * PROFILE.kv_bytes_per_token)
    # Nothing finished on the victim after the kill (reports it sent before it died may
    # still be in the sink's queue when the kill lands, hence the time test).
    assert all(finish <= killed[0] for n, finish in seen if n == "d1")
    assert any(finish > killed[0] for n, finish in seen if n == "d0")
    # The scheduler noticed through the lease and requeued the victim's requests.
    assert "group d1 (decode) missed its lease" in sched_log
