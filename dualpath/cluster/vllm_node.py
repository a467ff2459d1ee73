"""A vLLM instance and its node daemon on this host (the vLLM tests and benches).

:class:`NodeProcess` runs ``dualpath node --role both --engine vllm`` as a child on a
fixed port (so a vLLM instance's connector finds it again after a restart) with its
block store in a directory of the caller's; :func:`engine_args` builds the arguments of
an :class:`~dualpath.vllm.driver.EngineProcess` with DualPath's connector, or without
(vLLM's own prefix cache: the oracle for "the loaded KV is the KV").

:data:`ENGINE_ENV` pins vLLM's CPU threads alike in every engine: vLLM reserves one more
core whenever any KV connector is configured (vllm/utils/ompmultiprocessing.py), so on a
small host an engine with a connector would run its model on another number of threads
than one without, and float reductions in another order (measured: logprobs differing by
up to 8.6e-6 with a connector that does nothing).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from dualpath import tls
from dualpath.cluster.lifetime import child_env, exec_argv, terminate_group
from dualpath.cluster.local import free_port, write_toml
from dualpath.errors import DualPathError

ENGINE_ENV = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
CONNECTOR = {"kv_connector": "DualPathConnector",
             "kv_connector_module_path": "dualpath.vllm.connector",
             "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}


def engine_args(model: Path, *, node: NodeProcess | None = None, prefix_caching: bool,
                max_model_len: int = 8192, **extra) -> dict:
    """``LLM(...)`` arguments: float32, eager, seeded; DualPath's connector towards
    ``node`` when given."""
    args = {"model": str(model), "dtype": "float32", "max_model_len": max_model_len,
            "enforce_eager": True, "seed": 0, "enable_prefix_caching": prefix_caching,
            **extra}
    if node is not None:
        args["kv_transfer_config"] = {**CONNECTOR, "kv_connector_extra_config": {
            "node_address": node.address, "config": str(node.config_path)}}
    return args


class NodeProcess:
    """``dualpath node --role both --engine vllm`` in a child process. ``settings`` are
    config sections merged over the defaults below; ``env`` adds to its environment
    (e.g. DUALPATH_FAULTS for a negative control). start/stop/kill/restart.

    Mutual TLS unless ``settings`` has a [tls]: a throw-away CA and the node's
    certificate (``pki``), in the node's config, which the connector reads too (it calls
    as the node)."""

    def __init__(self, work_dir: Path, name: str = "n0", *, settings: dict | None = None,
                 env: dict | None = None):
        self.dir = Path(work_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.name = name
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.store_dir = self.dir / "kv"
        sections = {"engine": {"kind": "vllm", "control_listen": self.address,
                               "metrics_listen": f"127.0.0.1:{free_port()}"},
                    "transport": {"kind": "tcp"},
                    "storage": {"dir": str(self.store_dir)},
                    "buffers": {"pe_buffer_mib": 256, "mlock": False}}
        self.pki: tls.ClusterPki | None = None
        if "tls" not in (settings or {}):
            self.pki = tls.make_cluster_pki(self.dir / "tls", [f"node/{name}",
                                                              "client/test"])
            sections["tls"] = self.pki.section(f"node/{name}")
        for sec, kv in (settings or {}).items():
            sections.setdefault(sec, {}).update(kv)
        self.metrics_url = f"http://{sections['engine']['metrics_listen']}/metrics"
        self.config_path = self.dir / f"{name}.toml"
        write_toml(self.config_path, sections)
        self.env = dict(env or {})
        self.proc: subprocess.Popen | None = None
        self.log_path = self.dir / f"{name}.log"

    def start(self, timeout_s: float = 60.0, env: dict | None = None) -> NodeProcess:
        ready = self.dir / f"{self.name}.ready"
        ready.unlink(missing_ok=True)
        e = {**os.environ, **self.env, **(env or {})}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "dualpath.cli", "node", "--role", "both", "--node-id",
                 self.name, "--config", str(self.config_path), "--ready-file", str(ready)],
                stdout=log, stderr=log, env=e, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while not ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise DualPathError(f"node {self.name} did not start; see {self.log_path}")
            time.sleep(0.05)
        return self

    def kill(self) -> None:
        """SIGKILL (a crash)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM, then SIGKILL past ``timeout_s``; the exit status."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode

    def restart(self, env: dict | None = None) -> NodeProcess:
        self.stop()
        return self.start(env=env)

    def metric(self, name: str) -> float:
        """The value of an unlabelled metric on the node's /metrics (plain HTTP: the
        metrics endpoint is for scrapers on the host)."""
        text = urllib.request.urlopen(self.metrics_url, timeout=10).read().decode()
        for line in text.splitlines():
            if line.startswith((name + " ", name + "{")):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(f"{name} not on {self.metrics_url}")


class PlainVllm:
    """One plain vLLM OpenAI server, prefix caching on, no connector: the reference for
    the API and for speed (bench/vllm_load.py, tests/vllm). ``cores``: its
    VLLM_CPU_OMP_THREADS_BIND (as many threads as DualPath's instances have for bitwise
    comparisons). ``start()`` until /health answers; ``stop()``."""

    def __init__(self, model: Path, max_model_len: int, kv_cache_gib: int, work: Path,
                 cores: str):
        self.model, self.port = model, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = work / "plain-vllm.log"
        self.argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                     "--model", str(model), "--served-model-name", model.name,
                     "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32",
                     "--enforce-eager", "--seed", "0", "--enable-prefix-caching",
                     "--max-model-len", str(max_model_len)]
        self.env = child_env({**os.environ, **ENGINE_ENV,
                              "VLLM_CPU_OMP_THREADS_BIND": cores,
                              "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
                              "VLLM_NO_USAGE_STATS": "1", "VLLM_DO_NOT_TRACK": "1",
                              "TOKENIZERS_PARALLELISM": "false"})
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 600.0) -> PlainVllm:
        with open(self.log_path, "ab") as fh:
            self.proc = subprocess.Popen(exec_argv(self.argv), stdout=fh,
                                         stderr=subprocess.STDOUT, env=self.env,
                                         start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise DualPathError(f"plain vLLM exited; see {self.log_path}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise DualPathError(f"plain vLLM not up in {timeout_s:g} s; see "
                                    f"{self.log_path}")
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc is not None:
            terminate_group(self.proc, 20)
