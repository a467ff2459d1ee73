"""Partitions: a node cut off the network, silently, for twice the lease, then healed,
during a 1P2D replay whose nodes each live in a network namespace of their own behind a
veth (dualpath/cluster/netns.py; TCP provider across the veths and a bridge).

A cut is not a kill: the node runs on, its tasks time out, the scheduler drops its work
and requeues it, and when the cut heals, open connections resume and what the node sent
meanwhile arrives late. The fences must hold against that: a writer answers "writes
ended" only once they did, so no slot serves another request while an old attempt's
bytes may still land in it. The audit that found the prefill node's partition giving
wrong bytes (2 of 11 runs: a decode node answered the PE's cancel "not known" while its
load still wrote into the PE's memory) ran this shape; the deterministic case of that
race is tests/unit/test_paths_decode_order_race.py.

Each case: the suite's promises (conftest.check: nothing lost, nothing twice, no wrong
byte, failed attempts within the budget, the idle invariant at the end) and the node
registered again once healed. Needs root and iproute2 (`make install` runs as root: the
suite's other network-namespace tests need it too).
"""

from __future__ import annotations

import pytest

from dualpath.cluster.faults import partition
from dualpath.cluster.local import LocalCluster
from dualpath.cluster.netns import Namespaces, available
from tests.faults.conftest import (
    LEASE_S,
    SETTINGS,
    Fault,
    check,
    eventually,
    registrations,
    run_replay,
    scheduler_log,
)

pytestmark = pytest.mark.slow

NODES = ["p0", "d0", "d1"]
CUT_LEASES = 2.0


@pytest.fixture
def netns_cluster(tmp_path):
    why = available()
    if why:
        pytest.skip(why)
    nets = Namespaces(NODES)
    try:
        node_settings = {n: {"engine": {"control_listen": f"{nets.ip[n]}:0",
                                        "metrics_listen": f"{nets.ip[n]}:0"},
                             "transfer": {"tcp_listen": nets.ip[n]}} for n in NODES}
        c = LocalCluster(1, 2, work_dir=str(tmp_path), settings=SETTINGS,
                         host=nets.bridge_ip, node_settings=node_settings,
                         tls_ips=tuple(nets.ip.values()),
                         node_launchers={n: nets.launcher(n) for n in NODES})
        c.start()
        try:
            yield c, nets
        finally:
            c.stop()
    finally:
        nets.close()


@pytest.mark.parametrize("victim", ["p0", "d0"])
def test_a_node_cut_off_past_its_lease_then_healed(netns_cluster, victim):
    cluster, nets = netns_cluster
    fault = Fault(after=4, action=partition(nets, victim, CUT_LEASES * LEASE_S))
    run = run_replay(cluster, fault, sink_listen=f"{nets.bridge_ip}:0")
    eventually(f"{victim} registers again once healed",
               lambda: registrations(scheduler_log(cluster), victim) >= 2)
    check(f"{victim} partitioned for {CUT_LEASES:g} leases", cluster, run, fault)
