"""The [frontend] config section: the OpenAI HTTP front end (`dualpath frontend`)."""

from __future__ import annotations

from dataclasses import dataclass

from dualpath.config import key
from dualpath.errors import ConfigError
from dualpath.frontend.tenants import check_name
from dualpath.rpc import check_listen, is_loopback, parse_listen


@dataclass(frozen=True)
class FrontendConfig:
    """The OpenAI HTTP API in front of the scheduler (docs/vllm.md, "The front end")."""

    listen: str = key("127.0.0.1:8000", "HTTP host:port of the API (port 0 = a free one).")
    api_key_file: str = key("", "File holding the API key clients send as 'Authorization: "
                            "Bearer <key>'; empty = no key (loopback use).")
    api_keys_file: str = key("", "File of API keys, each naming its tenant: one "
                             "'<tenant> <key>' per line ('#' comments). A request is its "
                             "key's tenant's: no tenant's stored KV is another's hit, and "
                             "its blocks count against that tenant's quota "
                             "(storage.tenant_quotas). Beside api_key_file, whose requests "
                             "are default_tenant's.")
    default_tenant: str = key("", "Tenant of the requests no tenant's key names "
                              "(api_key_file's, or any without keys); '' = the unnamed "
                              "default tenant, whose requests' cache_salt alone names "
                              "their tenant, as in vLLM.")
    cert_file: str = key("", "PEM certificate the API serves HTTPS with (with key_file); "
                         "empty = plain HTTP (loopback, or behind a TLS proxy).")
    key_file: str = key("", "PEM private key of cert_file.")
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
    max_connections: int = key(1024, "HTTP connections held at once; past it a new one is "
                               "closed at once (slow clients cannot hold every "
                               "descriptor).", min=8, max=1 << 16)
    header_timeout_s: float = key(10.0, "A connection that has not sent a whole request "
                                  "head (line and headers) this long after it opened is "
                                  "closed.", min=0.5, max=600.0)
    body_timeout_s: float = key(30.0, "Bound on receiving one request's body (408 past "
                                "it).", min=0.5, max=3600.0)
    request_timeout_s: float = key(600.0, "Bound on one request, queueing included.",
                                   min=1.0)
    index_blocks: int = key(1 << 20, "Blocks the front end remembers as stored (the hit "
                            "it tells the scheduler), least recently used forgotten.",
                            min=0, max=1 << 28)

    def validate(self) -> None:
        check_listen("frontend", listen=self.listen)
        if self.default_tenant:
            check_name(self.default_tenant, "frontend.default_tenant")
        if self.api_keys_file and self.api_key_file and not self.default_tenant:
            raise ConfigError("frontend.api_key_file beside frontend.api_keys_file needs "
                              "frontend.default_tenant: the shared key's requests would "
                              "otherwise name their tenant by cache_salt, any tenant's")
        if self.model and len(self.model) > 256:
            raise ConfigError("frontend.model: at most 256 characters")
        if bool(self.cert_file) != bool(self.key_file):
            given, missing = (("cert_file", "key_file") if self.cert_file
                              else ("key_file", "cert_file"))
            raise ConfigError(f"config key frontend.{given} needs frontend.{missing} too: "
                              "HTTPS takes both")

    def warnings(self) -> list[str]:
        """What `dualpath config check` and the front end's start-up warn about: an API
        open beyond loopback without a key, or in plain HTTP."""
        host, _ = parse_listen(self.listen, "frontend.listen")
        if is_loopback(host):
            return []
        out = []
        if not self.api_key_file and not self.api_keys_file:
            out.append(f"frontend.listen = {self.listen} serves beyond loopback without "
                       "frontend.api_key_file: anyone who reaches it may submit requests")
        if not self.cert_file:
            out.append(f"frontend.listen = {self.listen} serves beyond loopback in plain "
                       "HTTP (no frontend.cert_file): keys and prompts cross the network "
                       "in the clear")
        return out
