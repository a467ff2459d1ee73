"""The doctor's checks over facts made up to the case (dualpath/doctor/checks.py)."""

from __future__ import annotations

from dualpath import config
from dualpath.doctor import checks
from dualpath.doctor.checks import FAIL, OK, WARN, Facts, Port

MIB = 1 << 20


def cfg(**over):
    return config.load(None, over)


def facts(**over) -> Facts:
    base = {"memlock_bytes": None, "huge_pages_free": 0, "store_dir": "/s",
            "store_fs": "ext4", "store_free_bytes": 50 << 30,
            "store_total_bytes": 100 << 30, "clock_synced": True}
    return Facts(**{**base, **over})


def roce(**over) -> Port:
    return Port(**{"device": "rxe0", "port": 1, "active": True, "ethernet": True,
                   "active_mtu": 4096, "roce_v2_ipv4_gid": 1, "numa_node": 0, **over})


def by_name(results):
    return {r.check: r for r in results}


def test_memlock_compares_the_limit_with_what_the_role_pins():
    c = cfg(**{"buffers.pe_buffer_mib": 64, "engine.prefill_hbm_mib": 32,
               "engine.engines_per_node": 2})
    assert checks.pinned_bytes(c, "prefill") == (64 + 2 * 32) * MIB
    assert checks.memlock(c, "prefill", facts(memlock_bytes=128 * MIB)).status == OK
    r = checks.memlock(c, "prefill", facts(memlock_bytes=100 * MIB))
    assert r.status == FAIL and "100 MiB < 128 MiB" in r.detail and "LimitMEMLOCK" in r.fix
    assert checks.memlock(c, "prefill", facts(memlock_bytes=None)).status == OK
    assert checks.memlock(cfg(**{"buffers.mlock": False}), "prefill", facts()).status == WARN


def test_huge_pages_fail_only_when_demanded():
    c = cfg(**{"buffers.pe_buffer_mib": 8, "engine.prefill_hbm_mib": 8})
    assert checks.huge_pages(c, "prefill", facts(huge_pages_free=8)).status == OK
    assert checks.huge_pages(c, "prefill", facts(huge_pages_free=7)).status == WARN
    on = cfg(**{"buffers.pe_buffer_mib": 8, "engine.prefill_hbm_mib": 8,
                "buffers.huge_pages": "on"})
    r = checks.huge_pages(on, "prefill", facts(huge_pages_free=7))
    assert r.status == FAIL and "vm.nr_hugepages=8" in r.fix


def test_no_active_port_matters_as_much_as_the_transport_says():
    down = facts(rdma_ports=[roce(active=False)])
    assert checks.rdma(cfg(**{"transport.kind": "verbs"}), down)[0].status == FAIL
    assert checks.rdma(cfg(**{"transport.kind": "auto"}), down)[0].status == WARN
    assert checks.rdma(cfg(**{"transport.kind": "tcp"}), down)[0].status == OK
    # a device named in the config that is not the one present
    r = checks.rdma(cfg(**{"transport.kind": "verbs", "transport.device": "mlx5_0"}),
                    facts(rdma_ports=[roce()]))
    assert r[0].status == FAIL and "mlx5_0" in r[0].detail


def test_roce_needs_an_ipv4_gid_and_a_full_mtu():
    res = by_name(checks.rdma(cfg(), facts(rdma_ports=[roce()])))
    assert res["rdma devices"].status == OK and res["gid rxe0"].status == OK
    assert res["mtu rxe0"].status == OK and "NUMA node 0" in res["numa rxe0"].detail
    res = by_name(checks.rdma(cfg(), facts(rdma_ports=[roce(roce_v2_ipv4_gid=None,
                                                            active_mtu=1024)])))
    assert res["gid rxe0"].status == FAIL and "gid_index" in res["gid rxe0"].fix
    assert res["mtu rxe0"].status == WARN and "1024" in res["mtu rxe0"].detail
    fixed = by_name(checks.rdma(cfg(**{"transport.gid_index": 3}),
                                facts(rdma_ports=[roce(roce_v2_ipv4_gid=None)])))
    assert fixed["gid rxe0"].status == OK


