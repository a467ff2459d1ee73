"""Attacks on the TCP provider's data port, from a network namespace of the test's own
(tests/netns.py): the target engine listens on the victim namespace's veth address,
the attacker (tests/tcp_attacker.py) runs as a process in the attacker namespace.

- A WRITE aimed at a leaked (rkey, address) over a connection that was never admitted
  is dropped: the memory is unchanged and the attacker hears nothing but the challenge.
- A credential with a guessed secret, or one already used, is refused.
- 2,000 idle connections hold at most max_pending descriptors of the target, and an
  admitted peer still connects and writes (a bounded wait, not a timing).
Plus, on loopback: rkeys are random, and admitted connections are capped per peer."""

import errno
import itertools
import json
import os
import subprocess
import sys

import pytest

from dualpath.errors import RdmaError
from dualpath.tcp import Item, TcpEngine, WcStatus
from tests import netns

WAIT_S = 60.0           # bounds against hangs, never a performance assertion
SIZE = 1 << 20


@pytest.fixture(scope="module")
def ns():
    yield from netns.netns_fixture("tcp")


@pytest.fixture(scope="module")
def target(ns):
    """The victim's engine in the victim namespace, its zeroed region, and a legitimate
    initiator engine beside it (both made on a thread inside that namespace)."""
    def make():
        b = TcpEngine(ns.victim_ip, 0, max_pending=64, handshake_timeout_ms=1000)
        a = TcpEngine("127.0.0.1", 0)
        return a, b

    a, b = ns.call_in(ns.victim, make)
    dst = bytearray(SIZE)
    src = bytearray(os.urandom(SIZE))
    dst_mr, src_mr = b.register(dst), a.register(src)
    cq = a.cq(64)
    yield {"a": a, "b": b, "dst": dst, "src": src, "dst_mr": dst_mr, "src_mr": src_mr,
           "cq": cq}
    a.close()
    b.close()


ATTACKER = "import runpy; runpy.run_module('tests.tcp_attacker', run_name='__main__')"


def attack(ns, spec) -> dict:
    out = ns.python(ns.attacker, ATTACKER, json.dumps(spec))
    return json.loads(out)


def legit_write(ns, t, offset: int) -> None:
    """An admitted peer: fresh credential, connect (in the victim namespace), one WRITE."""
    a, b, cq = t["a"], t["b"], t["cq"]
    conn = a.connection(cq)
    try:
        for _ in range(int(WAIT_S / 0.5)):   # the pending slots may be full for a moment
            try:
                ns.call_in(ns.victim, conn.connect, ns.victim_ip, b.port, 10.0,
                           b.admit(7))
                break
            except RdmaError as e:
                assert e.errno == errno.ECONNRESET, e
                conn.reset()
                ns.call_in(ns.victim, lambda: __import__("time").sleep(0.5))
        item = Item(t["src_mr"].addr + offset, t["dst_mr"].addr + offset, 4096,
                    t["src_mr"].lkey, t["dst_mr"].rkey, 1)
        assert conn.post_write([item]) == 1
        got = cq.wait(WAIT_S)
        assert [c.status for c in got] == [WcStatus.SUCCESS]
        assert t["dst"][offset:offset + 4096] == t["src"][offset:offset + 4096]
    finally:
        conn.close()


def test_an_unadmitted_write_lands_nowhere_and_learns_nothing(ns, target):
    b, mr = target["b"], target["dst_mr"]
    before = b.stats()
    # Even with the rkey and address leaked, an unadmitted connection writes nothing.
    r = attack(ns, {"mode": "write", "host": ns.victim_ip, "port": b.port, "rkey": mr.rkey,
                    "addr": mr.addr, "length": 4096})
    got = bytes.fromhex(r["received"])
    assert len(got) == 24 and got[:4] == b"DPC1"   # the challenge; no ack, no status
    assert target["dst"] == bytearray(SIZE)
    after = b.stats()
    assert after.writes == before.writes and after.conns_refused == before.conns_refused + 1
    assert after.conns_admitted == before.conns_admitted


def test_a_guessed_or_reused_credential_is_refused(ns, target):
    b = target["b"]
    issued = b.admit(9)
    guess = attack(ns, {"mode": "credential", "host": ns.victim_ip, "port": b.port,
                        "id": issued.id, "secret_hex": os.urandom(16).hex()})
    assert guess["errno"] == errno.ECONNRESET
    # The real secret admits exactly one connection; a replay of it is refused.
    spec = {"mode": "credential", "host": ns.victim_ip, "port": b.port, "id": issued.id,
            "secret_hex": issued.secret.hex()}
    assert attack(ns, spec)["errno"] == 0
    assert attack(ns, spec)["errno"] == errno.ECONNRESET
    assert target["dst"] == bytearray(SIZE)


