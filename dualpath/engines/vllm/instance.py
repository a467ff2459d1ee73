"""The vLLM instance a prefill or decode node drives, over vLLM's own OpenAI HTTP API.

A node that fetched an assignment turns it into one ``/v1/completions`` request to the
instance beside it (docs/vllm.md, "Prefill and decode"): the prompt as token ids,
greedy, ``ignore_eos``, and ``kv_transfer_params = {"dualpath": {"request_id",
"ticket"}}``, which vLLM hands to DualPathConnector with the request; the ticket is a
one-time secret of the node's, so only the request the node sent finds the KV the node
staged for it. The answer's token ids and each one's logprob come back as they are:
vLLM writes floats with Python's repr, so they round-trip exactly.

Threads: the node's event loop (aiohttp).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from dualpath.errors import DualPathError
from dualpath.paths.peers import MAX_TOP, Top

log = logging.getLogger("dualpath.node")


class InstanceError(DualPathError):
    """The vLLM instance refused a request, failed it, or could not be reached
    (``unreachable``: it is down, or died while answering)."""

    def __init__(self, message: str, unreachable: bool = False):
        super().__init__(message)
        self.unreachable = unreachable


@dataclass(frozen=True)
class InstanceAnswer:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    top: list[Top] = field(default_factory=list)   # when the sampling asks ("logprobs")


def _top(entry: dict | None) -> Top:
    """One token's top logprobs from vLLM's completions answer, asked for with
    return_tokens_as_token_ids (keys "token_id:N", in vLLM's order)."""
    if not isinstance(entry, dict) or len(entry) > MAX_TOP:
        raise ValueError(f"top logprobs entry {entry!r:.100}")
    ids, lps = [], []
    for k, v in entry.items():
        if not isinstance(k, str) or not k.startswith("token_id:"):
            raise ValueError(f"top logprobs key {k!r:.60} (not token_id:N)")
        ids.append(int(k[9:]))
        lps.append(float(v))
    return tuple(ids), tuple(lps)


class VllmInstance:
    """An HTTP client of one vLLM instance. ``await close()`` (idempotent)."""

    #: Seconds between /health probes while the instance is down.
    PROBE_S = 0.5

    def __init__(self, url: str, timeout_s: float = 600.0):
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self._session = None
        self._model = ""
        self.up = True                # False from an unreachable answer until /health
        self._probe: asyncio.Task | None = None

    def mark_down(self, why: str) -> None:
        """The instance did not answer: down until /health answers again (probed)."""
        if self.up:
            log.warning("vLLM instance at %s is down (%s); its group takes no work until "
                        "it answers /health again", self.url, why)
        self.up = False
        if self._probe is None or self._probe.done():
            self._probe = asyncio.ensure_future(self._until_up())

    async def _until_up(self) -> None:
        while True:
            await asyncio.sleep(self.PROBE_S)
            try:
                await self._call("GET", "/health", json_reply=False)
            except InstanceError:
                continue
            log.info("vLLM instance at %s answers again", self.url)
            self.up = True
            return

    def _http(self):
        if self._session is None:
            import aiohttp  # vLLM's own dependency: only a vLLM node imports it

            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        return self._session

    async def model(self) -> str:
        """The served model's name (``/v1/models``), asked once."""
        if not self._model:
            data = await self._call("GET", "/v1/models")
            try:
                self._model = str(data["data"][0]["id"])
            except (KeyError, IndexError, TypeError):
                raise InstanceError(f"{self.url}/v1/models: no model in {data!r:.200}") from None
        return self._model

    async def complete(self, prompt: list[int], max_tokens: int, *, request_id: str,
                       ticket: str, save_all: bool = False, logprobs: bool = True,
                       cache_salt: str = "", tenant: str = "", temperature: float = 0.0,
                       top_p: float = 1.0, seed: int = -1, ignore_eos: bool = True,
                       sampling: dict | None = None,
                       on_tokens: Callable[[list[int], list[float], list[Top]], None]
                       | None = None) -> InstanceAnswer:
        """The completion of ``prompt`` (token ids): greedy unless ``temperature``, exactly
        ``max_tokens`` tokens with ``ignore_eos`` (else up to), streamed:
        ``on_tokens(ids, logprobs, top)`` with the tokens so far each time they grew
        (``top``: each one's top logprobs when the sampling asks for them, "logprobs")."""
        import aiohttp

        body = {"model": await self.model(), "prompt": [int(t) for t in prompt],
                "max_tokens": int(max_tokens), "temperature": float(temperature),
                "top_p": float(top_p), "ignore_eos": bool(ignore_eos),
                "return_token_ids": True, "stream": True,
                "kv_transfer_params": {"dualpath": {"request_id": request_id,
                                                    "ticket": ticket,
                                                    "save_all": save_all,
                                                    "tenant": tenant}}}
        if sampling:                     # checked (paths/payload.py check_sampling)
            body.update(sampling)
        if seed >= 0:
            body["seed"] = int(seed)
        if cache_salt:
            body["cache_salt"] = cache_salt
        tops_asked = "logprobs" in (sampling or {})
        if tops_asked:                  # their keys as token ids, not text
            body["return_tokens_as_token_ids"] = True
        elif logprobs:
            body["logprobs"] = 1
        ids: list[int] = []
        lps: list[float] = []
        tops: list[Top] = []
        finish = ""
        where = f"POST {self.url}/v1/completions"
        try:
            async with self._http().post(self.url + "/v1/completions", json=body) as r:
                if r.status != 200:
                    raise InstanceError(f"{where}: HTTP {r.status}: {(await r.text())[:300]}")
                async for raw in r.content:
                    line = raw.decode(errors="replace").strip()
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        raise InstanceError(f"{where}: {str(chunk['error'])[:300]}")
                    for c in chunk.get("choices", ()):
                        ids.extend(int(t) for t in c.get("token_ids") or ())
                        if (logprobs or tops_asked) and c.get("logprobs"):
                            lps.extend(float(x) for x in c["logprobs"]["token_logprobs"])
                            if tops_asked:
                                tops.extend(_top(e) for e in c["logprobs"]["top_logprobs"])
                        finish = c.get("finish_reason") or finish
                    if on_tokens is not None and ids:
                        on_tokens(ids, lps, tops)
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as e:
            raise InstanceError(f"{where}: {type(e).__name__}: {e}",
                                unreachable=isinstance(e, (aiohttp.ClientConnectionError,
                                                           aiohttp.ClientPayloadError,
                                                           OSError))) from None
        short = len(ids) != max_tokens if ignore_eos else not 0 < len(ids) <= max_tokens
        if short or (logprobs and len(lps) != len(ids)) or \
                (tops_asked and len(tops) != len(ids)):
            raise InstanceError(f"{where}: {len(ids)} tokens, {len(lps)} logprobs and "
                                f"{len(tops)} top logprobs for max_tokens {max_tokens} "
                                f"(finish reason {finish!r})")
        return InstanceAnswer(ids, lps, finish, tops)

    async def _call(self, method: str, path: str, body=None, json_reply: bool = True):
        import aiohttp

        try:
            async with self._http().request(method, self.url + path, json=body) as r:
                text = await r.text()
                if r.status != 200:
                    raise InstanceError(f"{method} {self.url}{path}: HTTP {r.status}: "
                                        f"{text[:300]}")
                if not json_reply:
                    return text
                return await r.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            raise InstanceError(f"{method} {self.url}{path}: {type(e).__name__}: {e}",
                                unreachable=not isinstance(e, TimeoutError)) from None

    async def close(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
        if self._session is not None:
            s, self._session = self._session, None
            await s.close()
