"""bench/scheduler.py's mutual-TLS comparison: the sides alternate, each side's figure is
the median over its repetitions, and the summary's ratio is TLS over plain of those
medians (issue 11's grpc_fetch_p99_tls_over_plain)."""

from __future__ import annotations

import argparse

import pytest

from tests.bench_module import load_bench


@pytest.fixture(scope="module")
def bench():
    return load_bench("scheduler")


def run(side: str, p99: float, cpu: float) -> dict:
    return {"tls": side, "fetch_p99_ms": p99, "fetch_p50_ms": p99 / 10,
            "server_cpu_us_per_fetch": cpu, "client_cpu_us_per_fetch": cpu / 2,
            "requests_per_s": 6000.0, "host_other_cpu_cores": 0.0}


def test_sides_alternate_and_the_first_side_swaps_each_repetition(bench):
    order = bench.tls_order(5)
    assert order == [False, True, True, False, False, True, True, False, False, True]
    assert order.count(True) == order.count(False) == 5


def test_ratio_is_of_the_medians_not_the_mean_nor_per_pair(bench):
    # Plain p99s 5, 6, 7, 8, 100 (median 7); TLS 7, 7.5, 7.7, 9, 9 (median 7.7).
    plain = [5.0, 100.0, 6.0, 7.0, 8.0]
    tls = [7.7, 9.0, 7.0, 7.5, 9.0]
    runs = [r for p, t in zip(plain, tls, strict=True)
            for r in (run("plaintext", p, 100.0 + p), run("mutual-tls", t, 110.0 + t))]
    out = bench.compare_tls(runs)
    assert out["repetitions"] == 5
    assert out["plain"]["fetch_p99_ms"] == 7.0
    assert out["tls"]["fetch_p99_ms"] == 7.7
    assert out["fetch_p99_ms_tls_over_plain"] == pytest.approx(1.1)
    assert out["plain"]["server_cpu_us_per_fetch"] == 107.0
    assert out["tls"]["server_cpu_us_per_fetch"] == pytest.approx(117.7)
    assert out["server_cpu_us_per_fetch_tls_over_plain"] == pytest.approx(117.7 / 107.0)


def test_pki_names_one_node_certificate_per_group_after_its_group_id(bench):
    args = argparse.Namespace(model="ds660b", pe_nodes=2, de_nodes=3, engines_per_node=2,
                              grpc_speedup=20.0, seed=1)
    ids = bench.bench_identities(args)
    assert ids == ["node/pe0", "node/pe1", "node/de0", "node/de1",
                   "node/de2", "scheduler/scheduler", "client/bench"]
    assert bench.tls_section(None, "scheduler/scheduler") == "[tls]\nplaintext = true\n"
