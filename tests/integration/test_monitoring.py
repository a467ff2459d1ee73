"""Monitoring for real: Debian's `prometheus` scrapes a running 1P2D cluster while it
replays a trace and one error of each kind is injected — corrupt blocks in the store
(checksum failures, recomputed), the prefill node SIGSTOPped mid-replay past its lease
and the write timeout of the decode nodes writing into it (a group down, its requests
requeued, connections reset and reconnected), a request held stuck by draining every
DE, which then fails (its payload is not one the engines accept: failed attempts, a
failed request). Then, through Prometheus' HTTP API:

- every metric family docs/metrics.md lists for the scheduler and the nodes is stored,
  with the labels it lists;
- `promtool check metrics` finds nothing on any daemon's /metrics;
- every panel of deploy/grafana/dualpath.json answers (no fallback like `or vector(0)`),
  and the error panels show the injected errors;
- every recording rule of deploy/prometheus/ answers; `promtool check rules` and
  `promtool test rules` (the alerts on synthetic series) pass.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from dualpath import tls
from dualpath.cluster.faults import damage_blocks, stall
from dualpath.cluster.local import LocalCluster, free_port
from dualpath.kv.profiles import get_profile
from dualpath.v1 import admin_pb2, scheduler_pb2, scheduler_pb2_grpc
from tests.faults.conftest import Fault, run_replay

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs" / "metrics.md"
DASHBOARD = ROOT / "deploy" / "grafana" / "dualpath.json"
RULES = ROOT / "deploy" / "prometheus" / "dualpath.rules.yml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "dualpath.rules.test.yml"
PROFILE = get_profile("demo")
SCRAPE_S = 1
MAX_STALLS = 3
# Grafana's own variables in the dashboard's PromQL, as Grafana would fill them in.
# The ranges cover the whole test (its errors are older than a dashboard's usual 2m
# by the time every panel is asked, on a loaded host).
GRAFANA_VARS = {"$__rate_interval": "15m", "$__interval": "15s", "$__range": "15m"}
# Panels that must show the injected error (a positive value), by title.
SHOWS_ERROR = {
    "Checksum failures": "corrupt blocks in the store",
    "Failed attempts and failed requests": "the payload-less request, refused until it failed",
    "Stuck requests": "a request held while every DE is drained",
    "Engine groups": "p0's group down while it was stopped",
    "Transfer errors and QP recoveries": "the DEs' writes into the stopped p0",
}

# Not a skip: `make install` installs it (tools/install-system-packages.sh).
NEEDS = "needs Debian's prometheus package (prometheus, promtool): run `make install`"


def _get(url: str, params: dict | None = None) -> dict:
    if params:
        url += "?" + urllib.parse.urlencode(params, doseq=True)
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def metrics_url(cluster: LocalCluster, name: str) -> str:
    text = (cluster.dir / "logs" / f"{name}.log").read_text()
    return re.findall(r"metrics: serving (http://\S+/metrics)", text)[-1]


def write_targets(cluster: LocalCluster, path: Path) -> list[str]:
    """The file_sd targets: every daemon's /metrics host:port, labelled with its name
    (a restarted node serves on a new port; Prometheus rereads the file)."""
    groups = []
    for name in ["scheduler", *cluster.node_ids()]:
        hostport = metrics_url(cluster, name).removeprefix("http://").removesuffix("/metrics")
        groups.append({"targets": [hostport], "labels": {"daemon": name}})
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(groups))
    tmp.replace(path)
    return [g["targets"][0] for g in groups]


def documented_families() -> dict[str, tuple[str, set[str]]]:
    """docs/metrics.md's scheduler and node tables: family -> (type, labels)."""
    text = DOCS.read_text().split("## vLLM nodes and instances only")[0]
    out = {}
    for m in re.finditer(r"^\| `(dualpath_\w+)` \| (\w+) \|([\w, ]*)\|", text, re.MULTILINE):
        out[m[1]] = (m[2], {x.strip() for x in m[3].split(",") if x.strip()})
    return out


