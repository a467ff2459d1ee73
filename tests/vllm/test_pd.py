"""Prefill/decode disaggregation with vLLM: a scheduler, a prefill node and a decode node
(each beside its own `vllm serve`), both read paths and a real split read into vLLM's
KV cache, against the single-instance oracle (vLLM's own prefix cache).

Every turn goes through the scheduler: the prefill node stages the hit (its own reads,
the decode node's, or both), drives its instance for the prompt, and sends every prompt
block to the decode node's buffer, its partial last block too; the decode node's
instance loads them all and computes the first token only, then generates. Equal greedy
tokens and logprobs within conftest.TOL (the split reads, the recomputes after a fault
and the partial block computed again where it did not come are other computation splits
than the oracle's) mean the KV that crossed both nodes is the KV; a flipped byte, or a
first token's KV overwritten by a late copy of its block, is far outside it (0.1 in
logprob at the second token, measured when the partial block loaded layer by layer).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from dualpath import cpus
from dualpath.cluster.run import make_trace
from dualpath.cluster.vllm_node import ENGINE_ENV, PlainVllm, engine_args
from dualpath.cluster.vllm_pd import VllmPdCluster
from dualpath.scheduler.generate import Generator
from dualpath.trace.model import stream_token_ids
from dualpath.v1 import admin_pb2, scheduler_pb2
from dualpath.vllm.driver import EngineProcess
from tests.faults.conftest import wait_idle_invariant
from tests.vllm.conftest import TOL, Conversation, close

T = 128
API_KEY = "test-key-0123456789abcdef"
BLOCK_BYTES = 4 * T * 256          # a Full Block of the tiny model
# A first turn whose prompt ends 8 tokens short of a block: its 16 generated tokens fill
# that block on the decode instance, so the next turn's hit holds a block the prefill
# instance never computed. Its own prefix cache cannot serve the whole hit
# (engines/vllm/instance_cache.py), the prefill stages it from the slow store, and a kill aimed
# at that prefill finds it still running.
FIRST_PAST_THE_PE = 16 * T - 8


class Rig:
    def __init__(self, pd: VllmPdCluster, oracle: EngineProcess):
        self.pd, self.oracle = pd, oracle
        self.loop = asyncio.new_event_loop()
        c = pd.cluster
        self.gen = self.loop.run_until_complete(
            Generator(c.scheduler_address, c.client_tls, c.node_tls).start())
        self.n = 0

    def rid(self) -> str:
        self.n += 1
        return f"pd-{self.n}"

    def turn(self, prompt: list[int], gen: int, hit: int, policy: str = "scheduler",
             during=None) -> dict:
        """One request through the scheduler; ``during(view)`` runs (in a thread) once
        the scheduler shows it in the state ``during.state``."""
        rid = self.rid()

        async def go():
            watch = None
            if during is not None:
                # The watcher's admin channel is up (one answered call) before the request
                # is submitted: a short state cannot pass while its TLS handshake runs.
                ready = threading.Event()
                watch = asyncio.ensure_future(asyncio.to_thread(
                    during.wait, self.pd, rid, ready))
                await asyncio.to_thread(ready.wait, 60)
            task = asyncio.ensure_future(self.gen.generate(
                rid, prompt, gen, hit_tokens=hit, block_tokens=T, read_policy=policy,
                timeout_s=300))
            if watch is not None:
                view = await watch
                if view is not None:
                    await asyncio.to_thread(during, view)
            return await task
        g = self.loop.run_until_complete(go())
        return {"token_ids": g.token_ids, "logprobs": g.logprobs, "g": g}

    def close(self) -> None:
        self.loop.run_until_complete(self.gen.close())
        self.loop.close()
        self.pd.stop()
        self.pd.cleanup()


def _wait_state(pd: VllmPdCluster, rid: str, state: int, bound_s: float = 120.0,
                ready: threading.Event | None = None):
    """The scheduler's view of ``rid`` once it is in ``state`` (None if it ended first,
    or never showed in 5 s); ``ready`` is set once the first call was answered."""
    stub, ch = pd.admin()
    try:
        start = time.monotonic()
        deadline = start + bound_s
        seen = False
        while time.monotonic() < deadline:
            views = stub.ListRequests(admin_pb2.ListRequestsRequest(all=True),
                                      timeout=5).requests
            if ready is not None and not ready.is_set():
                ready.set()
                start = time.monotonic()
            v = next((v for v in views if v.request_id == rid), None)
            if v is not None and v.state == state:
                return v
            seen = seen or v is not None
            if v is None and (seen or time.monotonic() > start + 5):
                return None
            time.sleep(0.02)
        raise AssertionError(f"{rid} never reached state {state}")
    finally:
        ch.close()


@pytest.fixture(scope="module")
def oracle(tmp_path_factory, model_dirs):
    e = EngineProcess(engine_args(model_dirs["tiny"], prefix_caching=True,
                                  max_model_len=8192),
                      tmp_path_factory.mktemp("oracle") / "oracle.log", env=ENGINE_ENV)
    yield e
    e.close()


@pytest.fixture(scope="module", params=["1p1d", "1p2d"])
def rig(request, tmp_path_factory, model_dirs, oracle):
    tmp = tmp_path_factory.mktemp(request.param)
    # A slow storage NIC (6 MB/s) keeps a 2K-token hit's read in flight for a while, so a
    # kill lands in the middle of a request; the outputs do not depend on it.
    key = tmp / "api.key"
    key.write_text(API_KEY)
    pd = VllmPdCluster(model_dirs["tiny"], decode_nodes=int(request.param[2]),
                       work_dir=str(tmp / "cluster"),
                       settings={"storage": {"snic_gbit_per_s": 0.05}},
                       frontend={"api_key_file": str(key), "max_body_bytes": 65536,
                                 "max_prompt_tokens": 3000, "max_tokens": 64}
                       if request.param == "1p1d" else None).start()
    r = Rig(pd, oracle)
    r.topology, r.api_key_file = request.param, key
    yield r
    r.close()


def _reads(g, stored: int, prompt: int, policy: str) -> None:
    """Who read the hit from storage: the side(s) the policy forced, all of it."""
    hit_bytes = min(stored // T, (prompt - 1) // T) * BLOCK_BYTES
    pe, de = g.prefill_read_bytes, g.decode_read_bytes
    assert pe + de == hit_bytes, (policy, pe, de, hit_bytes)
    if policy == "prefill":
        assert de == 0
    elif policy == "decode":
        assert pe == 0
    elif policy == "split":
        assert pe > 0 and de > 0


def test_a_pd_conversation_is_the_oracle_on_every_read_path(rig):
    """Turn 1 computes everything; then the PE read, the DE read, the split read and
    the scheduler's own choice, each the oracle's output, each read by the side(s) it
    names."""
    conv = Conversation(seed=101, first=300, append=200, gen=16)
    stored = 0
    decoders = [n for n in rig.pd.metrics_ports if n.startswith("d")]

    def partial_loaded() -> float:
        return sum(rig.pd.node_metrics(n).get(
            "dualpath_node_partial_prompt_blocks_loaded_total", 0.0) for n in decoders)
    for policy in ("scheduler", "prefill", "decode", "split", "scheduler"):
        prompt = list(conv.context)
        before = partial_loaded()
        a = rig.turn(prompt, conv.gen, stored, policy)
        b = rig.oracle.generate(prompt, conv.gen)
        assert close(a, b), (policy, a, b)     # the decode instance's split differs
        _reads(a["g"], stored, len(prompt), policy)
        # The prompt's partial last block came from the prefill and was loaded: the
        # decode instance computed the first token only.
        assert len(prompt) % T and partial_loaded() - before == 1, policy
        stored = len(prompt) + conv.gen - 1
        conv.advance(a["token_ids"])
    # Every WRITE of every path landed inside the scope its peer granted it (a refused
    # one would have ended in a recompute, which the tokens above would not show).
    for n in rig.pd.metrics_ports:
        m = rig.pd.node_metrics(n)
        assert m["dualpath_node_data_writes_refused_total"] == 0, n
        assert m["dualpath_node_data_writes_out_of_scope_total"] == 0, n


class _At:
    """``during`` for :meth:`Rig.turn`: ``action(view)`` once the request is in
    ``state`` (after ``delay_s``)."""

    def __init__(self, state: int, action, delay_s: float = 0.0):
        self.state, self.action, self.delay_s = state, action, delay_s
        self.fired = False

    def wait(self, pd: VllmPdCluster, rid: str, ready: threading.Event):
        return _wait_state(pd, rid, self.state, ready=ready)

    def __call__(self, view) -> None:
        time.sleep(self.delay_s)
        self.action(view)
        self.fired = True


class _Staging(_At):
    """``action(None)`` once ``node`` holds slots of its buffer for a request: its stage
    of a hit is under way (the scheduler's state lags what a node does by up to a fetch
    interval, so "assigned" alone may come after the prefill ended)."""

    def __init__(self, node: str, action):
        super().__init__(scheduler_pb2.REQUEST_STATE_ASSIGNED, action)
        self.node = node

    def wait(self, pd: VllmPdCluster, rid: str, ready: threading.Event):
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            m = pd.node_metrics(self.node)
            ready.set()
            if m["dualpath_node_buffer_free_blocks"] < m["dualpath_node_buffer_capacity_blocks"]:
                return True
            time.sleep(0.01)
        raise AssertionError(f"{self.node} never staged a hit for {rid}")


def _node_of(engine_id: str) -> str:
    return engine_id.split("/")[0]


def pe_read_under_fault(rig, fault: str, seed: int) -> tuple[dict, dict]:
    """A turn computed, then the prefill node restarted with ``fault`` (a negative
    control) and the next turn's hit read by it: (that turn's output, the oracle's).
    The node is restarted without the fault after."""
    conv = Conversation(seed=seed, first=300, append=200, gen=8)
    prompt = list(conv.context)
    a = rig.turn(prompt, conv.gen, 0)
    stored = len(prompt) + conv.gen - 1
    conv.advance(a["token_ids"])
    rig.pd.restart_node("p0", env={"DUALPATH_FAULTS": fault})
    try:
        prompt = list(conv.context)
        bad = rig.turn(prompt, conv.gen, stored, "prefill")
        assert bad["g"].prefill_read_bytes > 0
        return bad, rig.oracle.generate(prompt, conv.gen)
    finally:
        rig.pd.restart_node("p0")


@pytest.mark.parametrize("rig", ["1p1d"], indirect=True)
def test_negative_control_a_flipped_byte_on_the_pe_read_is_seen(rig):
    """The comparison above would catch a wrong byte: the prefill node restarted with a
    bit flipped in every hit block it reads (after its checksum passed) gives other
    logprobs than the oracle on a PE-read turn."""
    bad, ref = pe_read_under_fault(rig, "load_flip_byte", 303)
    assert not close(bad, ref)


def test_sigkill_of_a_decode_daemon_mid_decode_ends_in_a_recompute(rig):
    """The decode node of a request is SIGKILLed while it decodes: the scheduler runs
    the request again (another decode node, or the restarted one) and its tokens and
    logprobs are still the oracle's."""
    conv = Conversation(seed=404, first=600, append=300, gen=16)
    prompt = list(conv.context)
    a = rig.turn(prompt, conv.gen, 0)
    stored = len(prompt) + conv.gen - 1
    conv.advance(a["token_ids"])
    prompt = list(conv.context)
    victim: list[str] = []

    def kill(view) -> None:
        victim.append(_node_of(view.decode_engine_id))
        rig.pd.kill_node(victim[0])
        if rig.topology == "1p1d":          # no other decode node: bring it back
            rig.pd.restart_node(victim[0])
    at = _At(scheduler_pb2.REQUEST_STATE_PREFILL_DONE, kill)
    gen = 1200                               # seconds of decode: the kill lands in it
    b = rig.turn(prompt, gen, stored, during=at)
    ref = rig.oracle.generate(prompt, gen)
    assert at.fired and b["g"].attempt >= 2, "the kill did not hit a running decode"
    assert close(b, ref)
    if rig.topology == "1p2d":
        assert b["g"].decode_node_id != victim[0]
        rig.pd.restart_node(victim[0])
    wait_idle_invariant(rig.pd.cluster)     # nothing leaked on either node


