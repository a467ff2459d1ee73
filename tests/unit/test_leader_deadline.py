"""A leader's Fetch deadline is bounded by the lease (dualpath/node/leader.py): a fetch
held on a connection that died silently (a partition healed on one side only) kept the
leader silent for seconds, so a healed decode node lost its lease again and again."""

from dualpath.node.leader import fetch_deadline_s


def test_a_fetch_gives_up_once_its_lease_would_have_lapsed():
    for lease_ms in (1000, 2000, 3000):
        for wait_ms in (0, 1000):
            # the hold, then a lease from the arrival: never the old 6 s
            assert fetch_deadline_s(lease_ms, wait_ms) <= 4 * lease_ms / 3000 + 1e-9


def test_the_hold_and_the_answer():
    assert fetch_deadline_s(3000, 1000) == 1.0 + 3.0     # a third of the lease held
    assert fetch_deadline_s(1000, 0) == 1.0
    assert fetch_deadline_s(60_000, 1000) == 1.0 + 5.0   # long leases: at most 5 s
    assert fetch_deadline_s(0, 0) == 5.0                 # before a registration
