"""Prefill/decode disaggregation with vLLM instances on this host (`dualpath up --engine
vllm`, the P/D tests and bench/vllm_pd.py).

:class:`VllmPdCluster` is a :class:`~dualpath.cluster.local.LocalCluster` whose nodes'
engine is vLLM: a scheduler, P prefill nodes and D decode nodes (mutual TLS, a
throw-away PKI), and beside each node one ``vllm serve`` (vLLM's OpenAI server) whose
DualPathConnector attaches to it: ``kv_producer`` instances beside prefill nodes,
``kv_consumer`` beside decode nodes, vLLM's prefix cache off unless ``prefix_caching``
(the tests: every hit comes through DualPath; `up` turns it on). Each node drives its
instance (``engine.vllm_url``) and registers with the scheduler once the instance's
worker attached. Every instance runs in its own process group and is killed with it at
:meth:`stop`.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from dualpath.cluster.lifetime import child_env, exec_argv, kill_group, terminate_group
from dualpath.cluster.local import ClusterError, LocalCluster, free_port, log_tail
from dualpath.cluster.vllm_node import CONNECTOR, ENGINE_ENV
from dualpath.cpus import on_cpus
from dualpath.errors import UsageError
from dualpath.metrics import scrape
from dualpath.vllm.sizing import plan_buffers, plan_cores, rank_binds

log = logging.getLogger("dualpath.cluster")


class VllmInstanceProc:
    """One ``vllm serve`` child (its own process group)."""

    def __init__(self, name: str, proc: subprocess.Popen, url: str, log_path: Path):
        self.name, self.proc, self.url, self.log_path = name, proc, url, log_path

    def kill(self) -> None:
        """SIGKILL its whole process group (vLLM's engine core included)."""
        if self.proc.poll() is None:
            kill_group(self.proc.pid)
            self.proc.wait()


class VllmPdCluster:
    """See the module docstring. ``model`` is a local model directory; ``settings``
    config sections for every process (merged over the P/D defaults)."""

    def __init__(self, model: Path, *, prefill_nodes: int = 1, decode_nodes: int = 1,
                 work_dir: str = "", settings: dict | None = None, max_model_len: int = 4096,
                 kv_cache_gib: int = 1, start_timeout_s: float = 600.0,
                 frontend: dict | None = None, prefix_caching: bool = False,
                 concurrency: int = 4, cores: list[int] | None = None,
                 progress=None, prefill_tp: int = 1, decode_tp: int = 1):
        if prefill_nodes < 1 or decode_nodes < 1:
            raise UsageError("a P/D cluster needs at least one prefill and one decode node")
        for role, tp in (("prefill", prefill_tp), ("decode", decode_tp)):
            if not 1 <= tp <= 64:
                raise UsageError(f"--{role}-tp must be 1..64, not {tp}")
        self.model = Path(model)
        #: Tensor-parallel size of the instances of each role ("p", "d").
        self.tp = {"p": prefill_tp, "d": decode_tp}
        #: One line per start-up stage (the `up` command prints them; else the log).
        self.progress = progress or log.info
        self.max_model_len = max_model_len
        self.kv_cache_gib = kv_cache_gib
        self.start_timeout_s = start_timeout_s
        #: vLLM's own prefix cache in every instance (the oracle mode of bench/vllm_pd.py:
        #: hits from vLLM's memory); off, every hit comes through DualPath.
        self.prefix_caching = prefix_caching
        ids = [f"p{i}" for i in range(prefill_nodes)] + [f"d{i}" for i in range(decode_nodes)]
        self.ports = {nid: (free_port(), free_port()) for nid in ids}   # control, HTTP
        #: node id -> the port of its /metrics (fixed, so benches can read it).
        self.metrics_ports = {nid: free_port() for nid in ids}
        #: Each node's buffer, from the model's KV bytes per token, the context and
        #: ``concurrency`` (dualpath/vllm/sizing.py); [buffers] in ``settings`` wins.
        self.buffers = plan_buffers(self.model, max_model_len, concurrency)
        self.scheduler_metrics_port = free_port()
        # Nodes fetch every 20 ms (the scheduler's default), not the local cluster's 5:
        # a busy node fetches every interval, and at 5 ms the fetches of a 1P1D
        # cluster took 0.3 of a core (a K = 8 burst: scheduler 1.2-1.6 CPU s, nodes
        # 1.4-1.8, against 0.45 and 0.74 at 20 ms) from instances whose requests take
        # seconds.
        base = {"engine": {"kind": "vllm"},
                "scheduler": {"metrics_listen": f"127.0.0.1:{self.scheduler_metrics_port}",
                              "fetch_interval_ms": 20},
                "buffers": {"pe_buffer_mib": self.buffers.mib,
                            "de_buffer_mib": self.buffers.mib},
                "transport": {"kind": "tcp"}}
        for sec, kv in (settings or {}).items():
            base.setdefault(sec, {}).update(kv)
        self.buffer_mib = {k: base["buffers"][k] for k in ("pe_buffer_mib", "de_buffer_mib")}
        #: Each instance's cores (VLLM_CPU_OMP_THREADS_BIND), in node order, and the
        #: control cores of every other process (dualpath/vllm/sizing.py).
        self.core_plan = plan_cores(prefill_nodes, decode_nodes, cores)
        self.cores = dict(zip(ids, self.core_plan.instances))
        per_node = {nid: {"engine": {
            "control_listen": f"127.0.0.1:{c}", "vllm_url": f"http://127.0.0.1:{h}",
            "metrics_listen": f"127.0.0.1:{self.metrics_ports[nid]}"}}
            for nid, (c, h) in self.ports.items()}
        self.cluster = LocalCluster(prefill_nodes=prefill_nodes, decode_nodes=decode_nodes,
                                    work_dir=work_dir, settings=base, node_settings=per_node,
                                    start_timeout_s=min(start_timeout_s, 120.0),
                                    cpus=self.core_plan.control)
        self.instances: dict[str, VllmInstanceProc] = {}
        #: [frontend] settings: start `dualpath frontend` too (None: no front end).
        self.frontend_settings = frontend
        self.frontend: subprocess.Popen | None = None
        self.frontend_url = ""

    @property
    def dir(self) -> Path:
        return self.cluster.dir

    def addresses(self) -> str:
        """Where an operator looks: each node's /metrics, the front end's, and the
        admin config `dualpath ctl` takes."""
        fe = f", front end {self.frontend_url}/metrics" if self.frontend_url else ""
        return ("metrics: " + ", ".join(f"{nid} http://127.0.0.1:{p}/metrics"
                                        for nid, p in self.metrics_ports.items())
                + f", scheduler http://127.0.0.1:{self.scheduler_metrics_port}/metrics{fe}; "
                f"`dualpath ctl "
                f"... --config {self.cluster.config_path}` steers the scheduler")

    def describe(self) -> str:
        """The derived settings, for the start-up banner."""
        b = self.buffer_mib
        return (f"buffers: PE {b['pe_buffer_mib']} MiB, DE {b['de_buffer_mib']} MiB "
                f"(derived: {self.buffers.describe()}); vLLM cores: "
                + ", ".join(f"{nid} [{rank_binds(c, self.tp[nid[0]])}]"
                            for nid, c in self.cores.items())
                + f"; tensor parallelism: prefill {self.tp['p']}, decode {self.tp['d']}"
                + f"; {self.core_plan.describe()}")

    def start(self) -> VllmPdCluster:
        log.info("vLLM P/D cluster: %s", self.describe())
        t0 = time.monotonic()

        def stage(what: str) -> None:
            self.progress(f"[{time.monotonic() - t0:5.1f} s] {what}")
        c = self.cluster
        stage("starting the scheduler and the node daemons")
        c.start()
        try:
            stage(f"node daemons up; starting {len(c.nodes)} vLLM instances (loading the "
                  "model, profiling its KV cache)")
            for n in c.nodes:
                self.start_instance(n.node_id)
            for nid in list(self.instances):
                self._wait_instance(nid)
                stage(f"vLLM beside {nid} serves")
            self._wait_registered()
            stage("every node registered with the scheduler")
            if self.frontend_settings is not None:
                self._start_frontend()
                stage(f"front end at {self.frontend_url}")
        except BaseException:
            self.stop()
            raise
        log.info("vLLM P/D cluster up: %s", ", ".join(
            f"{nid} (node {c.node(nid).address}, vLLM {i.url})"
            for nid, i in self.instances.items()))
        return self

    def _start_frontend(self) -> None:
        """`dualpath frontend` (its own config: [frontend] over the model's tokenizer,
        the scheduler, the cluster's client/frontend identity)."""
        import tomllib

        from dualpath.cluster.local import write_toml

        path = self.dir / "frontend.toml"
        data = tomllib.loads(path.read_text())
        data["frontend"] = {"tokenizer": str(self.model), "model": self.model.name,
                            "listen": "127.0.0.1:0", "max_model_len": self.max_model_len,
                            **self.frontend_settings}
        write_toml(path, data)
        ready = self.dir / "frontend.ready"
        ready.unlink(missing_ok=True)
        self.frontend, log_path = self.cluster._spawn(
            "frontend", ["frontend", "--config", str(path), "--ready-file", str(ready)])
        deadline = time.monotonic() + 120
        while not ready.exists():
            if self.frontend.poll() is not None or time.monotonic() > deadline:
                raise ClusterError(f"the front end did not start; see {log_path}:\n"
                                   f"{log_tail(log_path)}")
            time.sleep(0.1)
        self.frontend_url = ready.read_text().strip()

    def dead(self) -> list[str]:
        """What died: the cluster's processes, the vLLM instances, the front end."""
        out = self.cluster.dead()
        out += [f"vllm-{nid}" for nid, i in self.instances.items() if i.proc.poll() is not None]
        if self.frontend is not None and self.frontend.poll() is not None:
            out.append("frontend")
        return out

    def start_instance(self, node_id: str) -> VllmInstanceProc:
        """(Re)start the vLLM instance beside ``node_id`` (not waiting for it)."""
        control, http = self.ports[node_id]
        role = "kv_producer" if node_id.startswith("p") else "kv_consumer"
        kvt = {**CONNECTOR, "kv_role": role, "kv_connector_extra_config": {
            "node_address": f"127.0.0.1:{control}",
            "config": str(self.dir / f"node-{node_id}.toml")}}
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                "--model", str(self.model), "--served-model-name", self.model.name,
                "--host", "127.0.0.1", "--port", str(http), "--dtype", "float32",
                "--enforce-eager", "--seed", "0",
                "--enable-prefix-caching" if self.prefix_caching
                else "--no-enable-prefix-caching",
                "--max-model-len", str(self.max_model_len),
                "--tensor-parallel-size", str(self.tp[node_id[0]]),
                "--kv-transfer-config", json.dumps(kvt)]
        env = child_env({**os.environ, **ENGINE_ENV,
                         "VLLM_CPU_OMP_THREADS_BIND": rank_binds(self.cores[node_id],
                                                                 self.tp[node_id[0]]),
                         "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib),
                         "VLLM_NO_USAGE_STATS": "1", "VLLM_DO_NOT_TRACK": "1",
                         "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"})
        path = self.dir / "logs" / f"vllm-{node_id}.log"
        with open(path, "ab") as fh:
            # It dies with us (pdeathsig), and its process group (vLLM's engine core and
            # workers) with the cluster's janitor when we are killed.
            # Its API server and engine core on the control cores (its OpenMP threads
            # bind themselves to the instance's own).
            proc = subprocess.Popen(on_cpus(self.cluster.cpus) + exec_argv(argv),
                                    stdout=fh, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)
        if self.cluster._janitor is not None:
            self.cluster._janitor.watch(proc.pid)
        inst = VllmInstanceProc(node_id, proc, f"http://127.0.0.1:{http}", path)
        self.instances[node_id] = inst
        return inst

    def _wait_instance(self, node_id: str) -> None:
        inst = self.instances[node_id]
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            if inst.proc.poll() is not None:
                raise ClusterError(f"vLLM beside {node_id} exited ({inst.proc.returncode}); "
                                   f"see {inst.log_path}:\n{log_tail(inst.log_path)}")
            try:
                with urllib.request.urlopen(inst.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise ClusterError(f"vLLM beside {node_id} not up in "
                                   f"{self.start_timeout_s:g} s; see {inst.log_path}:\n"
                                   f"{log_tail(inst.log_path)}")
            time.sleep(0.5)

    def _wait_registered(self, timeout_s: float = 120.0) -> None:
        """Until every node logged its registration with the scheduler."""
        deadline = time.monotonic() + timeout_s
        for n in self.cluster.nodes:
            while "group registered" not in n.log_path.read_text(errors="replace"):
                if n.proc.poll() is not None or time.monotonic() > deadline:
                    raise ClusterError(f"node {n.node_id} did not register; see "
                                       f"{n.log_path}:\n{log_tail(n.log_path)}")
                time.sleep(0.2)

    def restart_instance(self, node_id: str) -> None:
        """SIGKILL the instance beside ``node_id`` (if it runs), start it again and wait
        until it serves and its worker attached."""
        attaches = self._count(node_id, "vLLM worker")
        self.instances[node_id].kill()
        self.start_instance(node_id)
        self._wait_instance(node_id)
        self._wait_log(node_id, "vLLM worker", attaches + 1)

    def _count(self, node_id: str, text: str) -> int:
        return self.cluster.node(node_id).log_path.read_text(errors="replace").count(text)

    def _wait_log(self, node_id: str, text: str, count: int, timeout_s: float = 120.0
                  ) -> None:
        n = self.cluster.node(node_id)
        deadline = time.monotonic() + timeout_s
        while self._count(node_id, text) < count:
            if n.proc.poll() is not None or time.monotonic() > deadline:
                raise ClusterError(f"node {node_id}: no {text!r} #{count}; see {n.log_path}")
            time.sleep(0.1)

    def registrations(self, node_id: str) -> int:
        """How often ``node_id`` registered its group (its log says so each time)."""
        return self._count(node_id, "group registered")

    def kill_node(self, node_id: str) -> None:
        """SIGKILL a node daemon (its instance keeps running)."""
        self.cluster.kill(node_id)

    def restart_node(self, node_id: str, env: dict | None = None) -> None:
        """Start a stopped or killed node daemon again (``env`` adds to its environment)
        and wait until its instance's worker attached again and it registered."""
        n = self.cluster.node(node_id)
        if n.proc.poll() is None:
            n.proc.send_signal(signal.SIGTERM)
            n.proc.wait(30)
        seen = self.registrations(node_id)
        self.cluster.restart_node(node_id, env)
        self._wait_log(node_id, "group registered", seen + 1)

    def admin(self):
        """An Admin stub (the cluster's admin certificate) and its channel."""
        return self.cluster.admin()

    def node_metrics(self, node_id: str) -> dict[str, float]:
        """``node_id``'s /metrics: sample name (labels dropped, summed) -> value."""
        return scrape(f"http://127.0.0.1:{self.metrics_ports[node_id]}/metrics")

    def wait_written(self, timeout_s: float = 900.0) -> float:
        """Until no node has committed blocks left to persist (write-back drained);
        the seconds it took."""
        t0 = time.monotonic()
        while any(self.node_metrics(n.node_id).get("dualpath_node_connector_pending_blocks")
                  for n in self.cluster.nodes):
            if time.monotonic() - t0 > timeout_s:
                raise ClusterError(f"write-back not drained in {timeout_s:g} s")
            time.sleep(0.5)
        return time.monotonic() - t0

    def stop(self) -> None:
        """The front end, every vLLM instance (SIGTERM, then its group killed), then the
        cluster. Idempotent."""
        if self.frontend is not None:
            terminate_group(self.frontend, 10)
        for inst in self.instances.values():
            if inst.proc.poll() is None:
                inst.proc.send_signal(signal.SIGTERM)
        for inst in self.instances.values():
            try:
                inst.proc.wait(20)
            except subprocess.TimeoutExpired:
                pass
            inst.kill()
            kill_group(inst.proc.pid)
        self.cluster.stop()

    def cleanup(self, keep: bool = False, keep_logs: bool = False) -> None:
        self.cluster.cleanup(keep, keep_logs)