@pytest.mark.parametrize("rig", ["1p1d"], indirect=True)
def test_sigkill_of_the_prefill_daemon_mid_prefill_ends_in_a_recompute(rig):
    """The prefill node daemon is SIGKILLed while its prefill stages the hit (its
    instance keeps running, its connector's node gone) and started again: the request's
    next attempt gives the oracle's tokens and logprobs, and once idle no node holds
    anything."""
    conv = Conversation(seed=707, first=FIRST_PAST_THE_PE, append=300, gen=16)
    prompt = list(conv.context)
    a = rig.turn(prompt, conv.gen, 0)
    stored = len(prompt) + conv.gen - 1
    conv.advance(a["token_ids"])
    prompt = list(conv.context)

    def kill(view) -> None:
        rig.pd.kill_node("p0")
        rig.pd.restart_node("p0")
    at = _Staging("p0", kill)
    b = rig.turn(prompt, conv.gen, stored, "prefill", during=at)
    assert at.fired and b["g"].attempt >= 2, "the kill did not hit a running prefill"
    assert close(b, rig.oracle.generate(prompt, conv.gen))
    wait_idle_invariant(rig.pd.cluster)


@pytest.mark.parametrize("rig", ["1p1d"], indirect=True)
@pytest.mark.parametrize("side", ["decode", "prefill"])
def test_sigkill_of_a_vllm_instance_mid_request_ends_in_a_recompute(rig, side):
    """The decode instance (while it decodes) or the prefill instance (while its
    prefill waits for the staged hit) is SIGKILLed and started again: its node hands
    its group back while the instance does not answer (the request waits in the
    scheduler's queue instead of spending its retries), registers again once it does,
    and the request's next attempt gives the oracle's tokens and logprobs."""
    conv = Conversation(seed=505 if side == "decode" else 606, first=FIRST_PAST_THE_PE,
                        append=300, gen=16)
    prompt = list(conv.context)
    a = rig.turn(prompt, conv.gen, 0)
    stored = len(prompt) + conv.gen - 1
    conv.advance(a["token_ids"])
    prompt = list(conv.context)
    node = "d0" if side == "decode" else "p0"
    at = (_At(scheduler_pb2.REQUEST_STATE_PREFILL_DONE,
              lambda view: rig.pd.restart_instance(node), delay_s=0.3)
          if side == "decode" else
          _Staging(node, lambda view: rig.pd.restart_instance(node)))
    gen = 1200 if side == "decode" else 16
    b = rig.turn(prompt, gen, stored, "prefill", during=at)
    assert at.fired and b["g"].attempt >= 2, "the kill did not hit a running request"
    assert close(b, rig.oracle.generate(prompt, gen))
    wait_idle_invariant(rig.pd.cluster)


