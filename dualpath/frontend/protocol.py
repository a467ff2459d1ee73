"""The OpenAI API's requests and answers as the front end speaks them (pure code).

:func:`parse_completion` and :func:`parse_chat` turn a decoded JSON body into a
:class:`Call` or raise :class:`ApiError` naming the field that is wrong; a field the
front end does not implement is refused by name (never silently ignored). The answer
shapes follow OpenAI's: ``text_completion`` / ``chat.completion`` objects, their
``.chunk`` forms for server-sent events, and ``{"error": {message, type, param,
code}}`` with the HTTP status that goes with it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from dualpath.errors import UsageError
from dualpath.kv.prefix import MAX_TENANT_CHARS
from dualpath.paths.payload import MAX_LOGPROBS, SAMPLING_KEYS, check_sampling

#: vLLM sampling fields taken from a body as they are (``logprobs`` is read per endpoint:
#: an integer in completions, a flag beside ``top_logprobs`` in chat).
_PASSED = tuple(k for k in SAMPLING_KEYS if k != "logprobs")
#: Fields each endpoint accepts; any other one is a 400 naming it.
COMPLETION_FIELDS = frozenset({"model", "prompt", "max_tokens", "temperature", "top_p",
                               "seed", "stream", "logprobs", "ignore_eos", "user", "n",
                               "stream_options", "return_token_ids", "echo",
                               "response_format", "cache_salt", *_PASSED})
CHAT_FIELDS = frozenset({"model", "messages", "max_tokens", "max_completion_tokens",
                         "temperature", "top_p", "seed", "stream", "logprobs", "user", "n",
                         "ignore_eos", "stream_options", "top_logprobs", "tools",
                         "tool_choice", "response_format", "cache_salt", *_PASSED})
ROLES = ("system", "user", "assistant", "developer", "tool")
MAX_TOOLS = 128                 # function definitions in one chat request
MAX_BATCH = 64                  # prompts in one completions request
MAX_N = 16                      # choices of one prompt


class ApiError(Exception):
    """An answer other than 200: its HTTP status and OpenAI error object."""

    def __init__(self, status: int, message: str, *, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status, message, type_, param, code)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


@dataclass(frozen=True)
class Limits:
    max_prompt_tokens: int
    max_tokens: int
    model: str
    max_model_len: int = 0      # the instances' context (0 = not known: not checked)


@dataclass
class Call:
    """One generation request, parsed: ``prompt_ids`` (token-id prompts) or
    ``prompt_text`` (a text prompt) or ``messages`` (chat)."""

    chat: bool
    model: str
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = -1
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    top_logprobs: int = 0           # completions: logprobs = N; chat: top_logprobs
    echo: bool = False              # completions: the prompt's text before the answer's
    return_token_ids: bool = False
    n: int = 1                      # choices, each generated on its own (seed + index)
    ignore_eos: bool = False
    sampling: dict = field(default_factory=dict)   # vLLM's, passed to the instances
    prompt_ids: list[int] | None = None
    batch: list[str | list[int]] | None = None     # completions: several prompts
    prompt_text: str | None = None
    messages: list[dict] = field(default_factory=list)
    tools: list[dict] | None = None   # chat: function definitions, for the template
    # vLLM's prefix-cache salt; with the API key's tenant it names the request's tenant
    # (dualpath/frontend/tenants.py): the root of its block keys, so one tenant's
    # stored KV is never another's hit ("" the default tenant).
    cache_salt: str = ""
    tenant: str = ""
    created: int = field(default_factory=lambda: int(time.time()))


def _number(body: dict, name: str, lo: float, hi: float, default, kind=float):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or \
            (kind is int and not isinstance(v, int)):
        raise bad(f"'{name}' must be {'an integer' if kind is int else 'a number'}", name)
    if not lo <= v <= hi:
        raise bad(f"'{name}' is {v}; it must be between {lo} and {hi}", name)
    return kind(v)


def _sampling(body: dict) -> dict:
    """vLLM's further sampling fields (null = vLLM's default), checked; ``stop`` as a
    list. A value vLLM treats as off is left out."""
    s = {k: body[k] for k in _PASSED if body.get(k) is not None}
    if isinstance(s.get("stop"), str):
        s["stop"] = [s["stop"]]
    for k, off in (("stop", []), ("stop_token_ids", []), ("presence_penalty", 0),
                   ("frequency_penalty", 0), ("min_tokens", 0)):
        if k in s and s[k] == off and type(s[k]) is not bool:
            del s[k]
    try:
        return check_sampling(s)
    except UsageError as e:
        raise bad(str(e), next((k for k in s if f"'{k}'" in str(e)), None)) from None


def _flag(body: dict, name: str) -> bool:
    v = body.get(name, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise bad(f"'{name}' must be true or false", name)
    return v


def _common(body, fields: frozenset, limits: Limits, chat: bool) -> Call:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    unknown = sorted(set(body) - fields)
    if unknown:
        raise bad(f"unsupported field '{unknown[0]}' (this server implements: "
                  f"{', '.join(sorted(fields))})", unknown[0], "unsupported_parameter")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("'model' is required", "model")
    if model != limits.model:
        raise ApiError(404, f"the model '{model}' does not exist; this server serves "
                       f"'{limits.model}'", param="model", code="model_not_found")
    n = _number(body, "n", 1, MAX_N, 1, int)
    key = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
    max_tokens = _number(body, key, 1, limits.max_tokens, 16 if not chat else
                         min(limits.max_tokens, 1024), int)
    opts = body.get("stream_options")
    if opts is not None and (not isinstance(opts, dict) or set(opts) - {"include_usage"}):
        raise bad("'stream_options' may hold only include_usage", "stream_options")
    call = Call(chat=chat, model=model, max_tokens=max_tokens,
                temperature=_number(body, "temperature", 0.0, 2.0, 1.0),
                top_p=_number(body, "top_p", 1e-9, 1.0, 1.0),
                seed=_number(body, "seed", 0, 2 ** 63 - 1, -1, int),
                stream=_flag(body, "stream"),
                include_usage=bool(opts and opts.get("include_usage")),
                ignore_eos=_flag(body, "ignore_eos"), n=n)
    if n > 1 and call.temperature < 1e-5:
        raise bad(f"n must be 1 when using greedy sampling, got {n}.", "n")  # vLLM's words
    if call.seed + n - 1 > 2 ** 63 - 1:     # choice i samples with seed + i
        raise bad("'seed' + n - 1 must be at most 2^63 - 1 (choice i samples with seed + "
                  "i)", "seed")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise bad("'user' must be a string", "user")
    call.sampling = _sampling(body)
    call.return_token_ids = _flag(body, "return_token_ids")
    salt = body.get("cache_salt")
    if salt is not None:
        if not isinstance(salt, str) or not salt or len(salt) > MAX_TENANT_CHARS:
            raise bad(f"'cache_salt' must be a non-empty string of at most "
                      f"{MAX_TENANT_CHARS} characters (it names the request's tenant: "
                      "no other tenant's cached KV is used for it)", "cache_salt")
        call.cache_salt = salt
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise bad("'response_format' may be {\"type\": \"text\"} here (JSON output needs "
                  "structured outputs, which this server does not carry from the prefill to "
                  "the decode instance)", "response_format")
    return call


def _ask_logprobs(call: Call, top: int) -> None:
    """Logprobs with ``top`` alternatives per token: the instances list them."""
    call.logprobs, call.top_logprobs = True, top
    call.sampling["logprobs"] = top


def parse_completion(body, limits: Limits) -> Call:
    call = _common(body, COMPLETION_FIELDS, limits, chat=False)
    lp = body.get("logprobs")
    if lp is not None:
        if isinstance(lp, bool) or not isinstance(lp, int) or not 0 <= lp <= MAX_LOGPROBS:
            raise bad(f"'logprobs' must be an integer between 0 and {MAX_LOGPROBS} (top "
                      "logprobs per token)", "logprobs")
        _ask_logprobs(call, lp)
    call.echo = _flag(body, "echo")
    if call.echo and call.logprobs:
        raise bad("'echo' with 'logprobs' asks for the prompt's logprobs, which this "
                  "server does not compute (a DualPath prefill loads the prompt's KV from "
                  "storage instead); ask for one of them", "echo")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]                  # a batch of one
    elif isinstance(prompt, list) and len(prompt) > 1 and \
            all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > MAX_BATCH:
            raise bad(f"a batch of {len(prompt)} prompts; at most {MAX_BATCH}", "prompt")
        if call.stream:
            raise bad("a batch of prompts is answered whole: stream each prompt on its "
                      "own request", "stream")
        if call.n > 1:
            raise bad("a batch of prompts takes n = 1; send each prompt with its n on its "
                      "own request", "n")
        call.batch = [_one_prompt(p, limits) for p in prompt]
        return call
    one = _one_prompt(prompt, limits)
    if isinstance(one, str):
        call.prompt_text = one
    else:
        call.prompt_ids = one
    return call


def _one_prompt(prompt, limits: Limits) -> str | list[int]:
    """One prompt of a completion: its text, or its token ids (checked)."""
    if isinstance(prompt, str):
        if not prompt:
            raise bad("'prompt' is empty", "prompt")
        return prompt
    if isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        check_prompt_length(len(prompt), limits)     # before the ids are checked
        if any(t < 0 or t >= 1 << 31 for t in prompt):
            raise bad("token ids must be between 0 and 2^31 - 1", "prompt")
        return list(prompt)
    raise bad("'prompt' must be a string, a list of token ids, or a list of those (a "
              "batch)", "prompt")


def parse_chat(body, limits: Limits) -> Call:
    call = _common(body, CHAT_FIELDS, limits, chat=True)
    top = _number(body, "top_logprobs", 0, MAX_LOGPROBS, 0, int)
    if _flag(body, "logprobs"):
        _ask_logprobs(call, top)
    elif top:
        raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("'messages' must be a non-empty list", "messages")
    call.messages = [_message(i, m) for i, m in enumerate(msgs)]
    call.tools = _tools(body)
    return call


def _message(i: int, m) -> dict:
    """messages[i], checked: a role, text content (a string or text parts); an
    assistant's tool_calls and a tool's tool_call_id go to the chat template as given."""
    extra = {"assistant": {"tool_calls"}, "tool": {"tool_call_id"}}
    ok = isinstance(m, dict) and m.get("role") in ROLES and \
        not set(m) - {"role", "content", "name"} - extra.get(m.get("role"), set())
    content = m.get("content") if ok else None
    calls = m.get("tool_calls") if ok else None
    if ok and content is None and m.get("role") == "assistant" and calls:
        content = ""                    # an assistant turn of tool calls only
    elif ok:
        content = _content(content)
    if not ok or content is None or (calls is not None and not (
            isinstance(calls, list) and all(isinstance(c, dict) for c in calls))) or \
            not isinstance(m.get("tool_call_id", ""), str):
        raise bad(f"messages[{i}] must be {{role: one of {', '.join(ROLES)}, content: "
                  "a string or a list of text parts}", f"messages[{i}]")
    out = {"role": m["role"], "content": content}
    for k in ("tool_calls", "tool_call_id", "name"):
        if m.get(k) is not None:
            out[k] = m[k]
    return out


def _tools(body: dict) -> list[dict] | None:
    """``tools`` and ``tool_choice`` as vLLM's server takes them when it does not parse
    tool calls itself (no --enable-auto-tool-choice): with tool_choice "none" the
    definitions go to the chat template and the answer is the model's text; "auto" (the
    default with tools) is vLLM's own 400; "required" or a named function needs
    structured outputs, which a prefill/decode split does not carry (a 400)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if choice not in (None, "none", "auto"):
        raise bad("'tool_choice' may be \"none\" or \"auto\" here (\"required\" and a "
                  "named function need structured outputs, which this server does not "
                  "carry from the prefill to the decode instance)", "tool_choice")
    if tools == []:
        raise bad("`tools` must not be an empty array. Either provide at least one tool or "
                  "omit the field entirely.", "tools")                    # vLLM's words
    if tools is None:
        if choice not in (None, "none"):
            raise bad("When using `tool_choice`, `tools` must be set.", "tool_choice")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS or not all(
            isinstance(t, dict) and t.get("type") == "function"
            and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str) for t in tools):
        raise bad(f"'tools' must be a list of at most {MAX_TOOLS} {{type: function, "
                  "function: {name, description, parameters}}", "tools")
    if choice in (None, "auto") and tools:
        # vLLM's own answer without a tool-call parser (its default for tools is auto).
        raise bad('"auto" tool choice requires --enable-auto-tool-choice and '
                  "--tool-call-parser to be set", "tool_choice")
    return tools or None


