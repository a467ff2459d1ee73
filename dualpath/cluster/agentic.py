"""Agentic trajectories with a real model's tokens (`dualpath replay --engine vllm`,
bench/vllm_pd.py).

Each trajectory is one agent: round k's prompt is the previous round's prompt, the
tokens the model actually generated for it, and round k's appended tokens (the paper's
A.3 rule with real generations); it asks for exactly ``g_k`` tokens (``ignore_eos``).
Appended ids are the trace's stream ids at their positions, taken modulo the model's
vocabulary. The agents run concurrently (offline: all start at once, at most
``concurrency`` requests in flight); :func:`run_agents` takes the call that generates
(through the front end's HTTP API, or the scheduler directly) and returns one
:class:`RoundRecord` per round.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from dualpath.errors import DualPathError
from dualpath.trace.model import Trace, Trajectory, stream_token_ids


@dataclass(frozen=True)
class Generation:
    token_ids: list[int]
    first_token_s: float        # seconds from submission to the first token
    finish_s: float             # seconds from submission to the last


@dataclass(frozen=True)
class RoundRecord:
    trajectory: str
    round: int
    prompt_tokens: int
    hit_tokens: int             # the previous context's full blocks (what A.3 expects hit)
    gen_tokens: int
    submit_s: float             # since the run began
    first_token_s: float        # latency of the first token (TTFT)
    finish_s: float             # latency of the last
    token_ids: tuple[int, ...]

    @property
    def tpot_s(self) -> float:
        return (self.finish_s - self.first_token_s) / max(self.gen_tokens - 1, 1)


#: (request id, prompt ids, tokens to generate, expected hit tokens) -> its generation.
Generate = Callable[[str, list[int], int, int], Awaitable[Generation]]


async def run_agents(trace: Trace, generate: Generate, *, vocab: int, block_tokens: int,
                     tag: str, concurrency: int = 64) -> list[RoundRecord]:
    gate = asyncio.Semaphore(concurrency)
    t0 = time.monotonic()
    records: list[RoundRecord] = []

    async def agent(traj: Trajectory) -> None:
        context: list[int] = []
        pos = 0                         # position in the trace's own stream
        for k, r in enumerate(traj.rounds):
            append = (stream_token_ids(traj, pos, pos + r.append_tokens) % vocab).tolist()
            pos += r.append_tokens + r.gen_tokens
            prompt = context + append
            hit = max(len(context) - 1, 0) // block_tokens * block_tokens
            async with gate:
                start = time.monotonic()
                g = await generate(f"{tag}-{traj.id}-{k}", prompt, r.gen_tokens, hit)
            if len(g.token_ids) != r.gen_tokens:
                raise DualPathError(f"{traj.id} round {k}: {len(g.token_ids)} tokens "
                                    f"generated, {r.gen_tokens} asked")
            records.append(RoundRecord(traj.id, k, len(prompt), hit, r.gen_tokens,
                                       start - t0, g.first_token_s, g.finish_s,
                                       tuple(g.token_ids)))
            context = prompt + list(g.token_ids)

    await asyncio.gather(*(agent(t) for t in trace.trajectories))
    records.sort(key=lambda r: (r.trajectory, r.round))
    return records


def summary(records: Sequence[RoundRecord]) -> dict:
    """JCT and latency percentiles of one run (seconds)."""
    if not records:
        return {"rounds": 0}
    ttft = np.array([r.first_token_s for r in records])
    tpot = np.array([r.tpot_s for r in records])
    return {"rounds": len(records),
            "jct_s": max(r.submit_s + r.finish_s for r in records),
            "prompt_tokens": sum(r.prompt_tokens for r in records),
            "hit_tokens": sum(r.hit_tokens for r in records),
            "generated_tokens": sum(r.gen_tokens for r in records),
            "ttft_p50_s": float(np.percentile(ttft, 50)),
            "ttft_p99_s": float(np.percentile(ttft, 99)),
            "tpot_p50_s": float(np.percentile(tpot, 50)),
            "tpot_p99_s": float(np.percentile(tpot, 99))}


def http_generate(url: str, model: str, api_key: str = "") -> tuple[Generate, Callable]:
    """A :data:`Generate` through an OpenAI server's /v1/completions (streamed, greedy,
    ignore_eos, token ids asked for as vLLM's own server names it: DualPath's front end
    or plain vLLM alike), and the coroutine function that closes its session."""
    import aiohttp

    session: list = []
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def generate(rid: str, prompt: list[int], gen: int, hit: int) -> Generation:
        if not session:
            session.append(aiohttp.ClientSession(headers=headers,
                                                 timeout=aiohttp.ClientTimeout(total=3600)))
        body = {"model": model, "prompt": prompt, "max_tokens": gen, "temperature": 0,
                "ignore_eos": True, "stream": True, "return_token_ids": True}
        t0 = time.monotonic()
        first = 0.0
        ids: list[int] = []
        async with session[0].post(url.rstrip("/") + "/v1/completions", json=body) as r:
            if r.status != 200:
                raise DualPathError(f"{rid}: HTTP {r.status}: {(await r.text())[:300]}")
            async for raw in r.content:
                line = raw.decode().strip()
                if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                    continue
                chunk = json.loads(line[5:])
                if "error" in chunk:
                    raise DualPathError(f"{rid}: {chunk['error'].get('message')}")
                for c in chunk.get("choices", ()):
                    got = c.get("token_ids") or []
                    if got and not first:
                        first = time.monotonic() - t0
                    ids.extend(got)
        return Generation(ids, first, time.monotonic() - t0)

    async def close() -> None:
        if session:
            await session[0].close()

    return generate, close


def records_json(records: Sequence[RoundRecord]) -> list[dict]:
    return [{**asdict(r), "token_ids": list(r.token_ids)} for r in records]