# ------------------------------------------------------------------ the front end

def _http(rig, path: str, body=None, *, key: str | None = API_KEY, raw: bytes | None = None):
    """(status, parsed JSON or the list of SSE events) of one call to the front end."""
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None
                                        else None)
    req = urllib.request.Request(rig.pd.frontend_url + path, data=data, headers=headers,
                                 method="POST" if data is not None else "GET")
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            text = r.read().decode()
            status = r.status
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read().decode())
    if text.startswith("data:"):
        events = [line[5:].strip() for line in text.splitlines() if line.startswith("data:")]
        assert events[-1] == "[DONE]"
        return status, [json.loads(e) for e in events[:-1]]
    return status, json.loads(text)


def _allowed(pid: int) -> dict[int, set[int]]:
    """thread id -> the cores it may run on, for every thread of ``pid``."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as fh:
                line = next(x for x in fh if x.startswith("Cpus_allowed_list:"))
        except (FileNotFoundError, ProcessLookupError):
            continue                    # the thread ended between the listing and here
        out[int(tid)] = set(cpus.parse_cpus(line.split(":", 1)[1]))
    return out


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as fh:
        kids = [int(x) for x in fh.read().split()]
    return kids + [g for k in kids for g in _children(k)]


def test_every_process_runs_on_the_cores_the_plan_gives_it(rig):
    """The scheduler, the node daemons (restarted ones too: the kill tests ran), the
    front end and vLLM's API servers run on the plan's control cores; each instance's
    engine computes on its own cores, which none of them shares where the host has a
    core to spare."""
    pd, plan = rig.pd, rig.pd.core_plan
    control = set(plan.control)
    procs = {"scheduler": pd.cluster.scheduler.pid,
             **{n.node_id: n.proc.pid for n in pd.cluster.nodes},
             **{f"vllm-{nid}": i.proc.pid for nid, i in pd.instances.items()}}
    if pd.frontend is not None:
        procs["frontend"] = pd.frontend.pid
    for name, pid in procs.items():
        threads = _allowed(pid)
        assert all(a == control for a in threads.values()), (name, control, threads)
    for nid, inst in pd.instances.items():
        own = set(cpus.parse_cpus(pd.cores[nid]))
        engine = [t for k in _children(inst.proc.pid) for t in _allowed(k).values()]
        assert own in engine, (nid, own, engine)     # its OpenMP thread, on its cores
    computing = {c for part in pd.cores.values() for c in cpus.parse_cpus(part)}
    if len(os.sched_getaffinity(0)) > len(pd.cores):       # cores of their own
        assert not computing & control, (computing, control)


@pytest.mark.parametrize("rig", ["1p1d"], indirect=True)
def test_front_end_token_id_completions_are_the_oracle_streamed_or_not(rig):
    conv = Conversation(seed=707, first=300, append=100, gen=12)
    for _ in range(2):                      # the second turn hits what the first stored
        prompt = list(conv.context)
        body = {"model": "tiny", "prompt": prompt, "max_tokens": conv.gen,
                "temperature": 0, "logprobs": 1, "ignore_eos": True}
        st, out = _http(rig, "/v1/completions", body)
        assert st == 200, out
        ref = rig.oracle.generate(prompt, conv.gen)
        c = out["choices"][0]
        assert c["token_ids"] == ref["token_ids"]
        assert c["logprobs"]["token_logprobs"] == ref["logprobs"]
        assert out["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": conv.gen,
                                "total_tokens": len(prompt) + conv.gen}
        assert c["finish_reason"] == "length"
        st, events = _http(rig, "/v1/completions", {**body, "stream": True,
                                                    "stream_options": {"include_usage": True}})
        assert st == 200
        ids = [t for e in events for ch in e["choices"] for t in ch["token_ids"]]
        assert ids == ref["token_ids"]
        assert "".join(ch["text"] for e in events for ch in e["choices"]) == c["text"]
        assert events[-1]["usage"]["completion_tokens"] == conv.gen
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        conv.advance(c["token_ids"])
    def loaded() -> bool:                  # vLLM logs its connector's stats every 10 s
        log = (rig.pd.dir / "logs" / "vllm-p0.log").read_text()
        return any("KV Transfer metrics" in line and "loads=0," not in line
                   for line in log.splitlines())
    deadline = time.monotonic() + 30
    while not loaded() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert loaded(), "the front end's hits never came through DualPath"


@pytest.mark.parametrize("rig", ["1p1d"], indirect=True)
def test_replay_with_real_tokens_through_the_front_end_is_the_oracle(rig, model_dirs,
                                                                     tmp_path):
    """`dualpath replay --engine vllm --url`: Table 2 trajectories as token-id prompts
    (A.3: each round's prompt = the previous one + the tokens generated + the appended
    ones); every round's tokens are the oracle's for the prompt that rule builds."""
    out = tmp_path / "replay.json"
    args = ["--agents", "2", "--max-rounds", "2", "--context-scale", "0.06", "--seed", "5"]
    proc = subprocess.run(
        [sys.executable, "-m", "dualpath.cli", "replay", "--engine", "vllm",
         "--url", rig.pd.frontend_url, "--model", str(model_dirs["tiny"]),
         "--served-model", "tiny", "--api-key-file", str(rig.api_key_file),
         "--json", str(out), *args], check=False, capture_output=True, text=True,
        timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rec = json.loads(out.read_text())
    assert rec["summary"]["rounds"] == 4 and rec["engine"] == "vllm"
    vocab = json.loads((model_dirs["tiny"] / "config.json").read_text())["vocab_size"]
    trace = make_trace(2, table="32k", context_scale=0.06, max_rounds=2, seed=5)
    rounds = {(r["trajectory"], r["round"]): r for r in rec["rounds"]}
    for traj in trace.trajectories:
        context: list[int] = []
        pos = 0
        for k, r in enumerate(traj.rounds):
            prompt = context + (stream_token_ids(traj, pos, pos + r.append_tokens)
                                % vocab).tolist()
            pos += r.append_tokens + r.gen_tokens
            got = rounds[(traj.id, k)]
            assert got["prompt_tokens"] == len(prompt)
            assert got["token_ids"] == rig.oracle.generate(prompt, r.gen_tokens)["token_ids"]
            context = prompt + got["token_ids"]


@pytest.mark.parametrize("rig", ["1p1d"], indirect=True)
def test_the_front_end_says_what_happened_to_each_request(rig):
    """Headers on an answer, a comment line in a stream, and the front end's /metrics:
    the read side, the hit, the bytes read and the nodes of each request."""
    conv = Conversation(seed=909, first=400, append=100, gen=4)
    seen = []
    for _ in range(2):
        prompt = list(conv.context)
        body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": conv.gen,
                           "temperature": 0}).encode()
        req = urllib.request.Request(rig.pd.frontend_url + "/v1/completions", body, {
            "Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
        with urllib.request.urlopen(req, timeout=300) as r:
            out = json.loads(r.read())
            seen.append(dict(r.headers))
        conv.advance(out["choices"][0]["token_ids"])
    first, second = seen
    assert first["X-DualPath-Hit-Tokens"] == "0" and first["X-DualPath-Read-Side"] == "none"
    assert int(second["X-DualPath-Hit-Tokens"]) >= 3 * T      # the first turn's blocks
    assert second["X-DualPath-Read-Side"] in ("prefill", "decode", "split", "none")
    assert (second["X-DualPath-Prefill-Node"], second["X-DualPath-Decode-Node"]) == \
        ("p0", "d0")
    assert second["X-DualPath-Attempt"] == "1"
    req = urllib.request.Request(rig.pd.frontend_url + "/v1/completions", json.dumps({
        "model": "tiny", "prompt": conv.context, "max_tokens": 2, "temperature": 0,
        "stream": True}).encode(), {"Content-Type": "application/json",
                                    "Authorization": f"Bearer {API_KEY}"})
    with urllib.request.urlopen(req, timeout=300) as r:
        lines = r.read().decode().splitlines()
    note = [json.loads(x[len(": dualpath "):]) for x in lines if x.startswith(": dualpath ")]
    assert len(note) == 1 and note[0]["decode_node"] == "d0"
    assert note[0]["hit_tokens"] >= 3 * T
    with urllib.request.urlopen(rig.pd.frontend_url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    assert 'dualpath_frontend_requests_total{status="200"}' in text
    assert "dualpath_frontend_ttft_seconds_count" in text
    queued = next(float(x.split()[-1]) for x in text.splitlines()
                  if x.startswith("dualpath_frontend_queue_seconds_count "))
    assert queued >= 3                       # every served request's queue time
    hits = next(float(x.split()[-1]) for x in text.splitlines()
                if x.startswith("dualpath_frontend_hit_tokens_total "))
    assert hits >= 6 * T


@pytest.mark.parametrize("rig", ["1p1d"], indirect=True)
def test_a_prompt_over_the_context_is_refused_at_the_front_end_in_vllms_words(rig):
    st, out = _http(rig, "/v1/completions", {"model": "tiny", "prompt": [1] * 4100,
                                             "max_tokens": 4})
    assert st == 400, out
    assert out["error"]["message"].startswith(
        "This model's maximum context length is 4096 tokens. However, your prompt "
        "contains 4100 input tokens")
    assert out["error"]["code"] == "context_length_exceeded"


@pytest.mark.parametrize("rig", ["1p1d"], indirect=True)
def test_front_end_chat_and_text_prompts_stream_text(rig):
    st, out = _http(rig, "/v1/chat/completions", {
        "model": "tiny", "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 8, "temperature": 0})
    assert st == 200, out
    msg = out["choices"][0]["message"]
    assert msg["role"] == "assistant" and isinstance(msg["content"], str)
    assert 1 <= out["usage"]["completion_tokens"] <= 8
    st, events = _http(rig, "/v1/chat/completions", {
        "model": "tiny", "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 8, "temperature": 0, "stream": True})
    assert st == 200
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    streamed = "".join(e["choices"][0]["delta"].get("content", "") for e in events)
    assert streamed == msg["content"]
    st, out = _http(rig, "/v1/completions", {"model": "tiny", "prompt": "Once upon a time",
                                             "max_tokens": 5, "temperature": 0.7,
                                             "seed": 3})
    assert st == 200 and out["object"] == "text_completion", out
    st, models_ = _http(rig, "/v1/models")
    assert st == 200 and [m["id"] for m in models_["data"]] == ["tiny"]


@pytest.mark.parametrize("rig", ["1p1d"], indirect=True)
@pytest.mark.parametrize("case", ["no_key", "wrong_key", "unknown_field", "wrong_model",
                                  "too_long", "too_many_tokens", "not_json", "too_big",
                                  "greedy_n2", "bad_messages"])
def test_front_end_bad_input_gets_an_openai_error_naming_it(rig, case):
    ok = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 4}
    call = {
        "no_key": (401, {"body": ok, "key": None}, "invalid_api_key"),
        "wrong_key": (401, {"body": ok, "key": "x" * 24}, "invalid_api_key"),
        "unknown_field": (400, {"body": {**ok, "best_of": 2}}, "best_of"),
        "wrong_model": (404, {"body": {**ok, "model": "gpt-9"}}, "gpt-9"),
        "too_long": (400, {"body": {**ok, "prompt": [1] * 3001}}, "3001"),
        "too_many_tokens": (400, {"body": {**ok, "max_tokens": 65}}, "max_tokens"),
        "not_json": (400, {"raw": b"{not json"}, "JSON"),
        "too_big": (413, {"raw": b" " * 70000}, "65536"),
        "greedy_n2": (400, {"body": {**ok, "n": 2, "temperature": 0}}, "greedy"),
        "bad_messages": (400, {"body": {"model": "tiny", "messages": [{"role": "robot",
                                                                       "content": "hi"}]},
                                   "path": "/v1/chat/completions"}, "messages[0]"),
    }[case]
    status, kw, needle = call
    path = kw.pop("path", "/v1/completions")
    st, out = _http(rig, path, **kw)
    assert st == status, out
    err = out["error"]
    assert needle in (err["message"] + str(err.get("param")) + str(err.get("code"))), err


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["through-dualpath",
                                                             "instance-cache"])
def test_concurrent_requests_on_one_stored_prefix_wait_their_turn_and_are_the_oracle(
        tmp_path_factory, model_dirs, oracle, prefix_caching):
    """K = 4 requests at once, each a 6,144-token stored prefix plus its own suffix, on
    buffers sized for 2 requests of the full context (up --concurrency 2): the others
    wait their turn in the pools. Every request is served at its first attempt with the
    oracle's tokens, no load fails, no node loses its lease, and once idle every pool
    is full again. (Before, a decode node's loads reserved a second copy of the blocks it
    held: this stalled for minutes and failed requests after five attempts.)

    With vLLM's own prefix cache on in the instances (as `up` runs them), the prefill
    instance computed the prefix first, so its node stages none of the four hits: no
    byte read from storage on either side, every hit block counted as the instance's;
    and the decode instance loaded it for the first turn, so none of it is sent to the
    decode node again; the same tokens."""
    import random

    tmp = tmp_path_factory.mktemp("load")
    pd = VllmPdCluster(model_dirs["tiny"], max_model_len=8192, concurrency=2,
                       work_dir=str(tmp / "cluster"), prefix_caching=prefix_caching).start()
    r = Rig(pd, oracle)
    try:
        assert pd.buffers.request_blocks == 65
        rng = random.Random(35)
        prefix = [rng.randrange(49152) for _ in range(6144)]
        r.turn(prefix, 2, 0)                           # computes and stores the prefix
        pd.wait_written()
        prompts = [prefix + [rng.randrange(49152) for _ in range(100)] for _ in range(4)]

        async def together():
            return await asyncio.gather(*(r.gen.generate(
                f"k{i}", p, 8, hit_tokens=len(prefix), block_tokens=T, timeout_s=300)
                for i, p in enumerate(prompts)))
        got = r.loop.run_until_complete(together())
        for p, g in zip(prompts, got):
            assert g.attempt == 1, g
            # Read from storage, or (a DE read) copied from blocks the decode node still
            # holds for another of them: never more than the hit.
            assert g.prefill_read_bytes + g.decode_read_bytes <= 48 * BLOCK_BYTES
            if prefix_caching:
                assert g.prefill_read_bytes == g.decode_read_bytes == 0, g
            ref = oracle.generate(p, 8)
            assert close({"token_ids": g.token_ids, "logprobs": g.logprobs}, ref)
        pd.wait_written()
        in_instance = pd.node_metrics("p0").get(
            "dualpath_node_hit_blocks_in_instance_cache_total", 0)
        assert in_instance == (4 * 48 if prefix_caching else 0)
        # The decode instance loaded the prefix for the first turn: none of it is sent
        # again.
        held = pd.node_metrics("d0").get(
            "dualpath_node_prompt_blocks_held_by_instance_total", 0)
        assert held == (4 * 48 if prefix_caching else 0)
        for nid in ("p0", "d0"):
            assert pd.registrations(nid) == 1, f"{nid} registered again (lost its lease)"
            m = pd.node_metrics(nid)
            assert m.get("dualpath_node_connector_load_failed_blocks_total", 0) == 0
            assert m.get("dualpath_node_hit_blocks_recomputed_total", 0) == 0
            deadline = time.monotonic() + 60
            while (m["dualpath_node_buffer_free_blocks"]
                   != m["dualpath_node_buffer_capacity_blocks"]):
                assert time.monotonic() < deadline, (nid, m)
                time.sleep(0.2)
                m = pd.node_metrics(nid)
            assert m["dualpath_node_buffer_waiting_reservations"] == 0
        log = (pd.dir / "logs" / "vllm-d0.log").read_text()
        assert "did not load" not in log and "made no progress" not in log
    finally:
        r.close()


@pytest.fixture(scope="module")
def plain(tmp_path_factory, model_dirs):
    """Plain vLLM's own OpenAI server on the tiny model (prefix cache on, one core, as
    each of DualPath's instances): the reference for the API."""
    v = PlainVllm(model_dirs["tiny"], 4096, 1, tmp_path_factory.mktemp("plain"), "0").start()
    yield v
    v.stop()


