"""`dualpath up --engine vllm` on its embedded defaults (SmolLM2-135M-Instruct, 1P1D):
a multi-turn agentic conversation through its OpenAI front end gives the greedy tokens
of vLLM's own prefix-cache run (logprobs: the first bitwise, the rest within TOL; see
the test), and SIGTERM stops every process it started."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from dualpath.cluster.vllm_node import ENGINE_ENV, engine_args
from dualpath.vllm.driver import EngineProcess
from tests.vllm.conftest import Conversation

TOL = 1e-4                            # as tests/vllm/test_connector_tiny.py's TOL


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def _alive(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            os.kill(pid, 0)
            out.append(pid)
        except ProcessLookupError:
            pass
    return out


def _descendants(pid: int) -> list[int]:
    kids = subprocess.run(["pgrep", "-P", str(pid)], check=False, capture_output=True,
                          text=True).stdout
    out = []
    for k in kids.split():
        out += [int(k), *_descendants(int(k))]
    return out


@pytest.fixture(scope="module")
def up(tmp_path_factory, model_dirs):
    tmp = tmp_path_factory.mktemp("up")
    log = open(tmp / "up.log", "w+")  # noqa: SIM115 - closed below
    (tmp / "up.toml").write_text('[frontend]\nlisten = "127.0.0.1:0"\n')
    proc = subprocess.Popen([sys.executable, "-m", "dualpath.cli", "up", "--engine", "vllm",
                             "--decode-nodes", "1", "--max-model-len", "4096",
                             "--config", str(tmp / "up.toml")],
                            stdout=log, stderr=subprocess.STDOUT, cwd=tmp,
                            env={**os.environ, **ENGINE_ENV})
    deadline = time.monotonic() + 600
    url = ""
    while not url:
        assert proc.poll() is None, (tmp / "up.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "dualpath up did not print its URL"
        m = re.search(r"OpenAI API at (http://\S+)/v1", (tmp / "up.log").read_text())
        url = m.group(1) if m else ""
        time.sleep(0.5)
    yield proc, url, tmp
    if proc.poll() is None:
        proc.kill()
    log.close()


def test_up_vllm_serves_smollm2_bitwise_and_stops_everything_on_sigterm(up, model_dirs,
                                                                      tmp_path):
    proc, url, _ = up
    oracle = EngineProcess(engine_args(model_dirs["smollm2"], prefix_caching=True,
                                       max_model_len=4096), tmp_path / "oracle.log",
                           env=ENGINE_ENV)
    try:
        conv = Conversation(seed=11, first=1500, append=300, gen=16)
        for _ in range(3):
            prompt = list(conv.context)
            out = _post(url + "/v1/completions", {
                "model": "smollm2", "prompt": prompt, "max_tokens": conv.gen,
                "temperature": 0, "logprobs": 1, "ignore_eos": True})
            ref = oracle.generate(prompt, conv.gen)
            c = out["choices"][0]
            assert c["token_ids"] == ref["token_ids"]
            lps = c["logprobs"]["token_logprobs"]
            # The first token is the prefill instance's: bitwise. The decode instance
            # computes the prompt's partial last block with it, a chunk of another size
            # than the single instance's decode step, and SmolLM2's 30 layers reduce
            # floats differently there (measured: 2.1e-6 on turn 1, 1.35e-5 on turn 3);
            # the tiny model's P/D runs are bitwise.
            assert lps[0] == ref["logprobs"][0]
            assert max(abs(x - y) for x, y in zip(lps, ref["logprobs"])) <= TOL
            conv.advance(c["token_ids"])
    finally:
        oracle.close()
    family = [proc.pid, *_descendants(proc.pid)]
    assert len(family) >= 6          # scheduler, 2 nodes, 2 vLLM servers, front end
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(120) == 0
    deadline = time.monotonic() + 30
    while _alive(family) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _alive(family), f"still running after SIGTERM: {_alive(family)}"
