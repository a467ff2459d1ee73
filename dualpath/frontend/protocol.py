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

from dualpath.engine.payload import SAMPLING_KEYS, check_sampling
from dualpath.errors import UsageError

#: Fields each endpoint accepts; any other one is a 400 naming it.
COMPLETION_FIELDS = frozenset({"model", "prompt", "max_tokens", "temperature", "top_p",
                               "seed", "stream", "logprobs", "ignore_eos", "user", "n",
                               "stream_options", "return_token_ids", *SAMPLING_KEYS})
CHAT_FIELDS = frozenset({"model", "messages", "max_tokens", "max_completion_tokens",
                         "temperature", "top_p", "seed", "stream", "logprobs", "user", "n",
                         "ignore_eos", "stream_options", *SAMPLING_KEYS})
ROLES = ("system", "user", "assistant", "developer")
MAX_BATCH = 64                  # prompts in one completions request


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
    ignore_eos: bool = False
    sampling: dict = field(default_factory=dict)   # vLLM's, passed to the instances
    prompt_ids: list[int] | None = None
    batch: list[str | list[int]] | None = None     # completions: several prompts
    prompt_text: str | None = None
    messages: list[dict] = field(default_factory=list)
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
    s = {k: body[k] for k in SAMPLING_KEYS if body.get(k) is not None}
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
    if _number(body, "n", 1, 1, 1, int) != 1:
        raise bad("only n = 1 is supported", "n")
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
                ignore_eos=_flag(body, "ignore_eos"))
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise bad("'user' must be a string", "user")
    call.sampling = _sampling(body)
    _flag(body, "return_token_ids")     # vLLM's; completions carry token_ids anyway
    return call


def parse_completion(body, limits: Limits) -> Call:
    call = _common(body, COMPLETION_FIELDS, limits, chat=False)
    lp = body.get("logprobs")
    if lp is not None:
        if isinstance(lp, bool) or not isinstance(lp, int) or not 0 <= lp <= 1:
            raise bad("'logprobs' must be 0 or 1 (the sampled token's logprob)", "logprobs")
        call.logprobs = lp == 1
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
    call.logprobs = _flag(body, "logprobs")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("'messages' must be a non-empty list", "messages")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ROLES or \
                _content(m.get("content")) is None or set(m) - {"role", "content", "name"}:
            raise bad(f"messages[{i}] must be {{role: one of {', '.join(ROLES)}, content: "
                      "a string or a list of text parts}", f"messages[{i}]")
    call.messages = [{"role": m["role"], "content": _content(m["content"])} for m in msgs]
    return call


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


def answer(call: Call, rid: str, text: str, ids: list[int], lps: list[float],
           prompt_tokens: int, finish: str) -> dict:
    """The non-streamed answer."""
    if call.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "finish_reason": finish,
                  "logprobs": {"content": [{"token": str(t), "logprob": lp}
                                           for t, lp in zip(ids, lps)]}
                  if call.logprobs else None}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish, "token_ids": ids,
                  "logprobs": {"tokens": [str(t) for t in ids], "token_logprobs": lps}
                  if call.logprobs else None}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": call.created, "model": call.model,
            "choices": [choice], "usage": usage(prompt_tokens, len(ids))}


def batch_answer(answers: list[dict]) -> dict:
    """One answer of a batch of prompts: each prompt's choice at its index, as vLLM's
    server answers; usage summed."""
    out = dict(answers[0])
    out["choices"] = [{**a["choices"][0], "index": i} for i, a in enumerate(answers)]
    out["usage"] = usage(sum(a["usage"]["prompt_tokens"] for a in answers),
                         sum(a["usage"]["completion_tokens"] for a in answers))
    return out


def chunk(call: Call, rid: str, text: str, ids: list[int], lps: list[float],
          finish: str | None, first: bool = False) -> dict:
    """One server-sent event of a streamed answer."""
    if call.chat:
        delta: dict = {"content": text}
        if first:
            delta["role"] = "assistant"
        choice = {"index": 0, "delta": delta, "finish_reason": finish,
                  "logprobs": {"content": [{"token": str(t), "logprob": lp}
                                           for t, lp in zip(ids, lps)]}
                  if call.logprobs and ids else None}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish, "token_ids": ids,
                  "logprobs": {"tokens": [str(t) for t in ids], "token_logprobs": lps}
                  if call.logprobs and ids else None}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": call.created, "model": call.model,
            "choices": [choice]}