def _same(a, b, what: str) -> None:
    """Every answer field vLLM's server and the front end both define, equal (greedy)."""
    ca, cb = a.choices[0], b.choices[0]
    if hasattr(ca, "message"):
        assert (ca.message.role, ca.message.content) == (cb.message.role, cb.message.content), \
            what
    else:
        assert ca.text == cb.text, what
    assert (ca.index, ca.finish_reason) == (cb.index, cb.finish_reason), what
    assert a.usage.model_dump() == b.usage.model_dump(), what
    assert (a.object, a.model) == (b.object, b.model), what


@pytest.mark.parametrize("rig", ["1p1d"], indirect=True)
def test_the_openai_api_answers_as_vllms_own_server(rig, plain):
    """The same requests, through the official `openai` client, to DualPath's front end
    and to plain vLLM's server on the same model: answers equal field by field (greedy
    tokens, text, finish_reason, usage), with vLLM's sampling fields, nulls, stop
    strings and token ids, chat content parts."""
    import openai

    dp = openai.OpenAI(base_url=rig.pd.frontend_url + "/v1", api_key=API_KEY, max_retries=0)
    ref = openai.OpenAI(base_url=plain.url + "/v1", api_key="unused", max_retries=0)
    conv = Conversation(seed=4242, first=300, append=50, gen=24)
    prompt = list(conv.context)
    base = {"model": "tiny", "prompt": prompt, "max_tokens": 24, "temperature": 0}
    cases = {
        "plain": {},
        "nulls and offs": {"presence_penalty": 0, "frequency_penalty": 0, "top_p": None,
                           "seed": None, "user": None, "logprobs": None, "n": 1},
        "sampling": {"extra_body": {"top_k": 1, "min_p": 0.0, "repetition_penalty": 1.0,
                                    "min_tokens": 4}},
    }
    first = None
    for what, kw in cases.items():
        a = dp.completions.create(**base, **kw)
        b = ref.completions.create(**base, **kw)
        _same(a, b, what)
        first = first or b
    # A stop string and a stop token taken from vLLM's own answer end both early.
    text = first.choices[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    if stop.strip():
        a = dp.completions.create(**base, stop=[stop])
        b = ref.completions.create(**base, stop=[stop])
        _same(a, b, f"stop {stop!r}")
        assert b.choices[0].finish_reason == "stop"
    got = ref.completions.create(**base, extra_body={"return_token_ids": True})
    tok = (got.choices[0].model_extra or {}).get("token_ids")
    assert tok and len(tok) == 24, got
    a = dp.completions.create(**base, extra_body={"stop_token_ids": [tok[5]]})
    b = ref.completions.create(**base, extra_body={"stop_token_ids": [tok[5]]})
    _same(a, b, "stop_token_ids")
    assert a.choices[0].finish_reason == "stop" and a.usage.completion_tokens <= 6
    # logit_bias: the greedy first token banned on both instances, as on vLLM's one.
    ban = {str(tok[0]): -100}
    a = dp.completions.create(**base, logit_bias=ban, extra_body={"return_token_ids": True})
    b = ref.completions.create(**base, logit_bias=ban, extra_body={"return_token_ids": True})
    _same(a, b, "logit_bias")
    assert tok[0] not in (a.choices[0].model_extra or {}).get("token_ids", [])
    # response_format text is plain text (JSON formats are refused, naming the field).
    _same(dp.completions.create(**base, extra_body={"response_format": {"type": "text"}}),
          ref.completions.create(**base, extra_body={"response_format": {"type": "text"}}),
          "response_format text")
    # A batch of prompts: one choice per prompt, usage summed.
    other = Conversation(seed=77, first=200, append=10, gen=8).context
    batch = {**base, "prompt": [prompt, other]}
    _same_batch(dp.completions.create(**batch), ref.completions.create(**batch))
    # Chat: content as text parts, streamed or not.
    msgs = [{"role": "user", "content": [{"type": "text", "text": "Say"},
                                         {"type": "text", "text": "hello."}]}]
    a = dp.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0)
    b = ref.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0)
    _same(a, b, "chat parts")
    sa = "".join(c.choices[0].delta.content or "" for c in dp.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=8, temperature=0, stream=True)
        if c.choices)
    assert sa == b.choices[0].message.content
    _same_logprobs_echo_and_n(dp, ref, base, msgs)