def _content(c) -> str | None:
    """A message's content: a string, or a list of text parts ({type: text, text})
    joined as vLLM joins them for a text-only model (newlines); None if neither."""
    if isinstance(c, str):
        return c
    if isinstance(c, list) and c and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            and set(p) <= {"type", "text"} for p in c):
        return "\n".join(p["text"] for p in c)
    return None


def check_prompt_length(n: int, limits: Limits) -> None:
    ctx = limits.max_model_len
    if ctx and n >= ctx:
        # vLLM's own words and status (vllm/renderers/params.py); a prompt of exactly
        # the context leaves no room for the token a prefill samples, so it is refused
        # here too rather than failing on an instance.
        raise bad(f"This model's maximum context length is {ctx} tokens. However, your "
                  f"prompt contains {n} input tokens, which exceeds this limit even "
                  "without any output tokens. Please reduce the length of the input "
                  "prompt.", "input_tokens", "context_length_exceeded")
    if n > limits.max_prompt_tokens:
        raise bad(f"the prompt has {n} tokens; at most {limits.max_prompt_tokens}",
                  "prompt", "context_length_exceeded")
    if n < 1:
        raise bad("the prompt has no tokens", "prompt")


def fit_to_context(call: Call, n: int, limits: Limits) -> None:
    """As vLLM does (get_max_tokens): ``max_tokens`` is cut to what the context leaves
    after an ``n``-token prompt (the answer then ends with finish_reason "length")."""
    if limits.max_model_len:
        call.max_tokens = min(call.max_tokens, limits.max_model_len - n)


