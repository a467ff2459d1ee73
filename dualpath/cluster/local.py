"""A local cluster: the scheduler and P prefill + D decode node daemons as separate
processes on this host (what `dualpath up`, `dualpath demo`, bench/e2e.py and the
integration tests run).

Life cycle: ``start()`` makes a throw-away cluster CA and certificates (``tls/``: the
scheduler, one per node naming it, an admin and the replay client), writes one TOML
config per process (block store and the scheduler's journal under the work directory,
the storage-NIC limit, the model profile, a fresh block integrity key, the process's own
[tls]), starts the scheduler, waits until its health check serves over mutual TLS,
starts every node and waits for each one's ready file; ``stop()`` sends SIGTERM to the
nodes, then the scheduler, SIGKILL to whatever has not exited within the grace period,
and SIGKILL to what is left in each one's process group. Every process dies with this
one however it ends, and a work directory this cluster made goes with them
(dualpath/cluster/lifetime.py).

Faults (the kill test, tests/faults/): ``kill(node)``, ``signal(name, sig)``,
``kill_scheduler()`` / ``start_scheduler()`` (same ports, same journal, same
certificates) and ``restart_node(node)``. ``launcher`` prefixes every process's command
line (tests/faults/ runs the cluster in a mount namespace whose store is a small tmpfs,
``nsenter -t PID -m --``; the prefix must exec the command, not fork it).

Threads: one owner thread; nothing here is asynchronous.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

from dualpath import tls
from dualpath.cluster.lifetime import Janitor, child_env, kill_group
from dualpath.cpus import on_cpus
from dualpath.errors import DualPathError, UsageError
from dualpath.metrics import scrape

log = logging.getLogger("dualpath.cluster")


class ClusterError(DualPathError):
    """A cluster process failed to start or died; the message names its log file."""


_HANDED: set[int] = set()      # ports free_port gave out in this process


def free_port(host: str = "127.0.0.1") -> int:
    """A port to listen on later, free now. Taken below the kernel's ephemeral range
    (net.ipv4.ip_local_port_range): a port bind(0) returns is one the next outgoing
    connection of any process on the host may take before its listener binds it (a
    node failed to start so beside vLLM's many connections). Not one handed out before
    by this process; bind(0) when that range has none."""
    lo = _ephemeral_low()
    rng = random.Random()
    for _ in range(64):
        port = rng.randrange(10000, lo) if lo > 10000 else 0
        if port in _HANDED:
            continue
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError:
                continue
            port = s.getsockname()[1]
        _HANDED.add(port)
        return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


def write_toml(path: Path, data: dict[str, dict]) -> None:
    lines = []
    for sec, kv in data.items():
        lines.append(f"[{sec}]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in kv.items()]
        lines.append("")
    path.write_text("\n".join(lines))


@dataclass
class NodeProc:
    node_id: str
    role: str
    proc: subprocess.Popen
    log_path: Path
    address: str = ""


@dataclass
class LocalCluster:
    """See the module docstring. ``settings`` are config sections merged over the
    cluster's defaults (e.g. ``{"storage": {"snic_gbit_per_s": 1.0}}``)."""

    prefill_nodes: int = 1
    decode_nodes: int = 2
    engines_per_node: int = 1
    work_dir: str = ""
    settings: dict = field(default_factory=dict)
    start_timeout_s: float = 60.0
    launcher: list[str] = field(default_factory=list)
    scheduler_address: str = ""
    nodes: list[NodeProc] = field(default_factory=list)
    #: node id -> config sections merged over ``settings`` for that node only (e.g. a
    #: vLLM node's fixed control_listen and the vllm_url of its instance).
    node_settings: dict = field(default_factory=dict)
    #: The address the scheduler (and its /metrics) listens on: loopback, or a bridge's
    #: address that nodes in other network namespaces reach (bench/pipeline.py).
    host: str = "127.0.0.1"
    #: node id -> the command prefix of that node instead of ``launcher`` (e.g.
    #: ``ip netns exec NS``: each node in a network namespace of its own).
    node_launchers: dict = field(default_factory=dict)
    #: The cores of every process the cluster starts (its children inherit them; vLLM's
    #: P/D cluster gives them control cores of their own where the host has spare
    #: ones, dualpath/vllm/sizing.py); empty: anywhere.
    cpus: tuple[int, ...] = ()
    #: More IP addresses the cluster's certificates are valid at (the nodes' own, when
    #: they listen beyond loopback).
    tls_ips: tuple[str, ...] = ()

    def __post_init__(self):
        if self.prefill_nodes < 1 or self.decode_nodes < 1:
            raise UsageError("a cluster needs at least one prefill and one decode node")
        self._own_dir = not self.work_dir
        self.dir = Path(self.work_dir or tempfile.mkdtemp(prefix="dualpath-cluster-"))
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "logs").mkdir(exist_ok=True)
        #: `dualpath ctl --config` this file to steer the cluster (the admin certificate).
        self.config_path = self.dir / "admin.toml"
        self.scheduler: subprocess.Popen | None = None
        self._sched_log: Path | None = None
        self._sched_config: Path | None = None   # the scheduler's own config (start())
        self.pki: tls.ClusterPki | None = None
        #: TLS of the replay driver towards the scheduler, and towards the nodes.
        self.client_tls: tls.TlsConfig = tls.PLAINTEXT
        self.node_tls: tls.TlsConfig = tls.PLAINTEXT
        # A directory of our own is removed even if this process is SIGKILLed.
        self._janitor = Janitor(self.dir) if self._own_dir else None

    def node_ids_planned(self) -> list[str]:
        return ([f"p{i}" for i in range(self.prefill_nodes)]
                + [f"d{i}" for i in range(self.decode_nodes)])

    # ------------------------------------------------------------ config
    def _tls_sections(self) -> dict[str, dict]:
        """Identity -> its [tls] table: the cluster's own throw-away PKI, or the one
        [tls] of the settings for every process (your own PKI, or plaintext)."""
        given = self.settings.get("tls")
        idents = ["scheduler/scheduler", "admin/operator", "client/replay", "client/frontend",
                  *(f"node/{n}" for n in self.node_ids_planned())]
        if given:
            return {i: dict(given) for i in idents}
        self.pki = tls.make_cluster_pki(
            self.dir / "tls", idents,
            ips=tuple(dict.fromkeys(("127.0.0.1", "::1", self.host, *self.tls_ips))))
        return {i: self.pki.section(i) for i in idents}

    def config_data(self, port: int) -> dict[str, dict]:
        soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        data: dict[str, dict] = {
            # /metrics on free ports (each process logs its URL).
            "scheduler": {"listen": f"{self.host}:{port}", "model_profile": "demo",
                          "lease_ms": 2000, "fetch_interval_ms": 5,
                          "metrics_listen": f"{self.host}:0",
                          "journal_file": str(self.dir / "scheduler.sqlite")},
            "scheduler_client": {"address": f"{self.host}:{port}"},
            "storage": {"dir": str(self.dir / "kv"), "fsync": False, "direct_io": "off"},
            # Pinning needs RLIMIT_MEMLOCK; a local cluster runs where it is small.
            "buffers": {"mlock": soft == resource.RLIM_INFINITY, "pe_buffer_mib": 512,
                        "de_buffer_mib": 512, "huge_pages": "off"},
            "engine": {"engines_per_node": self.engines_per_node,
                       "metrics_listen": "127.0.0.1:0"},
            "transfer": {"connections_per_peer": 1},
        }
        for sec, kv in self.settings.items():
            if sec != "tls":
                data.setdefault(sec, {}).update(kv)
        if "integrity_key_file" not in data["storage"]:
            # Blocks carry a keyed tag (a fresh cluster key per local cluster).
            key_path = self.dir / "kv-integrity.key"
            if not key_path.exists():
                fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "wb") as fh:
                    fh.write(os.urandom(32))
            data["storage"]["integrity_key_file"] = str(key_path)
        rate = data["storage"].get("snic_gbit_per_s", 0.0)
        if rate and "storage_read_bytes_per_s" not in data["scheduler"]:
            data["scheduler"]["storage_read_bytes_per_s"] = rate * 1e9 / 8
        data["scheduler"]["model_profile"] = data["engine"].get("model_profile", "demo")
        return data

    # ------------------------------------------------------------ processes
    def _spawn(self, name: str, argv: list[str], extra_env: dict | None = None,
               launcher: list[str] | None = None) -> tuple[subprocess.Popen, Path]:
        path = self.dir / "logs" / f"{name}.log"
        fh = open(path, "ab")  # noqa: SIM115 - the child owns it; closed below
        env = child_env()       # it dies with this process (PR_SET_PDEATHSIG)
        env.update(extra_env or {})
        env.setdefault("DUALPATH_LOG", "INFO")
        try:
            # Its own session, hence its own process group: what it starts dies with it.
            prefix = [*on_cpus(self.cpus), *(self.launcher if launcher is None else launcher)]
            proc = subprocess.Popen([*prefix, sys.executable, "-m", "dualpath.cli",
                                     *argv],
                                    stdout=fh, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)
        finally:
            fh.close()
        if self._janitor is not None:
            self._janitor.watch(proc.pid)
        return proc, path

    def _write_config(self, name: str, data: dict, tls_section: dict) -> Path:
        path = self.dir / f"{name}.toml"
        write_toml(path, {**data, "tls": tls_section})
        return path

    def start(self) -> Self:
        port = free_port(self.host)
        data = self.config_data(port)
        sections = self._tls_sections()
        self.scheduler_address = f"{self.host}:{port}"
        self._sched_config = self._write_config("scheduler", data,
                                                sections["scheduler/scheduler"])
        self._write_config("admin", data, sections["admin/operator"])
        self._write_config("frontend", data, sections["client/frontend"])
        for nid in self.node_ids_planned():
            mine = {sec: dict(kv) for sec, kv in data.items()}
            for sec, kv in self.node_settings.get(nid, {}).items():
                mine.setdefault(sec, {}).update(kv)
            self._write_config(f"node-{nid}", mine, sections[f"node/{nid}"])
        self.client_tls = config_tls(sections["client/replay"])
        self.node_tls = self.client_tls      # the nodes speak mutual TLS like the rest
        try:
            self.start_scheduler()
            roles = ([("prefill", f"p{i}") for i in range(self.prefill_nodes)]
                     + [("decode", f"d{i}") for i in range(self.decode_nodes)])
            for role, nid in roles:
                self.start_node(role, nid)
            for n in self.nodes:
                self._wait_ready(n)
        except BaseException:
            self.stop()
            raise
        log.info("local cluster up: scheduler %s, %s; %s; logs in %s", self.scheduler_address,
                 ", ".join(f"{n.node_id}={n.address}" for n in self.nodes),
                 f"TLS {tls.mode(self.node_tls)} (CA {self.node_tls.ca_file})"
                 if self.node_tls.enabled else "TLS plaintext", self.dir / "logs")
        return self

    def start_scheduler(self) -> None:
        """(Re)start the scheduler on the cluster's port, with its journal: a restarted
        one recovers what the killed one acknowledged. Returns once it serves."""
        if self.scheduler is not None and self.scheduler.poll() is None:
            raise UsageError("the scheduler is running")
        if self._sched_config is None:
            raise UsageError("start() the cluster first (it writes the scheduler's config)")
        self.scheduler, self._sched_log = self._spawn(
            "scheduler", ["scheduler", "--config", str(self._sched_config)])
        self._wait_scheduler()

    def kill_scheduler(self) -> None:
        """SIGKILL the scheduler (its journal keeps what it acknowledged)."""
        self._kill(self.scheduler, "scheduler")

    def restart_node(self, node_id: str, env: dict | None = None) -> NodeProc:
        """Start a node again under its id (after a kill) and wait until it is ready;
        ``env`` adds to its environment (e.g. DUALPATH_FAULTS for a negative control)."""
        old = self.node(node_id)
        if old.proc.poll() is None:
            raise UsageError(f"node {node_id} is running")
        self.nodes.remove(old)
        n = self.start_node(old.role, node_id, env)
        self._wait_ready(n)
        return n

    def signal(self, name: str, sig: int) -> None:
        """Send ``sig`` to the scheduler (``name`` "scheduler") or a node (SIGSTOP and
        SIGCONT for a stalled process, SIGTERM for a graceful stop)."""
        proc = self.scheduler if name == "scheduler" else self.node(name).proc
        proc.send_signal(sig)

    def _kill(self, proc: subprocess.Popen | None, what: str) -> None:
        if proc is None:
            raise UsageError(f"{what} was never started")
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        kill_group(proc.pid)
        log.info("killed %s (pid %d)", what, proc.pid)

    def start_node(self, role: str, node_id: str, env: dict | None = None) -> NodeProc:
        ready = self.dir / f"{node_id}.ready"
        with contextlib.suppress(FileNotFoundError):
            ready.unlink()
        cfg = self.dir / f"node-{node_id}.toml"   # written by start(), with its identity
        proc, path = self._spawn(node_id, [
            "node", "--role", role, "--node-id", node_id, "--scheduler",
            self.scheduler_address, "--config", str(cfg), "--ready-file", str(ready)], env,
            self.node_launchers.get(node_id))
        n = NodeProc(node_id, role, proc, path)
        self.nodes.append(n)
        return n

    def _deadline_check(self, proc: subprocess.Popen, what: str, log_path: Path,
                        deadline: float) -> None:
        if proc.poll() is not None:
            raise ClusterError(f"{what} exited with status {proc.returncode} during start-up; "
                               f"see {log_path}:\n{log_tail(log_path)}")
        if time.monotonic() > deadline:
            raise ClusterError(f"{what} not ready within {self.start_timeout_s:g} s; see "
                               f"{log_path}:\n{log_tail(log_path)}")

    def _wait_scheduler(self) -> None:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        deadline = time.monotonic() + self.start_timeout_s
        with tls.sync_channel(self.scheduler_address, self.client_tls,
                              expect=self.client_tls.scheduler_identity) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            while True:
                self._deadline_check(self.scheduler, "the scheduler", self._sched_log,
                                     deadline)
                try:
                    r = stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
                    if r.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.1)

    def _wait_ready(self, n: NodeProc) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        ready = self.dir / f"{n.node_id}.ready"
        while not ready.exists():
            self._deadline_check(n.proc, f"node {n.node_id}", n.log_path, deadline)
            time.sleep(0.1)
        n.address = ready.read_text().strip()

    def kill(self, node_id: str) -> None:
        """SIGKILL one node process (its lease lapses; the scheduler requeues its work)."""
        self._kill(self.node(node_id).proc, f"node {node_id}")

    def node(self, node_id: str) -> NodeProc:
        for n in self.nodes:
            if n.node_id == node_id:
                return n
        raise UsageError(f"no node {node_id!r} in this cluster")

    def node_ids(self) -> list[str]:
        """Prefill nodes first (the order reports list storage NICs in)."""
        return [n.node_id for n in self.nodes if n.role == "prefill"] + \
            [n.node_id for n in self.nodes if n.role == "decode"]

    def node_metrics(self, name: str) -> dict[str, float]:
        """Daemon ``name``'s /metrics (the URL its log names last: a restart moves it):
        sample name (labels dropped, summed) -> value."""
        text = (self.dir / "logs" / f"{name}.log").read_text()
        urls = re.findall(r"metrics: serving (http://\S+/metrics)", text)
        if not urls:
            raise ClusterError(f"{name} logged no metrics URL")
        return scrape(urls[-1])

    def addresses(self) -> dict[str, str]:
        """node id -> control address (the Node service), prefill nodes first."""
        return {nid: self.node(nid).address for nid in self.node_ids()}

    def admin(self):
        """An Admin stub (the cluster's admin certificate) and its channel."""
        from dualpath.v1 import admin_pb2_grpc

        cfg = config_tls(self.pki.section("admin/operator"))
        ch = tls.sync_channel(self.scheduler_address, cfg, expect=cfg.scheduler_identity)
        return admin_pb2_grpc.AdminStub(ch), ch

    def dead(self) -> list[str]:
        procs = [(n.node_id, n.proc) for n in self.nodes]
        if self.scheduler is not None:
            procs.append(("scheduler", self.scheduler))
        return [name for name, p in procs if p.poll() is not None]

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM nodes, then the scheduler; SIGKILL stragglers and whatever is left in
        their process groups. Idempotent."""
        groups = [[n.proc for n in self.nodes], [self.scheduler] if self.scheduler else []]
        for procs in groups:
            live = [p for p in procs if p.poll() is None]
            for p in live:
                p.send_signal(signal.SIGCONT)   # a stopped (SIGSTOP) one cannot exit
                p.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            for p in live:
                try:
                    p.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    log.warning("pid %d ignored SIGTERM for %g s; killing it", p.pid, grace_s)
                    p.kill()
                    p.wait()
            for p in procs:
                kill_group(p.pid)

    def cleanup(self, keep: bool = False, keep_logs: bool = False) -> None:
        """Remove a work directory this cluster made (after stop()); ``keep`` leaves it
        whole and only dismisses the janitor; ``keep_logs`` removes all but its logs."""
        if self._own_dir and not keep:
            if keep_logs:
                for p in self.dir.iterdir():
                    if p.name != "logs":
                        if p.is_dir() and not p.is_symlink():
                            shutil.rmtree(p, ignore_errors=True)
                        else:
                            p.unlink(missing_ok=True)
            else:
                shutil.rmtree(self.dir, ignore_errors=True)
        if self._janitor is not None:
            self._janitor.finish(keep or keep_logs)
            self._janitor = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def log_tail(path: Path, lines: int = 15) -> str:
    """The last ``lines`` of a log, for an error that names it."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def config_tls(section: dict) -> tls.TlsConfig:
    """A [tls] table as the validated section object."""
    from dualpath.config import build_section

    return build_section(tls.TlsConfig, section, "tls")