def test_two_thousand_idle_connections_keep_the_target_bounded_and_serving(ns, target):
    b = target["b"]
    fds_before = len(os.listdir("/proc/self/fd"))
    flood = ns.popen(ns.attacker, [sys.executable, "-c", ATTACKER,
                                   json.dumps({"mode": "flood", "host": ns.victim_ip,
                                               "port": b.port, "n": 2000})],
                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert json.loads(flood.stdout.readline()) == {"held": 2000}
        # Every one of them reached the target and was closed or is pending.
        for _ in range(int(WAIT_S / 0.1)):
            if b.stats().conns_accepted >= 2000:
                break
            ns.call_in(ns.victim, lambda: __import__("time").sleep(0.1))
        fds_during = len(os.listdir("/proc/self/fd"))
        assert fds_during - fds_before <= 64 + 8      # max_pending, plus slack for pytest
        legit_write(ns, target, 8192)                  # an admitted peer still gets in
        assert target["dst"][:8192] == bytes(8192)
    finally:
        flood.stdin.close()
        flood.wait(WAIT_S)


def test_a_handshake_storm_from_one_address_leaves_room_for_admitted_peers(ns, target):
    # The audit (issue 38): the 64 pending-handshake slots were shared first come, first
    # served, and an unauthenticated storm (reopening every connection the target
    # closed) let 2 of 20 admitted peers through on b658318. Now one address holds at
    # most max_pending / 8 of them: each of 20 admitted connects (one try each, from
    # the victim's address) gets in while the storm goes on.
    a, b, cq = target["a"], target["b"], target["cq"]
    storm = ns.popen(ns.attacker, [sys.executable, "-c", ATTACKER,
                                   json.dumps({"mode": "storm", "host": ns.victim_ip,
                                               "port": b.port, "n": 200})],
                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    ok = []
    # The target is shared with the module's other attacks: count this storm's
    # refusals from here (the flood's alone passed 400, and the storm could end before
    # its first pass: reopened 0, seen once in a full host-tier run).
    refused0 = b.stats().conns_refused
    try:
        assert json.loads(storm.stdout.readline()) == {"storming": 200}
        for _ in range(int(WAIT_S / 0.1)):       # the storm is being refused
            if b.stats().conns_refused - refused0 >= 400:
                break
            ns.call_in(ns.victim, lambda: __import__("time").sleep(0.1))
        for _ in range(20):
            conn = a.connection(cq)
            try:
                ns.call_in(ns.victim, conn.connect, ns.victim_ip, b.port, 10.0, b.admit(7))
                ok.append(True)
            except RdmaError as e:
                ok.append(e.errno)
            finally:
                conn.close()
    finally:
        storm.stdin.close()
        end = json.loads(storm.stdout.readline())
        storm.wait(WAIT_S)
    assert end["reopened"] > 0                     # it stormed throughout
    assert ok == [True] * 20, ok


def test_rkeys_are_random_not_sequential():
    with TcpEngine() as eng:
        bufs = [bytearray(4096) for _ in range(64)]
        keys = [eng.register(x).rkey for x in bufs]
        assert len(set(keys)) == 64 and 0 not in keys
        # Sequential keys (gen << 16 | slot) differed by 1 from one region to the next.
        assert sum(1 for x, y in itertools.pairwise(keys) if y - x == 1) < 4


def test_admitted_connections_are_capped_per_peer():
    with TcpEngine(max_conns_per_peer=2) as b, TcpEngine() as a:
        cq = a.cq(16)
        conns = [a.connection(cq) for _ in range(3)]
        conns[0].connect("127.0.0.1", b.port, credential=b.admit(5))
        conns[1].connect("127.0.0.1", b.port, credential=b.admit(5))
        with pytest.raises(RdmaError) as e:
            conns[2].connect("127.0.0.1", b.port, credential=b.admit(5))
        assert e.value.errno == errno.ECONNRESET
        conns[2].connect("127.0.0.1", b.port, credential=b.admit(6))   # another peer: fine
        assert b.stats().conns_admitted == 3
        for c in conns:
            c.close()