class Prometheus:
    def __init__(self, work: Path, targets_file: Path):
        assert shutil.which("prometheus"), NEEDS
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = work / "prometheus.yml"
        cfg.write_text(json.dumps({
            "global": {"scrape_interval": f"{SCRAPE_S}s", "evaluation_interval": "1s"},
            "rule_files": [str(RULES)],
            "scrape_configs": [{"job_name": "dualpath",
                                "file_sd_configs": [{"files": [str(targets_file)],
                                                     "refresh_interval": "1s"}]}]}))
        self.log = open(work / "prometheus.log", "wb")  # noqa: SIM115 - closed by close()
        self.proc = subprocess.Popen(
            ["prometheus", f"--config.file={cfg}", f"--storage.tsdb.path={work / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--web.enable-lifecycle"],
            stdout=self.log, stderr=subprocess.STDOUT)
        self.wait(lambda: self._ready(), "prometheus ready", 60)

    def _ready(self) -> bool:
        assert self.proc.poll() is None, "prometheus exited; see prometheus.log"
        try:
            return urllib.request.urlopen(self.url + "/-/ready", timeout=2).status == 200
        except OSError:
            return False

    @staticmethod
    def wait(ok, what: str, bound_s: float) -> None:
        deadline = time.monotonic() + bound_s
        while not ok():
            assert time.monotonic() < deadline, f"not within {bound_s:g} s: {what}"
            time.sleep(0.25)

    def query(self, expr: str) -> list[dict]:
        r = _get(self.url + "/api/v1/query", {"query": expr})
        assert r["status"] == "success", (expr, r)
        return r["data"]["result"]

    def scrapes(self, hostport: str) -> int:
        """Successful scrapes of a target within the last 10 minutes."""
        res = self.query(f'sum_over_time(up{{instance="{hostport}"}}[10m])')
        return int(float(res[0]["value"][1])) if res else 0

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def recoveries(cluster: LocalCluster) -> int:
    """Connections the DEs reset and reconnected, from their /metrics."""
    n = 0
    for nid in ("d0", "d1"):
        body = urllib.request.urlopen(metrics_url(cluster, nid), timeout=10).read().decode()
        m = re.search(r"^dualpath_node_transfer_recoveries_total (\S+)$", body, re.MULTILINE)
        n += int(float(m[1])) if m else 0
    return n


def _submit_stuck(cluster: LocalCluster) -> str:
    with tls.sync_channel(cluster.scheduler_address, cluster.client_tls) as ch:
        r = scheduler_pb2_grpc.SchedulerStub(ch).SubmitRequest(scheduler_pb2.SubmitRequestRequest(
            requests=[scheduler_pb2.RequestSpec(prompt_tokens=256, max_new_tokens=2)]),
            timeout=10)
    return r.request_ids[0]


@pytest.fixture(scope="module")
def scraped(tmp_path_factory):
    """The cluster after its work and the injected errors, scraped by Prometheus."""
    work = tmp_path_factory.mktemp("monitoring")
    settings = {"transport": {"kind": "tcp"},
                "scheduler": {"lease_ms": 1000, "retry_backoff_ms": 50,
                              "peer_avoid_ms": 1000, "stuck_after_ms": 1000},
                "transfer": {"timeout_s": 1.0, "recover_attempts": 1},
                "buffers": {"pe_buffer_mib": 64, "de_buffer_mib": 64},
                "storage": {"snic_gbit_per_s": 0.2}}
    with LocalCluster(1, 2, work_dir=str(work / "cluster"), settings=settings) as cluster:
        targets_file = work / "targets.json"
        write_targets(cluster, targets_file)
        prom = Prometheus(work, targets_file)
        try:
            # Scraped before the errors, so that increase() sees them happen.
            for t in write_targets(cluster, targets_file):
                prom.wait(lambda t=t: prom.scrapes(t) >= 1, f"a scrape of {t}", 60)
            # Every hit read on the DE side, slowly (the storage-NIC limit), so the DEs
            # are nearly always writing into p0. After 4 rounds, with their blocks
            # stored: corrupt every block, then SIGSTOP p0 past its lease and the DEs'
            # write timeout — again, a bounded number of times, until a DE's write into
            # it timed out (its connection reset and reconnected).
            def faults(c: LocalCluster) -> None:
                damage_blocks("corrupt")(c)
                for _ in range(MAX_STALLS):
                    stall("p0", 3.0)(c)
                    if recoveries(c):
                        return
                    time.sleep(1.0)

            fault = Fault(after=4, action=faults)
            run = run_replay(cluster, fault, agents=4, rounds=6, seed=5, read_policy="decode")
            assert fault.fired_at, "the replay ended before the faults"
            assert recoveries(cluster), f"no DE write into p0 timed out in {MAX_STALLS} stalls"
            assert run.requests_lost == 0 and run.bytes_mismatched == 0
            targets = write_targets(cluster, targets_file)
            # A request no DE may take: stuck once scheduler.stuck_after_ms passed. It has
            # no payload, which the emulated engines refuse: once the DEs are back it ends
            # FAILED when its failure budget is spent (a failed request).
            stub, ch = cluster.admin()
            with ch:
                des = [f"{n.node_id}/e0" for n in cluster.nodes if n.role == "decode"]
                for e in des:
                    stub.Drain(admin_pb2.DrainRequest(engine_id=e), timeout=10)
                _submit_stuck(cluster)
                prom.wait(lambda: prom.query("dualpath_scheduler_stuck_requests > 0") != [],
                          "the stuck request scraped", 60)
                for e in des:
                    stub.Drain(admin_pb2.DrainRequest(engine_id=e, undo=True), timeout=10)
            prom.wait(lambda: prom.query("dualpath_scheduler_requests_failed_total > 0") != [],
                      "the payload-less request failed", 60)
            for t in targets:    # every daemon scraped at least twice since it (re)started
                prom.wait(lambda t=t: prom.scrapes(t) >= 2, f"two scrapes of {t}", 60)
            yield cluster, prom, targets
        finally:
            prom.close()