def test_the_lane_the_store_the_clock_ports_and_tls():
    assert checks.kv_lane(cfg()).status == OK
    assert checks.kv_lane(cfg(**{"kv_lane.service_level": 0})).status == WARN
    res = by_name(checks.store(cfg(), facts(o_direct="Invalid argument",
                                            store_free_bytes=5 << 30)))
    assert res["o_direct"].status == WARN and res["free space"].status == WARN
    on = by_name(checks.store(cfg(**{"storage.direct_io": "on"}),
                              facts(o_direct="Invalid argument")))
    assert on["o_direct"].status == FAIL
    assert checks.store(cfg(), facts(store_error="Permission denied"))[0].status == FAIL
    assert checks.clock(facts(clock_synced=False)).status == WARN
    assert checks.clock(facts(clock_synced=None)).status == WARN
    busy = checks.ports(facts(ports_busy={"127.0.0.1:7000": "Address already in use"}),
                        ["127.0.0.1:7000"])
    assert busy.status == FAIL and "127.0.0.1:7000: Address already in use" in busy.detail
    assert checks.tls(cfg(**{"tls.plaintext": True}), facts()).status == WARN
    assert checks.tls(cfg(), facts(tls_problems=["tls.cert_file is not set"])).status == FAIL
    assert checks.tls(cfg(), facts(tls_expires_days=3.0)).status == WARN
    assert checks.tls(cfg(), facts(tls_expires_days=300.0)).status == OK


def test_the_worst_result_is_the_exit_status():
    ok = checks.Result("a", OK, "")
    assert checks.worst([ok]) == 0 and checks.worst([]) == 0
    assert checks.worst([ok, checks.Result("b", WARN, "")]) == 1
    assert checks.worst([ok, checks.Result("b", WARN, ""), checks.Result("c", FAIL, "")]) == 2


def test_the_nodes_startup_memory_line_says_what_is_short_and_the_fix():
    # The line a node logs before it maps its regions (node/daemon.py): a warning when
    # the memlock limit or the free huge pages fall short of what the config pins.
    c = cfg(**{"buffers.pe_buffer_mib": 64, "engine.prefill_hbm_mib": 32,
               "engine.engines_per_node": 2})                 # 128 MiB: 64 huge pages
    short, line = checks.startup_memory(c, "prefill", facts(huge_pages_free=64), False)
    assert not short and "pins 128 MiB" in line and "Short" not in line
    short, line = checks.startup_memory(c, "prefill", facts(huge_pages_free=10), False)
    assert short and "10 free 2 MiB pages of 64" in line
    assert "sysctl vm.nr_hugepages=64" in line
    short, line = checks.startup_memory(
        c, "prefill", facts(memlock_bytes=8 * MIB, huge_pages_free=64), False)
    assert short and "8 MiB < 128 MiB" in line and "ulimit -l unlimited" in line
    # CAP_IPC_LOCK (root) passes any limit: stated, not a shortfall
    short, line = checks.startup_memory(
        c, "prefill", facts(memlock_bytes=8 * MIB, huge_pages_free=64), True)
    assert not short and "CAP_IPC_LOCK: not enforced" in line
    # ... but mlock off is a warning of its own, which CAP_IPC_LOCK does not answer
    nolock = cfg(**{"buffers.mlock": False, "buffers.pe_buffer_mib": 64})
    short, line = checks.startup_memory(nolock, "prefill", facts(huge_pages_free=64), True)
    assert short and "not enforced" not in line and "buffers.mlock = true" in line
    off = cfg(**{"buffers.huge_pages": "off", "buffers.pe_buffer_mib": 64})
    short, line = checks.startup_memory(off, "prefill", facts(), False)
    assert not short and "buffers.huge_pages = off" in line
