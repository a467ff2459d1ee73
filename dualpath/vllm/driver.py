"""A vLLM engine in a child process, driven over a pipe (tests and benches).

vLLM's offline engine spawns its own scheduler and worker processes and keeps global
state; holding each engine in a child of its own lets one test session run several side
by side (DualPath's connector, vLLM's prefix cache, other connectors) and kill one
without touching the others. :class:`EngineProcess` starts ``python -m
dualpath.vllm.driver`` with the engine's arguments as JSON and speaks JSON lines:

    {"op": "generate", "prompt": [ids], "max_tokens": n, "logprobs": k}
        -> {"token_ids": [...], "logprobs": [...], "wall_s": s}   greedy, ignore_eos
    {"op": "reset_prefix_cache"} -> {"ok": true}
    {"op": "quit"}

Logprobs travel as floats, whose JSON form round-trips exactly (Python's repr), so a
bitwise comparison of two engines' outputs is exact.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from dualpath.errors import DualPathError


class EngineDied(DualPathError):
    """The engine process exited or stopped answering."""


class EngineProcess:
    """One vLLM engine (``LLM(**engine_args)``) in a child process. ``env`` adds to the
    child's environment; its log goes to ``log_path``."""

    def __init__(self, engine_args: dict, log_path: Path, *, env: dict | None = None,
                 start_timeout_s: float = 600.0):
        self.log_path = Path(log_path)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - lives as long as the engine
        e = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE",
                                                                      "1"),
             "VLLM_NO_USAGE_STATS": "1", "VLLM_DO_NOT_TRACK": "1", "PYTHONUNBUFFERED": "1",
             "TOKENIZERS_PARALLELISM": "false", **(env or {})}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dualpath.vllm.driver", json.dumps(engine_args)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, env=e,
            start_new_session=True)
        self._lock = threading.Lock()
        self.start_s = time.monotonic()
        ready = self._read(start_timeout_s)
        if ready.get("ready") is not True:
            raise EngineDied(f"vLLM engine did not start: {ready}; see {self.log_path}")
        self.start_s = time.monotonic() - self.start_s

    def _read(self, timeout_s: float) -> dict:
        box: list = []
        t = threading.Thread(target=lambda: box.append(self.proc.stdout.readline()),
                             daemon=True)
        t.start()
        t.join(timeout_s)
        if not box or not box[0]:
            self.kill()
            raise EngineDied(f"vLLM engine {'exited' if box else 'timed out'} (exit "
                             f"{self.proc.poll()}); see {self.log_path}")
        return json.loads(box[0])

    def call(self, msg: dict, timeout_s: float = 300.0) -> dict:
        with self._lock:
            if self.proc.poll() is not None:
                raise EngineDied(f"vLLM engine exited ({self.proc.returncode}); see "
                                 f"{self.log_path}")
            self.proc.stdin.write((json.dumps(msg) + "\n").encode())
            self.proc.stdin.flush()
            reply = self._read(timeout_s)
        if "error" in reply:
            raise EngineDied(f"vLLM engine: {reply['error']}")
        return reply

    def generate(self, prompt: list[int], max_tokens: int, logprobs: int = 1,
                 cache_salt: str = "") -> dict:
        """Greedy tokens after ``prompt``; ``cache_salt``: vLLM's prefix-cache salt (with
        DualPath's connector also the request's tenant)."""
        return self.call({"op": "generate", "prompt": list(map(int, prompt)),
                          "max_tokens": max_tokens, "logprobs": logprobs,
                          "cache_salt": cache_salt})

    def reset_prefix_cache(self) -> None:
        self.call({"op": "reset_prefix_cache"})

    def kill(self) -> None:
        """SIGKILL the engine's whole process group (vLLM's children too)."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                with self._lock:
                    self.proc.stdin.write(b'{"op": "quit"}\n')
                    self.proc.stdin.flush()
                self.proc.wait(60)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.kill()
        self._log.close()


def _serve(args: dict, out) -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kvt = args.pop("kv_transfer_config", None)
    if kvt is not None:
        args["kv_transfer_config"] = KVTransferConfig(**kvt)
    llm = LLM(**args)
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        msg = json.loads(line)
        op = msg.get("op")
        try:
            if op == "quit":
                break
            if op == "reset_prefix_cache":
                reply = {"ok": bool(llm.reset_prefix_cache())}
            elif op == "generate":
                sp = SamplingParams(max_tokens=msg["max_tokens"], temperature=0.0,
                                    logprobs=msg.get("logprobs", 1), ignore_eos=True)
                t0 = time.perf_counter()
                prompt = {"prompt_token_ids": msg["prompt"]}
                if msg.get("cache_salt"):
                    prompt["cache_salt"] = msg["cache_salt"]
                o = llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0]
                wall = time.perf_counter() - t0
                lps = [lp[t].logprob for t, lp in zip(o.token_ids, o.logprobs or [])]
                reply = {"token_ids": list(o.token_ids), "logprobs": lps, "wall_s": wall}
            else:
                reply = {"error": f"unknown op {op!r}"}
        except Exception as e:  # noqa: BLE001 - answered to the parent, which fails
            reply = {"error": f"{type(e).__name__}: {e}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()


if __name__ == "__main__":
    # vLLM logs to stdout (and its children inherit it): the pipe to the parent becomes
    # a private descriptor for our replies, and fd 1 goes to the log.
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    _serve(json.loads(sys.argv[1]), replies)
