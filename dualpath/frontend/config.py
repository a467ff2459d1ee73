"""The [frontend] config section: the OpenAI HTTP front end (`dualpath frontend`)."""

from __future__ import annotations

from dataclasses import dataclass

from dualpath.config import key
from dualpath.errors import ConfigError
from dualpath.rpc import check_listen


@dataclass(frozen=True)
class FrontendConfig:
    """The OpenAI HTTP API in front of the scheduler (docs/vllm.md, "The front end")."""

    listen: str = key("127.0.0.1:8000", "HTTP host:port of the API (port 0 = a free one).")
    api_key_file: str = key("", "File holding the API key clients send as 'Authorization: "
                            "Bearer <key>'; empty = no key (loopback use).")
    model: str = key("", "The model name clients ask for (/v1/models); empty = the "
                     "tokenizer directory's name.")
    tokenizer: str = key("", "Directory of the model's tokenizer (text prompts, chat "
                         "templates, output text); empty = token-id prompts only.")
    block_tokens: int = key(128, "Tokens per KV block of the engines (vLLM's block size x "
                            "the connector's block_units): the front end keys the blocks "
                            "it expects stored with it.", min=1, max=1 << 16)
    max_prompt_tokens: int = key(32768, "Longest prompt accepted (tokens).", min=1,
                                 max=1 << 24)
    max_tokens: int = key(4096, "Most tokens one request may ask to generate.", min=1,
                          max=1 << 20)
    max_model_len: int = key(0, "The instances' context length (vLLM's --max-model-len): "
                             "a longer prompt is refused (400, vLLM's words) and max_tokens "
                             "cut to what the context leaves; 0 = not known, not checked.",
                             min=0, max=1 << 24)
    max_body_bytes: int = key(4 << 20, "Largest request body (bytes).", min=1024,
                              max=1 << 30)
    max_in_flight: int = key(256, "Requests served at once; more are answered 429.",
                             min=1, max=1 << 16)
    request_timeout_s: float = key(600.0, "Bound on one request, queueing included.",
                                   min=1.0)
    index_blocks: int = key(1 << 20, "Blocks the front end remembers as stored (the hit "
                            "it tells the scheduler), least recently used forgotten.",
                            min=0, max=1 << 28)

    def validate(self) -> None:
        check_listen("frontend", listen=self.listen)
        if self.model and len(self.model) > 256:
            raise ConfigError("frontend.model: at most 256 characters")
