"""The OpenAI HTTP front end: ``/v1/completions``, ``/v1/chat/completions`` (streamed or
not), ``/v1/models``, ``/health``, in front of the scheduler (docs/vllm.md).

A request is parsed (dualpath/frontend/protocol.py: bounded, every field checked),
tokenized when it is text or chat (the model's own tokenizer), given the hit the front
end expects stored (dualpath/frontend/index.py) and submitted to the scheduler through
:class:`~dualpath.scheduler.generate.Generator`, under a fresh unguessable request id.
The scheduler picks the prefill and decode nodes; the decode node streams the tokens to
the front end's sink as its vLLM instance generates them and reports them all once the
scheduler recorded the request. A streamed answer sends each new token as it comes; a
retried attempt (a node or instance died) streams again from its first token, and the
tokens already sent are checked against it and not sent twice (greedy, or sampling with
the request's seed, which the front end always sets, gives the same tokens).

Threads: one asyncio loop (aiohttp).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import secrets
import ssl
import uuid
from pathlib import Path

import grpc
from aiohttp import web

from dualpath import metrics, tls
from dualpath.errors import ConfigError, DualPathError, RemoteUnavailable, UsageError
from dualpath.frontend import edge
from dualpath.frontend import protocol as api
from dualpath.frontend.config import FrontendConfig
from dualpath.frontend.index import HitIndex
from dualpath.frontend.served import FrontendMetrics, Served, served
from dualpath.frontend.tenants import ApiKeys, request_tenant
from dualpath.frontend.tokens import Tokens
from dualpath.kv.prefix import tenant_root
from dualpath.scheduler.client import rpc_error
from dualpath.scheduler.generate import FINAL, Generated, GenerationFailed, Generator

log = logging.getLogger("dualpath.frontend")

#: Bodies past this are parsed off the event loop (a 4 MiB JSON list of token ids takes
#: about a second to parse: the loop would stall every other request meanwhile).
PARSE_IN_THREAD_BYTES = 64 << 10

_REJECT_STATUS = {"REJECT_REASON_QUEUE_FULL": 429, "REJECT_REASON_DUPLICATE": 409,
                  "REJECT_REASON_INVALID": 400, "REJECT_REASON_TOO_LARGE": 400, FINAL: 400}


# The tenant its API key names, kept on the request (aiohttp >= 3.12 types the key).
_TENANT = web.RequestKey("tenant", str) if hasattr(web, "RequestKey") else "dp_tenant"


class FrontEnd:
    """See the module docstring. ``await start()`` (the URL), ``await close()``."""

    def __init__(self, cfg: FrontendConfig, scheduler: str, tls_config: tls.TlsConfig):
        self.cfg = cfg
        self.tokens = Tokens(cfg.tokenizer)
        self.model = cfg.model or (Path(cfg.tokenizer).name if cfg.tokenizer else "dualpath")
        self.keys = ApiKeys(cfg.api_key_file, cfg.api_keys_file, cfg.default_tenant)
        self.limits = api.Limits(cfg.max_prompt_tokens, cfg.max_tokens, self.model,
                                 cfg.max_model_len)
        self.index = HitIndex(cfg.block_tokens, cfg.index_blocks)
        self.gen = Generator(scheduler, tls_config, tls_config)
        self.registry = metrics.new_registry()
        self.metrics = FrontendMetrics(self.registry)
        self.in_flight = 0
        self.runner: web.AppRunner | None = None
        self.url = ""

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> str:
        await self.gen.start()
        app = web.Application(client_max_size=self.cfg.max_body_bytes,
                              middlewares=[self._errors])
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        # A client that hangs up cancels its handler: the generator withdraws its
        # request from the cluster and the handler gives its in-flight slot back.
        self.runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self.runner.setup()
        edge.bound(self.runner.server, self.cfg.max_connections, self.cfg.header_timeout_s)
        host, _, port = self.cfg.listen.rpartition(":")
        site = web.TCPSite(self.runner, host.strip("[]"), int(port),
                           ssl_context=self._https())
        await site.start()
        bound = site._server.sockets[0].getsockname()[1]
        self.url = f"{'https' if self.cfg.cert_file else 'http'}://{host}:{bound}"
        for w in self.cfg.warnings():
            log.warning("front end: %s", w)
        log.info("front end on %s: model %s, %s, API key %s, scheduler %s", self.url,
                 self.model, f"tokenizer {self.cfg.tokenizer}" if self.tokens.available
                 else "token-id prompts only (no tokenizer)",
                 f"required ({len(self.keys)})" if self.keys.required else "off",
                 self.gen.scheduler)
        return self.url

    def _https(self) -> ssl.SSLContext | None:
        """The API's TLS context (frontend.cert_file/key_file), or None for plain HTTP;
        ConfigError naming the key when the files cannot be used."""
        if not self.cfg.cert_file:
            return None
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        try:
            ctx.load_cert_chain(self.cfg.cert_file, self.cfg.key_file)
        except (OSError, ssl.SSLError) as e:
            raise ConfigError(f"frontend.cert_file / frontend.key_file "
                              f"({self.cfg.cert_file}, {self.cfg.key_file}): {e}") from None
        return ctx

    async def close(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None
        await self.gen.close()

    # ------------------------------------------------------------ edge

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        rearm = edge.head_came(request, self.cfg.header_timeout_s)
        try:
            if request.path not in ("/health", "/metrics"):
                tenant = self.keys.tenant_of(request.headers.get("Authorization", ""))
                if tenant is None:
                    raise api.ApiError(401, "missing or incorrect API key (send "
                                       "'Authorization: Bearer <key>')",
                                       code="invalid_api_key")
                request[_TENANT] = tenant
            resp = await handler(request)
            self._count(request, resp.status)
            return resp
        except api.ApiError as e:
            self._count(request, e.status)
            return web.json_response(e.body(), status=e.status)
        except web.HTTPRequestEntityTooLarge:
            e = api.ApiError(413, f"the request body is larger than "
                             f"{self.cfg.max_body_bytes} bytes", code="request_too_large")
            return web.json_response(e.body(), status=413)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            err = api.ApiError(e.status, e.reason or "error",
                               code="not_found" if e.status == 404 else None)
            return web.json_response(err.body(), status=e.status)
        except Exception:
            log.exception("front end: %s %s failed", request.method, request.path)
            err = api.ApiError(500, "internal error (logged by the front end)",
                               type_="server_error", code="internal_error")
            return web.json_response(err.body(), status=500)
        finally:
            rearm()

    def _count(self, request: web.Request, status: int) -> None:
        if request.path.startswith("/v1/") and request.method == "POST":
            self.metrics.requests.labels(str(status)).inc()

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=metrics.render(self.registry),
                            content_type="text/plain", charset="utf-8")

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "model": self.model})

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.model, "object": "model", "created": 0, "owned_by": "dualpath"}]})

    async def _body(self, request: web.Request):
        """The request's JSON: its declared length checked before a byte is read (413),
        its arrival bounded (``body_timeout_s``: 408), a large one parsed off the loop,
        nesting too deep for the parser a 400."""
        limit = self.cfg.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise api.ApiError(413, f"the request body ({request.content_length} bytes) is "
                               f"larger than {limit} bytes", code="request_too_large")
        try:
            raw = await asyncio.wait_for(request.read(), self.cfg.body_timeout_s)
        except TimeoutError:
            raise api.ApiError(408, f"the request body did not arrive within "
                               f"{self.cfg.body_timeout_s:g} s", code="request_timeout") \
                from None
        try:
            if len(raw) > PARSE_IN_THREAD_BYTES:
                return await asyncio.to_thread(json.loads, raw)
            return json.loads(raw)
        except RecursionError:
            raise api.bad("the request body is nested too deeply to parse") from None
        except (ValueError, UnicodeDecodeError) as e:
            raise api.bad(f"the request body is not JSON: {e}") from None

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        call = self._of_tenant(request, api.parse_completion(await self._body(request),
                                                             self.limits))
        if call.batch is not None:
            return await self._serve_batch(call)
        if call.prompt_ids is not None:
            ids = call.prompt_ids
        else:
            ids = self._text_ids(call.prompt_text)
        return await self._serve(request, call, ids, "cmpl")

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        call = self._of_tenant(request, api.parse_chat(await self._body(request),
                                                       self.limits))
        if not self.tokens.available:
            raise api.bad("chat needs the model's tokenizer (frontend.tokenizer is not set)",
                          "messages")
        ids = self.tokens.chat(call.messages, call.tools)
        return await self._serve(request, call, ids, "chatcmpl")

    def _of_tenant(self, request: web.Request, call: api.Call) -> api.Call:
        """``call`` with its tenant: its API key's, with its cache_salt below it
        (dualpath/frontend/tenants.py)."""
        try:
            call.tenant = request_tenant(request.get(_TENANT, self.keys.default),
                                         call.cache_salt)
        except ValueError as e:
            raise api.bad(str(e), "cache_salt") from None
        return call

    def _text_ids(self, text: str) -> list[int]:
        if not self.tokens.available:
            raise api.bad("text prompts need the model's tokenizer (frontend.tokenizer is "
                          "not set); send token ids", "prompt")
        return self.tokens.encode(text)

    # ------------------------------------------------------------ generation

    def _admit(self, n: int = 1) -> None:
        """429 unless ``n`` more requests fit under max_in_flight; else count them."""
        if self.in_flight + n > self.cfg.max_in_flight:
            raise api.ApiError(429, f"{self.in_flight} requests in flight (at most "
                               f"{self.cfg.max_in_flight}); retry later",
                               type_="rate_limit_error", code="rate_limit_exceeded")
        self.in_flight += n
        self.metrics.in_flight.inc(n)

    def _done(self, n: int = 1) -> None:
        self.in_flight -= n
        self.metrics.in_flight.dec(n)

    @staticmethod
    def _seed(call: api.Call) -> int:
        # A seed even for sampling requests without one: a retried attempt samples the
        # same tokens, so a stream never shows two different continuations.
        return call.seed if call.seed >= 0 else secrets.randbits(62)

    async def _serve(self, request: web.Request, call: api.Call, ids: list[int],
                     prefix: str) -> web.StreamResponse:
        api.check_prompt_length(len(ids), self.limits)
        api.fit_to_context(call, len(ids), self.limits)
        self._admit(call.n)
        rid = f"{prefix}-{uuid.uuid4().hex}"
        seed = self._seed(call)
        try:
            if call.stream:
                return await self._stream(request, call, ids, rid, seed)
            # n choices: each generated on its own, choice i with seed + i (as vLLM's
            # parallel sampling seeds its children).
            got = await _all(self._answer(call, ids, rid, seed + i, _choice_id(rid, i, call.n))
                             for i in range(call.n))
            if call.n == 1:
                body, s = got[0]
                return web.json_response(body, headers=s.headers())
            return web.json_response(api.batch_answer([b for b, _ in got],
                                                      one_prompt=True))
        finally:
            self._done(call.n)

    async def _serve_batch(self, call: api.Call) -> web.Response:
        """A completions request with several prompts: each one a request of its own, at
        once; the answers as vLLM's server gives them (one choice per prompt)."""
        idss = [p if isinstance(p, list) else self._text_ids(p) for p in call.batch]
        calls = []
        for p, ids in zip(call.batch, idss):
            api.check_prompt_length(len(ids), self.limits)
            c = dataclasses.replace(call, batch=None,
                                    prompt_text=p if isinstance(p, str) else None)
            api.fit_to_context(c, len(ids), self.limits)
            calls.append(c)
        self._admit(len(idss))
        rid = f"cmpl-{uuid.uuid4().hex}"
        seed = self._seed(call)
        try:
            got = await _all(self._answer(c, ids, rid, seed, f"{rid}-{i}")
                             for i, (c, ids) in enumerate(zip(calls, idss)))
        finally:
            self._done(len(idss))
        return web.json_response(api.batch_answer([b for b, _ in got]))

    def _echoed(self, call: api.Call, ids: list[int]) -> str:
        """The prompt's text an echo shows first: as vLLM's server, none when the call
        asks for token ids (they carry the prompt)."""
        if not call.echo or call.return_token_ids:
            return ""
        return call.prompt_text if call.prompt_text is not None else self.tokens.decode(ids)

    def _logprobs(self, call: api.Call, ids: list[int], lps: list[float], tops: list,
                  offset: int = 0) -> dict | None:
        """:func:`api.logprobs` of ``ids`` with their texts (and their alternatives')."""
        if not call.logprobs:
            return None
        texts = [(self.tokens.pieces(list(t[0])), t[1]) for t in tops] \
            if len(tops) == len(ids) else [None] * len(ids)
        return api.logprobs(call, self.tokens.pieces(ids), lps, texts, offset)

    async def _answer(self, call: api.Call, ids: list[int], rid: str, seed: int,
                      cluster_id: str) -> tuple[dict, Served]:
        """The non-streamed answer ``rid`` to one prompt (the cluster's request
        ``cluster_id``), and what happened to it."""
        g, s = await self._generate(call, ids, cluster_id, seed, None)
        finish = api.finish_reason(call, len(g.token_ids), g.finish_reason)
        text = api.cut_at_stop(
            self.tokens.decode(api.text_ids(call, g.token_ids, finish)), call, finish)
        body = api.answer(call, rid, self._echoed(call, ids) + text, g.token_ids,
                          self._logprobs(call, g.token_ids, g.logprobs, g.top), len(ids),
                          finish)
        return body, s

    async def _generate(self, call: api.Call, ids: list[int], rid: str, seed: int,
                        on_partial) -> tuple[Generated, Served]:
        """The request's tokens, and what happened to it (also counted in /metrics)."""
        root = tenant_root(call.tenant)
        hit = self.index.hit_tokens(ids, root)
        try:
            g = await self.gen.generate(
                rid, ids, call.max_tokens, hit_tokens=hit,
                block_tokens=self.cfg.block_tokens, timeout_s=self.cfg.request_timeout_s,
                temperature=call.temperature, top_p=call.top_p, seed=seed,
                ignore_eos=call.ignore_eos, sampling=call.sampling, on_partial=on_partial,
                # The tenant salts vLLM's own prefix cache too: no key's holder hits
                # another tenant's KV there either (the same salt and tenant as before
                # API keys named tenants: docs/storage.md, "Tenants").
                cache_salt=call.tenant, tenant=call.tenant)
        except GenerationFailed as e:
            status = _REJECT_STATUS.get(e.reason, 503)
            raise api.ApiError(status, str(e), type_="invalid_request_error"
                               if status in (400, 409) else "server_error",
                               code=e.reason.removeprefix("REJECT_REASON_").lower()
                               if e.reason else "generation_failed") from None
        except grpc.aio.AioRpcError as e:       # the scheduler refused or is away
            err = rpc_error(e, self.gen.scheduler)
            if isinstance(err, UsageError):
                raise api.ApiError(400, str(err), type_="invalid_request_error",
                                   code="rejected") from None
            raise api.ApiError(503, str(err), type_="server_error",
                               code="unavailable") from None
        except (RemoteUnavailable, DualPathError, OSError) as e:
            raise api.ApiError(503, f"the cluster could not serve the request: {e}",
                               type_="server_error", code="unavailable") from None
        self.index.remember(ids, g.token_ids, root)
        s = served(g, len(ids), hit)
        self.metrics.observe(s)
        return g, s

    async def _stream(self, request: web.Request, call: api.Call, ids: list[int],
                      rid: str, seed: int) -> web.StreamResponse:
        """Server-sent events of the call's n choices (choice i with seed + i), each
        streamed as its tokens come; then, once all ended, the usage (when asked), one
        ": dualpath" comment per choice (what happened to it) and [DONE]. An error
        ends the stream with its error object."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)

        async def write(obj) -> None:
            await resp.write(f"data: {json.dumps(obj)}\n\n".encode())

        choices = [asyncio.ensure_future(self._stream_choice(call, ids, rid, seed + i, i,
                                                             write))
                   for i in range(call.n)]
        try:
            try:
                got = await asyncio.gather(*choices)
            except api.ApiError as e:
                await write(e.body())
                await resp.write(b"data: [DONE]\n\n")
                return resp
            if call.include_usage:
                u = api.chunk(call, rid, "", [], None, None)
                u["choices"] = []
                u["usage"] = api.usage(len(ids), sum(len(g.token_ids) for g, _ in got))
                await write(u)
            # What happened to each choice, as comment lines OpenAI clients skip.
            for _, s in got:
                await resp.write(f": dualpath {json.dumps(s.as_dict())}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
            return resp
        finally:
            for c in choices:            # the client went away, or a choice failed
                if not c.done():
                    c.cancel()
            await asyncio.gather(*choices, return_exceptions=True)

    async def _stream_choice(self, call: api.Call, ids: list[int], rid: str, seed: int,
                             index: int, write) -> tuple[Generated, Served]:
        """Choice ``index`` of a streamed answer: its chunks as its tokens come, its
        finish chunk; its tokens and what happened to it. ApiError when it failed."""
        sent: list[int] = []
        sent_lps: list[float] = []
        sent_top: list = []
        state = {"attempt": 0, "diverged": False, "text": "", "offset": 0}
        queue: asyncio.Queue = asyncio.Queue()

        def on_partial(attempt: int, offset: int, new: list[int], lps: list[float],
                       top: list) -> None:
            if attempt < state["attempt"]:
                return
            state["attempt"] = attempt
            for i, t in enumerate(new):
                pos = offset + i
                if pos < len(sent):
                    if sent[pos] != t:
                        state["diverged"] = True
                elif pos == len(sent):
                    sent.append(t)
                    sent_lps.append(lps[i] if i < len(lps) else 0.0)
                    sent_top.append(top[i] if i < len(top) else None)
            queue.put_nowait(None)

        shown = [0]
        echo = self._echoed(call, ids)

        async def flush(final: bool, finish: str = "") -> None:
            n = len(sent)
            if n == shown[0]:
                return
            if not final and (call.sampling.get("stop") or
                              call.sampling.get("stop_token_ids")):
                return                   # what ends it may still come: text at the end
            text = api.cut_at_stop(self.tokens.decode(api.text_ids(call, sent[:n], finish)),
                                   call, finish)
            if not final and text.endswith("\ufffd"):   # a character cut in two
                return
            delta = text[len(state["text"]):]
            state["text"] = text
            new = sent[shown[0]:n]
            tops = sent_top[shown[0]:n]
            lp = self._logprobs(call, new, sent_lps[shown[0]:n],
                                tops if all(t is not None for t in tops) else [],
                                state["offset"])
            if lp is not None and "tokens" in lp and lp["tokens"]:
                state["offset"] = lp["text_offset"][-1] + len(lp["tokens"][-1])
            await write(api.chunk(call, rid, (echo if shown[0] == 0 else "") + delta, new,
                                  lp, None, first=shown[0] == 0, index=index))
            shown[0] = n

        task = asyncio.ensure_future(self._generate(
            call, ids, _choice_id(rid, index, call.n), seed, on_partial))
        try:
            while not task.done():
                getter = asyncio.ensure_future(queue.get())
                await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
                getter.cancel()
                await flush(False)
            g, s = task.result()         # (an ApiError goes to _stream)
            if sent != g.token_ids[:len(sent)] or state["diverged"]:
                raise api.ApiError(500, "a retried attempt generated other tokens than "
                                   "those already streamed", type_="server_error",
                                   code="stream_diverged")
            sent[len(sent):] = g.token_ids[len(sent):]
            sent_lps[len(sent_lps):] = g.logprobs[len(sent_lps):]
            sent_top[len(sent_top):] = g.top[len(sent_top):] if g.top else \
                [None] * (len(sent) - len(sent_top))
            finish = api.finish_reason(call, len(g.token_ids), g.finish_reason)
            await flush(True, finish)
            await write(api.chunk(call, rid, "", [], None, finish, index=index))
            return g, s
        finally:
            if not task.done():          # the client went away
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)


def _choice_id(rid: str, index: int, n: int) -> str:
    """The cluster's request id of choice ``index`` of answer ``rid``."""
    return rid if n == 1 else f"{rid}-{index}"


async def _all(aws) -> list:
    """Every one of ``aws`` at once; when one fails, the others are cancelled and
    awaited before the error goes on (none keeps generating unanswered, and the
    admission count given back is true)."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
