"""The idle invariant over what a node holds (dualpath/node/holdings.py): each kind of
leak is named, a whole node passes, and the wire form carries every figure."""

from dualpath.node.holdings import Holdings, PoolHolding, idle_violations

WHOLE = Holdings("d0", (PoolHolding("de_buffer", 96, 96), PoolHolding("hbm0", 8, 8)))


def test_a_node_holding_nothing_keeps_the_invariant():
    assert idle_violations(WHOLE) == []
    assert idle_violations(Holdings("p0", ())) == []


def test_each_kind_of_leak_is_named():
    h = Holdings("p0", (PoolHolding("pe_buffer", 128, 80, waiting=2),),
                 fenced_blocks=5, read_queue_tokens=640, requests=1)
    v = idle_violations(h)
    assert v == ["p0: 48 of 128 pe_buffer slots taken",
                 "p0: 2 reservations waiting for pe_buffer slots",
                 "p0: 5 blocks fenced", "p0: 640 tokens in the read queue",
                 "p0: state kept for 1 requests"]


def test_the_wire_form_round_trips():
    h = Holdings("d1", (PoolHolding("de_buffer", 96, 90, 1),), 3, 128, 2)
    assert Holdings.from_pb(h.to_pb()) == h
    assert Holdings.from_pb(WHOLE.to_pb()) == WHOLE