def _close_map(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(abs(a[k] - b[k]) <= TOL for k in a)


def _same_logprobs_echo_and_n(dp, ref, base: dict, msgs: list) -> None:
    import openai

    """Top logprobs as text (completions: tokens, text_offset, the N + 1 alternatives;
    chat: tokens, bytes, the N alternatives), echo, and n choices (also streamed), as
    vLLM's server gives them (logprobs within TOL: the decode instance computes the
    last block apart)."""
    a = dp.completions.create(**base, logprobs=3)
    b = ref.completions.create(**base, logprobs=3)
    _same(a, b, "logprobs=3")
    la, lb = a.choices[0].logprobs, b.choices[0].logprobs
    assert la.tokens == lb.tokens and la.text_offset == lb.text_offset
    assert all(abs(x - y) <= TOL for x, y in zip(la.token_logprobs, lb.token_logprobs))
    assert len(la.top_logprobs) == len(lb.top_logprobs) == 24
    assert all(_close_map(x, y) for x, y in zip(la.top_logprobs, lb.top_logprobs)), \
        (la.top_logprobs[:2], lb.top_logprobs[:2])
    chat = {"model": "tiny", "messages": msgs, "max_tokens": 8, "temperature": 0,
            "logprobs": True, "top_logprobs": 2}
    a, b = dp.chat.completions.create(**chat), ref.chat.completions.create(**chat)
    _same(a, b, "chat top_logprobs=2")
    ca, cb = a.choices[0].logprobs.content, b.choices[0].logprobs.content
    assert [(x.token, x.bytes) for x in ca] == [(x.token, x.bytes) for x in cb]
    assert [[(t.token, t.bytes) for t in x.top_logprobs] for x in ca] == \
        [[(t.token, t.bytes) for t in x.top_logprobs] for x in cb]
    assert all(abs(x.logprob - y.logprob) <= TOL for x, y in zip(ca, cb))
    # Tools, as vLLM's server takes them without a tool-call parser: into the template.
    tool = {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
    chat = {"model": "tiny", "messages": msgs, "max_tokens": 8, "temperature": 0,
            "tools": [tool], "tool_choice": "none"}
    _same(dp.chat.completions.create(**chat), ref.chat.completions.create(**chat), "tools")
    del chat["tool_choice"]             # "auto": vLLM's 400 without a tool-call parser
    for client in (dp, ref):
        with pytest.raises(openai.BadRequestError, match="enable-auto-tool-choice"):
            client.chat.completions.create(**chat)
    # Echo: the prompt's text first (a text prompt, as a user sends it).
    text = {**base, "prompt": "The capital of France is", "max_tokens": 8}
    _same(dp.completions.create(**text, echo=True), ref.completions.create(**text, echo=True),
          "echo")
    # n = 2: refused when greedy, as vLLM refuses it; sampled, two choices (their tokens
    # are not vLLM's: the decode instance's random stream starts after the first token),
    # whole and streamed, usage counting the prompt once.
    for client in (dp, ref):
        with pytest.raises(openai.BadRequestError, match="greedy"):
            client.completions.create(**base, n=2)
    sampled = {**base, "temperature": 0.8, "seed": 7, "n": 2,
               "extra_body": {"ignore_eos": True, "return_token_ids": True}}
    a = dp.completions.create(**sampled)
    b = ref.completions.create(**sampled)
    assert [c.index for c in a.choices] == [c.index for c in b.choices] == [0, 1]
    assert a.usage.model_dump() == b.usage.model_dump()
    streamed = {0: [], 1: []}
    for c in dp.completions.create(**sampled, stream=True):
        for ch in c.choices:
            streamed[ch.index] += (ch.model_extra or {}).get("token_ids") or []
    assert [len(streamed[i]) for i in (0, 1)] == [24, 24]


def _same_batch(a, b) -> None:
    assert [(c.index, c.text, c.finish_reason) for c in a.choices] == \
        [(c.index, c.text, c.finish_reason) for c in b.choices]
    assert a.usage.model_dump() == b.usage.model_dump()