def test_every_documented_family_is_scraped_with_its_labels(scraped):
    _, prom, _ = scraped
    families = documented_families()
    assert len(families) >= 40, "docs/metrics.md's tables did not parse"
    missing, wrong = [], []
    for name, (kind, labels) in families.items():
        series = name + ("_count" if kind == "histogram" else "")
        res = prom.query(f'{{__name__="{series}", job="dualpath"}}')
        if not res:
            missing.append(name)
            continue
        got = set().union(*(r["metric"].keys() for r in res)) - {
            "__name__", "instance", "job", "daemon"}
        if got != labels:
            wrong.append(f"{name}: labels {sorted(got)}, documented {sorted(labels)}")
        meta = _get(prom.url + "/api/v1/metadata", {"metric": name})["data"].get(name)
        if meta and meta[0]["type"] != kind:
            wrong.append(f"{name}: type {meta[0]['type']}, documented {kind}")
    assert not missing, f"documented but not scraped: {missing}"
    assert not wrong, wrong


def test_no_undocumented_family(scraped):
    """What the daemons export and the docs do not list (beyond process collectors)."""
    _, prom, _ = scraped
    names = _get(prom.url + "/api/v1/label/__name__/values")["data"]
    ours = {re.sub(r"_(bucket|count|sum)$", "", n) for n in names
            if n.startswith("dualpath_") and not n.startswith("dualpath_process_")}
    documented = set(re.findall(r"`(dualpath_\w+)`", DOCS.read_text()))
    assert ours - documented == set()


def test_promtool_check_metrics_on_every_daemon(scraped):
    assert shutil.which("promtool"), NEEDS
    _, _, targets = scraped
    for hostport in targets:
        body = urllib.request.urlopen(f"http://{hostport}/metrics", timeout=10).read()
        r = subprocess.run(["promtool", "check", "metrics"], input=body,
                           capture_output=True, timeout=60, check=False)
        assert r.returncode == 0 and not r.stdout.strip() and not r.stderr.strip(), \
            f"{hostport}: {r.stdout.decode()}{r.stderr.decode()}"


def _panel_exprs() -> list[tuple[str, str]]:
    d = json.loads(DASHBOARD.read_text())
    out = []
    for p in d["panels"]:
        for t in p.get("targets", []):
            expr = t["expr"]
            for k, v in GRAFANA_VARS.items():
                expr = expr.replace(k, v)
            out.append((p["title"], expr))
    return out


def test_dashboard_structure():
    d = json.loads(DASHBOARD.read_text())
    assert d["title"] and d["uid"] and isinstance(d["panels"], list)
    assert any(i["name"] == "DS_PROMETHEUS" and i["pluginId"] == "prometheus"
               for i in d["__inputs"])
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids)) >= 10
    for p in d["panels"]:
        assert p["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}, p["title"]
        assert p["type"] in ("timeseries", "stat", "gauge", "bargauge"), p["title"]
        assert set(p["gridPos"]) == {"h", "w", "x", "y"}, p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["expr"].strip() and t["refId"], p["title"]
            # No fallback that answers whatever happened.
            assert not re.search(r"\bor\s+(vector|on)\s*\(", t["expr"]), t["expr"]
            assert "absent(" not in t["expr"], t["expr"]
    for title in SHOWS_ERROR:
        assert title in {p["title"] for p in d["panels"]}, title


def test_every_panel_answers_and_shows_the_injected_errors(scraped):
    _, prom, _ = scraped
    empty, quiet = [], []
    positive: dict[str, bool] = {}
    for title, expr in _panel_exprs():
        res = prom.query(expr)
        if not res:
            empty.append(f"{title}: {expr}")
        if title in SHOWS_ERROR:
            positive[title] = positive.get(title, False) or any(
                float(r["value"][1]) > 0 for r in res)
    assert not empty, f"panels with no answer: {empty}"
    quiet = [f"{t} ({SHOWS_ERROR[t]})" for t, ok in positive.items() if not ok]
    assert not quiet, f"panels that do not show the injected error: {quiet}"


def test_recording_rules_answer(scraped):
    _, prom, _ = scraped
    r = _get(prom.url + "/api/v1/rules")["data"]["groups"]
    rules = [x for g in r for x in g["rules"]]
    assert rules, "prometheus loaded no rules"
    assert all(x["health"] == "ok" for x in rules), [
        (x["name"], x.get("lastError")) for x in rules if x["health"] != "ok"]
    for x in rules:
        if x["type"] == "recording":
            assert prom.query(x["query"]), f"recording rule {x['name']} has no answer"


def test_promtool_checks_and_tests_the_rules():
    assert shutil.which("promtool"), NEEDS
    r = subprocess.run(["promtool", "check", "rules", str(RULES)], capture_output=True,
                       text=True, timeout=60, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    r = subprocess.run(["promtool", "test", "rules", str(RULE_TESTS)], capture_output=True,
                       text=True, timeout=60, cwd=RULE_TESTS.parent, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