def finish_reason(call: Call, n_tokens: int, said: str = "") -> str:
    """vLLM's own when the cluster reports it, else by count."""
    if said in ("stop", "length"):
        return said
    return "length" if n_tokens >= call.max_tokens else "stop"


def text_ids(call: Call, ids: list[int], finish: str) -> list[int]:
    """The token ids whose text the answer shows: as vLLM's, without the stop token that
    ended it (the token ids keep it)."""
    if finish == "stop" and ids and ids[-1] in call.sampling.get("stop_token_ids", ()):
        return ids[:-1]
    return ids


def cut_at_stop(text: str, call: Call, finish: str) -> str:
    """vLLM's output text ends before the stop string that ended it (the token ids keep
    the token that completed it)."""
    stops = call.sampling.get("stop")
    if finish != "stop" or not stops:
        return text
    at = [text.find(s) for s in stops if s in text]
    return text[:min(at)] if at else text


def usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


#: One token's alternatives as text: (their texts, their logprobs), the sampled first.
TopText = tuple[list[str], tuple[float, ...]]
#: vLLM's floor for a logprob in an answer (-inf is not JSON).
LOGPROB_FLOOR = -9999.0


def _lp(x: float) -> float:
    return max(x, LOGPROB_FLOOR)


def logprobs(call: Call, pieces: list[str], lps: list[float],
             tops: list[TopText | None], offset: int = 0) -> dict | None:
    """The ``logprobs`` object of a choice (or a chunk's), as vLLM's server makes it:
    each token's text (``pieces``), its logprob, and its alternatives as the instance
    listed them (the sampled token first). Completions: ``tokens``, ``token_logprobs``,
    ``top_logprobs`` (the first N + 1 entries, as a text -> logprob object) and
    ``text_offset`` from ``offset``; chat: ``content`` with UTF-8 ``bytes`` and the first
    ``top_logprobs`` entries. None when the call did not ask."""
    if not call.logprobs:
        return None
    k = call.top_logprobs
    if call.chat:
        return {"content": [
            {"token": p, "logprob": _lp(lp), "bytes": list(p.encode("utf-8", "replace")),
             "top_logprobs": [{"token": tp, "logprob": _lp(tl),
                               "bytes": list(tp.encode("utf-8", "replace"))}
                              for i, (tp, tl) in enumerate(zip(*t)) if i < k]
             if t is not None else []}
            for p, lp, t in zip(pieces, lps, tops)]}
    offsets = []
    for p in pieces:
        offsets.append(offset)
        offset += len(p)
    return {"text_offset": offsets, "token_logprobs": [_lp(x) for x in lps],
            "tokens": list(pieces),
            "top_logprobs": [{tp: _lp(tl) for i, (tp, tl) in enumerate(zip(*t)) if i <= k}
                             if t is not None else None for t in tops]}


