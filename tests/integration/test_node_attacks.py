"""Attacks on a node daemon's services, from a network namespace of the test's own
(tests/netns.py): a real DE node daemon (emulated engine, mutual TLS with a throw-away
PKI) listens on the victim namespace's veth address; attackers run as processes in the
attacker namespace with no certificate, one of a foreign CA, a client's, or another
node's.

- Without a cluster certificate nothing completes: ExchangeEndpoint (which hands out
  region keys and data-plane credentials) and PrepareRequest fail at the handshake.
- A client identity may read StorageReads, ForwardSteps and Holdings, nothing node-to-node
  (PERMISSION_DENIED).
- A request prepared by node p0 cannot be ordered, watched, finished or cancelled by
  node p1, nor prepared again by it (PERMISSION_DENIED).
- 2,000 idle connections to the node's data port keep its descriptors bounded and its
  health check answering (a liveness check with a generous deadline, not a timing).
On 676dc5a the same attacker without any certificate got every region's address,
length and rkey from ExchangeEndpoint over plaintext, and PrepareRequest filled the DE
buffer for it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from dualpath import tls
from dualpath.cluster.local import free_port, write_toml
from tests import netns

WAIT_S = 60.0
#: The victim's engine.prepare_ttl_s (no scheduler ever assigns it anything): long enough
#: for a test's few calls after a prepare, short enough to watch one expire.
PREPARE_TTL_S = 10.0

ATTACKER = r'''
import json, sys, grpc
from dualpath import tls
from dualpath.paths.payload import Payload
from dualpath.v1 import engine_pb2, engine_pb2_grpc, node_pb2, node_pb2_grpc
from dualpath.v1 import connector_pb2, connector_pb2_grpc
from dualpath.transfer import oob
spec = json.loads(sys.argv[1])
addr = spec["addr"]
if spec.get("cert"):
    creds = grpc.ssl_channel_credentials(open(spec["ca"], "rb").read(),
                                         open(spec["key"], "rb").read(),
                                         open(spec["cert"], "rb").read())
    ch = grpc.secure_channel(addr, creds)
else:
    ch = grpc.insecure_channel(addr)
eng, node = engine_pb2_grpc.EngineStub(ch), node_pb2_grpc.NodeStub(ch)
payload = Payload("t", 0, prompt_tokens=spec.get("payload_tokens", 100), hit_tokens=0,
                  gen_tokens=1).encode()
def call(name, fn):
    if name not in spec.get("calls", [name]):
        return {"ok": None}
    try:
        r = fn()
        out = {"ok": True, "reply": str(r)[:300]}
        if hasattr(r, "fenced_blocks"):             # Holdings
            out.update(requests=r.requests, fenced=r.fenced_blocks,
                       free=sum(p.free_blocks for p in r.pools))
        return out
    except grpc.RpcError as e:
        return {"ok": False, "code": e.code().name, "details": (e.details() or "")[:200]}
out = {}
req = oob.ConnectRequest("attacker:1", "tcp", (0,), (b"",))
out["exchange"] = call("exchange", lambda: eng.ExchangeEndpoint(
    engine_pb2.ExchangeEndpointRequest(caller=engine_pb2.DataPlaneEndpoint(
        engine_id="x", transport="tcp", endpoint=oob.encode(req))), timeout=10))
rid = spec.get("request", "r-attack")
out["prepare"] = call("prepare", lambda: node.PrepareRequest(node_pb2.PrepareRequestRequest(
    request_id=rid, decode_engine_id="d0/e0",
    prefill_control_address=spec.get("prefill", "10.0.0.1:1"),
    prompt_tokens=spec.get("prompt_tokens", 100), hit_tokens=0,
    payload=payload), timeout=10))
out["done"] = call("done", lambda: node.PrefillDone(node_pb2.PrefillDoneRequest(
    request_id=rid), timeout=10))
out["watch"] = call("watch", lambda: list(eng.WatchTransfers(
    engine_pb2.WatchTransfersRequest(request_id=rid), timeout=10)))
out["cancel"] = call("cancel", lambda: eng.CancelRequest(
    engine_pb2.CancelRequestRequest(request_id=rid), timeout=10))
out["reads"] = call("reads", lambda: node.StorageReads(node_pb2.StorageReadsRequest(),
                                                       timeout=10))
out["steps"] = call("steps", lambda: node.ForwardSteps(node_pb2.ForwardStepsRequest(),
                                                       timeout=10))
out["holdings"] = call("holdings", lambda: node.Holdings(node_pb2.HoldingsRequest(),
                                                         timeout=10))
print(json.dumps(out))
'''

# A node admitted on the DE's data port WRITEs 4 KiB at each of ``offsets`` of its
# de_buffer, one fresh connection each (a refused WRITE puts a connection in ERR);
# ``prepare`` first prepares a request of its own (its slots and their stride printed),
# ``cancel`` ends it before the WRITEs (an old attempt's late bytes).
WRITER = r'''
import json, os, sys, grpc
from dualpath.kv import placement_wire
from dualpath.paths.payload import Payload
from dualpath.tcp import Item, TcpEngine
from dualpath.transfer import oob
from dualpath.transfer.tcp_provider import decode_address
from dualpath.v1 import engine_pb2, engine_pb2_grpc, node_pb2, node_pb2_grpc
spec = json.loads(sys.argv[1])
creds = grpc.ssl_channel_credentials(open(spec["ca"], "rb").read(),
                                     open(spec["key"], "rb").read(),
                                     open(spec["cert"], "rb").read())
ch = grpc.secure_channel(spec["addr"], creds)
eng, node = engine_pb2_grpc.EngineStub(ch), node_pb2_grpc.NodeStub(ch)
out = {}
rid = spec.get("prepare")
if rid:
    r = node.PrepareRequest(node_pb2.PrepareRequestRequest(
        request_id=rid, decode_engine_id="d0/e0", prefill_control_address="127.0.0.1:1",
        prompt_tokens=100, hit_tokens=0,
        payload=Payload("t", 0, prompt_tokens=100, hit_tokens=0, gen_tokens=1).encode()),
        timeout=10)
    out["slots"] = list(r.slots)
    out["stride"] = placement_wire.from_pb(r.buffer).group_stride
    if spec.get("order_into"):      # have the DE load into the memory at that address
        try:
            eng.SubmitTransferOrder(engine_pb2.TransferOrder(
                request_id=rid, kind=engine_pb2.TRANSFER_KIND_LOAD_HIT_KV,
                block_keys=[bytes(16)], target_peer=spec["order_into"], target=r.buffer,
                target_units=[0]), timeout=10)
            out["order"] = {"ok": True}
        except grpc.RpcError as e:
            out["order"] = {"ok": False, "code": e.code().name, "details": e.details()}
        sys.stdout.write(json.dumps(out) + "\n")
        sys.exit(0)
    if spec.get("cancel"):
        eng.CancelRequest(engine_pb2.CancelRequestRequest(request_id=rid), timeout=10)
offsets = spec.get("offsets") or [s * out["stride"] for s in out["slots"][:1]]
e = TcpEngine("127.0.0.1", 0)
src = bytearray(os.urandom(4096))
mr, cq = e.register(src), e.cq(16)
out["status"] = []
for off in offsets:
    req = oob.ConnectRequest("attacker:1", "tcp", (0,), (b"",))
    rep = oob.decode(eng.ExchangeEndpoint(engine_pb2.ExchangeEndpointRequest(
        caller=engine_pb2.DataPlaneEndpoint(engine_id="x", transport="tcp",
                                            endpoint=oob.encode(req))), timeout=10
        ).callee.endpoint)
    host, port, cred = decode_address(rep.endpoints[0])
    info = rep.regions["de_buffer"]
    conn = e.connection(cq)
    conn.connect(host, port, 10, credential=cred)
    conn.post_write([Item(mr.addr, info.addr + off, 4096, mr.lkey, info.rkey, 1)])
    (wc,) = cq.wait(10)
    out["status"].append(int(wc.status))
    conn.close()
e.close()
print(json.dumps(out))
'''

FLOOD = r'''
import socket, sys, json, time
host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
socks = []
for _ in range(n):
    s = socket.socket(); s.setblocking(False)
    try: s.connect((host, port))
    except BlockingIOError: pass
    socks.append(s)
print(json.dumps({"held": len(socks)}), flush=True)
sys.stdin.read()
'''


@pytest.fixture(scope="module")
def ns():
    yield from netns.netns_fixture("node")


@pytest.fixture(scope="module")
def victim(ns, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("node-attacks")
    pki = tls.make_cluster_pki(tmp / "tls", ["node/d0", "node/p0", "node/p1", "client/c"],
                               ips=(ns.victim_ip, "127.0.0.1"),
                               foreign=["node/p0"])
    port, data = free_port(), free_port()
    cfg = tmp / "d0.toml"
    write_toml(cfg, {"engine": {"control_listen": f"{ns.victim_ip}:{port}",
                                "decode_hbm_mib": 16, "prepare_ttl_s": PREPARE_TTL_S},
                     "transport": {"kind": "tcp"},
                     "transfer": {"tcp_listen": ns.victim_ip, "tcp_port": data},
                     "storage": {"dir": str(tmp / "kv")},
                     "buffers": {"de_buffer_mib": 8, "mlock": False},
                     "grpc": {"max_connections": 64, "handshake_timeout_s": 2.0},
                     "tls": pki.section("node/d0")})
    ready = tmp / "ready"
    log = open(tmp / "d0.log", "wb")  # noqa: SIM115 - closed at teardown
    proc = ns.popen(ns.victim, [sys.executable, "-m", "dualpath.cli", "node", "--role",
                                "decode", "--node-id", "d0", "--scheduler", "127.0.0.1:1",
                                "--config", str(cfg), "--ready-file", str(ready)],
                    stdout=log, stderr=log)
    deadline = time.monotonic() + WAIT_S
    while not ready.exists():
        assert proc.poll() is None and time.monotonic() < deadline, \
            (tmp / "d0.log").read_text()
        time.sleep(0.05)
    yield {"pki": pki, "addr": f"{ns.victim_ip}:{port}", "data_port": data, "proc": proc,
           "log": tmp / "d0.log"}
    proc.terminate()
    proc.wait(WAIT_S)
    log.close()


def _attack(ns, victim, who: str | None, request: str = "r-attack",
            calls: tuple[str, ...] | None = None, **extra) -> dict:
    pki = victim["pki"]
    spec = {"addr": victim["addr"], "request": request, **extra}
    if calls is not None:
        spec["calls"] = list(calls)
    if who is not None:           # "other:..." certificates are signed by an untrusted CA
        cert, key = pki.certs[who]
        spec.update(ca=pki.ca_cert, cert=cert, key=key)
    return json.loads(ns.python(ns.attacker, ATTACKER, json.dumps(spec)))


@pytest.mark.parametrize("who", [None, "other:node/p0"])
def test_no_cluster_certificate_gets_nothing(ns, victim, who):
    out = _attack(ns, victim, who)
    for call in ("exchange", "prepare", "done", "watch", "cancel", "reads", "steps",
                 "holdings"):
        assert out[call]["ok"] is False and out[call]["code"] == "UNAVAILABLE", (call, out)


def test_a_client_identity_reads_figures_but_calls_nothing_node_to_node(ns, victim):
    out = _attack(ns, victim, "client/c")
    assert out["reads"]["ok"] is True
    assert out["holdings"]["ok"] is True and "de_buffer" in out["holdings"]["reply"], out
    # Past the identity check: a decode node has no forward steps to give.
    assert out["steps"]["code"] == "FAILED_PRECONDITION", out
    for call in ("exchange", "prepare", "done", "watch", "cancel"):
        assert out[call]["code"] == "PERMISSION_DENIED", (call, out)


def test_a_request_belongs_to_the_node_that_prepared_it(ns, victim):
    rid = "r-owned"
    mine = _attack(ns, victim, "node/p0", request=rid, calls=("exchange", "prepare"))
    assert mine["exchange"]["ok"] and mine["prepare"]["ok"], mine
    theirs = _attack(ns, victim, "node/p1", request=rid)
    assert theirs["exchange"]["ok"] is True             # cluster nodes may connect
    for call in ("prepare", "done", "watch", "cancel"):
        assert theirs[call]["code"] == "PERMISSION_DENIED", (call, theirs)
    assert "prepared here by node/p0" in theirs["prepare"]["details"]
    assert "belongs to node/p0" in theirs["done"]["details"]
    # ...and its owner still may (a watch of a request not loading: it is there).
    again = _attack(ns, victim, "node/p0", request=rid, calls=("cancel",))
    assert again["cancel"]["ok"] is True
    # The cancel dropped it: nothing of it is here any more.
    gone = _attack(ns, victim, "node/p0", request=rid, calls=("done",))
    assert gone["done"]["code"] == "NOT_FOUND", gone


def test_a_prompt_past_the_bound_is_refused_before_anything_is_allocated(ns, victim):
    # 676dc5a sized the DE's buffers from PrepareRequest.prompt_tokens as given: 2^40
    # tokens made the daemon try to allocate 8 TiB (the caller got UNKNOWN).
    rss = _rss_kib(victim["proc"].pid)
    out = _attack(ns, victim, "node/p0", request="r-huge", calls=("prepare",),
                  prompt_tokens=1 << 40)
    assert out["prepare"]["code"] == "INVALID_ARGUMENT", out
    assert "16777216" in out["prepare"]["details"], out
    assert _rss_kib(victim["proc"].pid) < rss + 64 * 1024
    ok = _attack(ns, victim, "node/p0", request="r-after-huge", calls=("prepare", "cancel"))
    assert ok["prepare"]["ok"] is True, ok                  # and it still serves


def test_a_prepare_the_scheduler_never_assigned_here_expires(ns, victim):
    # The audit (issue 38): a decode node prepared requests of its own choosing on both
    # decode nodes; their 512 slots were held for ever and real requests waited 50 s.
    # Here nothing is ever assigned (no scheduler): the prepare's slots come back after
    # engine.prepare_ttl_s. Its preparer's control port refuses connections (it is
    # gone), so the fence asking it lets them go.
    def holdings():
        return _attack(ns, victim, "client/c", calls=("holdings",))["holdings"]
    before = holdings()
    out = _attack(ns, victim, "node/p0", request="r-squat", calls=("prepare",),
                  prefill="127.0.0.1:1")
    assert out["prepare"]["ok"], out
    held = holdings()
    assert held["free"] < before["free"] and held["requests"] == before["requests"] + 1
    deadline = time.monotonic() + PREPARE_TTL_S + WAIT_S
    while (now := holdings())["requests"] > before["requests"]:
        assert time.monotonic() < deadline, now
        time.sleep(1.0)
    assert now["free"] == before["free"] and now["fenced"] == 0, now
    assert "never assigned here by the scheduler" in victim["log"].read_text()


def test_a_prompt_past_the_buffer_is_refused_before_any_per_token_work(ns, victim):
    # The audit (issue 38): a PrepareRequest at the size bound (2^24 prompt tokens, the
    # payload agreeing) built its token ids and block keys on the event loop before the
    # buffer check: the decode node stalled 12 s and lost its lease. The buffer's
    # capacity is checked first now; the ids (128 MiB of them) are never made, which the
    # node's peak memory shows (VmHWM does not come down after a spike).
    pid = victim["proc"].pid
    peak = _status_kib(pid, "VmHWM")
    out = _attack(ns, victim, "node/p0", request="r-past-buffer", calls=("prepare",),
                  prompt_tokens=1 << 24, payload_tokens=1 << 24)
    assert out["prepare"]["code"] == "OUT_OF_RANGE", out
    assert "de_buffer: a request needs 262144 blocks" in out["prepare"]["details"], out
    assert _status_kib(pid, "VmHWM") < peak + 64 * 1024


def _rss_kib(pid: int) -> int:
    return _status_kib(pid, "VmRSS")


def _status_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith(field + ":"))


@pytest.mark.parametrize("port", ["data", "control"])
def test_two_thousand_idle_connections_keep_the_node_bounded_and_serving(ns, victim, port):
    # The data port bounds its handshakes itself (csrc/tcp_ctl.c); the gRPC control port
    # by [grpc] max_connections (64 here) and handshake_timeout_s (2 s here): on b658318
    # it held every connection for 120 s, and about 20,000 of them exhausted a decode
    # node's descriptors until its health check timed out and it lost its lease.
    node_pid = victim["proc"].pid          # `ip netns exec` execs the node in place
    fds_before = len(os.listdir(f"/proc/{node_pid}/fd"))
    target = victim["data_port"] if port == "data" else victim["addr"].split(":")[1]
    flood = ns.popen(ns.attacker, [sys.executable, "-c", FLOOD, victim["addr"].split(":")[0],
                                   str(target), "2000"],
                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert json.loads(flood.stdout.readline()) == {"held": 2000}
        time.sleep(1.0)                  # let the accepts happen (not a timing assertion)
        fds_during = len(os.listdir(f"/proc/{node_pid}/fd"))
        assert fds_during - fds_before <= 64 + 16, (fds_before, fds_during)
        # The health check answers over mutual TLS within a generous deadline.
        code = (
            "import grpc, sys\n"
            "from grpc_health.v1 import health_pb2, health_pb2_grpc\n"
            "from dualpath import tls\n"
            "from dualpath.tls import TlsConfig\n"
            "c = TlsConfig(ca_file=sys.argv[2], cert_file=sys.argv[3], key_file=sys.argv[4])\n"
            "ch = tls.sync_channel(sys.argv[1], c)\n"
            "r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),"
            " timeout=30, wait_for_ready=True)\n"
            "print(r.status)\n")
        cert, key = victim["pki"].certs["node/p0"]
        out = ns.python(ns.attacker, code, victim["addr"], victim["pki"].ca_cert, cert, key)
        assert out.strip() == "1"        # SERVING
    finally:
        flood.stdin.close()
        flood.wait(WAIT_S)


def _write(ns, victim, who: str, **spec) -> dict:
    pki = victim["pki"]
    cert, key = pki.certs[who]
    spec.update(addr=victim["addr"], ca=pki.ca_cert, cert=cert, key=key)
    return json.loads(ns.python(ns.attacker, WRITER, json.dumps(spec)))


def test_a_node_writes_only_into_the_slots_of_its_own_requests(ns, victim):
    # The audit (issue 38): a node admitted on a decode node's data port wrote into a
    # slot that a prefill node had prepared for another request. The DE's buffer is
    # scoped now: each preparer may WRITE into its own request's slots only, and only
    # while that attempt lives (status 10 is REM_ACCESS_ERR, refused where it lands).
    mine = _write(ns, victim, "node/p0", prepare="r-slot-p0")
    assert mine["status"] == [0], mine                # its own slot: lands
    victim_slot = mine["slots"][0] * mine["stride"]
    theirs = _write(ns, victim, "node/p1", prepare="r-slot-p1",
                    offsets=[victim_slot, victim_slot + mine["stride"] - 4096])
    assert theirs["slots"][0] != mine["slots"][0]
    assert theirs["status"] == [10, 10], theirs       # p0's request's slot: refused
    own = _write(ns, victim, "node/p1", offsets=[theirs["slots"][0] * theirs["stride"]])
    assert own["status"] == [0], own                  # (its own still lands)
    late = _write(ns, victim, "node/p0", prepare="r-slot-late", cancel=True)
    assert late["status"] == [10], late               # an ended attempt's late WRITE
    for rid, who in (("r-slot-p0", "node/p0"), ("r-slot-p1", "node/p1")):
        assert _attack(ns, victim, who, request=rid, calls=("cancel",))["cancel"]["ok"]


def test_a_node_cannot_order_a_load_into_another_nodes_memory(ns, victim):
    # The review of issue 38's scope: p1 prepared a request on d0 (so it may order its
    # load) and named another node's control address as the target: d0 would have
    # written into that node's memory, inside the windows that node granted d0 for its
    # own requests. d0 now connects only to the preparer's identity there; here the
    # address is d0's own (node/d0, not node/p1): refused, nothing loaded.
    out = _write(ns, victim, "node/p1", prepare="r-order-elsewhere",
                 order_into=victim["addr"])
    assert out["order"]["code"] == "PERMISSION_DENIED", out
    assert "not node/p1" in out["order"]["details"], out
    assert _attack(ns, victim, "node/p1", request="r-order-elsewhere",
                   calls=("cancel",))["cancel"]["ok"]