def answer(call: Call, rid: str, text: str, ids: list[int], lp: dict | None,
           prompt_tokens: int, finish: str) -> dict:
    """The non-streamed answer (``lp``: :func:`logprobs`)."""
    if call.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "finish_reason": finish, "logprobs": lp}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish, "token_ids": ids,
                  "logprobs": lp}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": call.created, "model": call.model,
            "choices": [choice], "usage": usage(prompt_tokens, len(ids))}


def batch_answer(answers: list[dict], *, one_prompt: bool = False) -> dict:
    """One answer of a batch of prompts (or of n choices of ``one_prompt``): each
    choice at its index, as vLLM's server answers; completion tokens summed, prompt
    tokens summed over the prompts (counted once for n choices of one)."""
    out = dict(answers[0])
    out["choices"] = [{**a["choices"][0], "index": i} for i, a in enumerate(answers)]
    prompt = (answers[0]["usage"]["prompt_tokens"] if one_prompt
              else sum(a["usage"]["prompt_tokens"] for a in answers))
    out["usage"] = usage(prompt, sum(a["usage"]["completion_tokens"] for a in answers))
    return out


def chunk(call: Call, rid: str, text: str, ids: list[int], lp: dict | None,
          finish: str | None, first: bool = False, index: int = 0) -> dict:
    """One server-sent event of a streamed answer (``lp``: :func:`logprobs` of its
    tokens, None when it has none)."""
    if call.chat:
        delta: dict = {"content": text}
        if first:
            delta["role"] = "assistant"
        choice = {"index": index, "delta": delta, "finish_reason": finish,
                  "logprobs": lp if ids else None}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text, "finish_reason": finish, "token_ids": ids,
                  "logprobs": lp if ids else None}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": call.created, "model": call.model,
            "choices": [choice]}
