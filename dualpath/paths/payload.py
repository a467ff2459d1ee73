"""A request's payload: what the scheduler carries for the engines, opaque to it (pure).

A request carries a :class:`Payload` (JSON in the scheduler's opaque ``payload`` bytes):
the trajectory and round it replays, the mode, and where to report timings. Its token
ids are carried explicitly (real traces) or derived from the trajectory by a
:data:`TokenSource` the node is given (the synthetic stream of dualpath/trace/model.py
for generated traces), so nothing here depends on the workload generator.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np

from dualpath.errors import UsageError
from dualpath.kv.prefix import MAX_TENANT_CHARS, tenant_root

#: ``(trajectory, stop) -> token ids of stream positions [0, stop)``.
TokenSource = Callable[[str, int], np.ndarray]

MODES = ("basic", "dualpath", "oracle")
# How the PE turns the scheduler's read side into the one it acts on.
# "decode" and "split" force the DE read and (vLLM prefills) a real split read, for tests.
READ_POLICIES = ("scheduler", "prefill", "decode", "split", "round_robin", "none")
MODE_READ_POLICY = {"basic": "prefill", "dualpath": "scheduler", "oracle": "none"}
# Whether a mode prefills layerwise unless told: the paper's Basic does not.
MODE_LAYERWISE = {"basic": False, "dualpath": True, "oracle": True}


#: vLLM sampling parameters a request may carry beyond temperature, top_p and seed, and
#: the check of each value (a bound on every size a caller chooses).
SAMPLING_KEYS = ("stop", "stop_token_ids", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "top_k", "min_p", "min_tokens", "logprobs",
                 "logit_bias")
MAX_STOPS = 16
#: Top logprobs a request may ask for per token (vLLM's default max_logprobs).
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 1024           # biased tokens of one request
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 256


def _num(v, lo: float, hi: float, integral: bool = False) -> bool:
    ok = isinstance(v, int) if integral else isinstance(v, (int, float))
    return ok and not isinstance(v, bool) and lo <= v <= hi


def check_sampling(s: dict) -> dict:
    """``s`` (vLLM sampling fields, SAMPLING_KEYS) checked: UsageError naming the first
    bad one; the same dict back. ``stop`` is a list of strings here."""
    if not isinstance(s, dict):
        raise UsageError("sampling must be an object")
    for k, v in s.items():
        if k not in SAMPLING_KEYS:
            raise UsageError(f"sampling: unknown field {k!r}")
        if k == "stop":
            ok = (isinstance(v, list) and len(v) <= MAX_STOPS and all(
                isinstance(x, str) and 0 < len(x) <= MAX_STOP_CHARS for x in v))
            what = (f"a list of at most {MAX_STOPS} strings of 1 to {MAX_STOP_CHARS} "
                    "characters")
        elif k == "stop_token_ids":
            ok = (isinstance(v, list) and len(v) <= MAX_STOP_TOKEN_IDS
                  and all(_num(x, 0, 2 ** 31 - 1, True) for x in v))
            what = f"a list of at most {MAX_STOP_TOKEN_IDS} token ids"
        elif k in ("presence_penalty", "frequency_penalty"):
            ok, what = _num(v, -2.0, 2.0), "a number between -2 and 2"
        elif k == "repetition_penalty":
            ok, what = _num(v, 1e-6, 10.0), "a number in (0, 10]"
        elif k == "top_k":
            ok, what = _num(v, -1, 2 ** 31 - 1, True), "-1 (off) or a positive integer"
        elif k == "min_p":
            ok, what = _num(v, 0.0, 1.0), "a number between 0 and 1"
        elif k == "logprobs":           # top logprobs per token (the instances list them)
            ok, what = (_num(v, 0, MAX_LOGPROBS, True),
                        f"an integer between 0 and {MAX_LOGPROBS}")
        elif k == "logit_bias":         # token id (a string of digits, as in JSON) -> bias
            ok = isinstance(v, dict) and len(v) <= MAX_LOGIT_BIAS and all(
                isinstance(t, str) and t.isdigit() and len(t) <= 10 and int(t) < 2 ** 31
                and _num(b, -100.0, 100.0) for t, b in v.items())
            what = (f"an object of at most {MAX_LOGIT_BIAS} token ids (strings) to biases "
                    "between -100 and 100")
        else:                            # min_tokens
            ok, what = _num(v, 0, 1 << 20, True), "an integer between 0 and 2^20"
        if not ok:
            raise UsageError(f"'{k}' must be {what}")
    return s


@dataclass(frozen=True)
class Payload:
    trajectory: str
    round: int
    prompt_tokens: int
    hit_tokens: int
    gen_tokens: int
    mode: str = "dualpath"
    sink: str = ""                    # host:port of the replay client's ReplaySink; "" = none
    layerwise: bool = True            # overlap layer l+1's transfers with layer l's compute
    read_policy: str = "scheduler"    # READ_POLICIES
    token_ids_b64: str = ""           # explicit stream ids (int32 LE) for real traces
    # How a real engine (vLLM) samples: greedy by default; a seed makes a retried attempt
    # sample the same tokens. ignore_eos: exactly gen_tokens tokens (traces); else up to.
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = -1                    # -1: none
    ignore_eos: bool = True
    stream: bool = False              # the DE streams tokens to the sink as they come
    # vLLM's prefix-cache salt for both instances' requests ("" none): instances that keep
    # their own prefix cache hit only requests of the same salt (bench/vllm_pd.py: the
    # oracle salts by trajectory, the other modes by request: no local hit).
    cache_salt: str = ""
    # Whose KV this is: the root of its block keys (dualpath/kv/prefix.py tenant_root), so
    # one tenant's stored blocks are never another's hit. "" = the default tenant.
    tenant: str = ""
    # More of vLLM's sampling parameters (SAMPLING_KEYS), passed to both instances.
    sampling: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.mode not in MODES:
            raise UsageError(f"payload: mode {self.mode!r}; allowed: {', '.join(MODES)}")
        if self.read_policy not in READ_POLICIES:
            raise UsageError(f"payload: read_policy {self.read_policy!r}; allowed: "
                             f"{', '.join(READ_POLICIES)}")
        if len(self.cache_salt) > 256:
            raise UsageError("payload: cache_salt longer than 256 characters")
        if not isinstance(self.tenant, str) or len(self.tenant) > MAX_TENANT_CHARS:
            raise UsageError(f"payload: tenant must be a string of at most "
                             f"{MAX_TENANT_CHARS} characters")
        check_sampling(self.sampling)
        if not (0.0 <= self.temperature <= 2.0 and 0.0 < self.top_p <= 1.0
                and -1 <= self.seed < 2 ** 63):
            raise UsageError(f"payload: temperature {self.temperature} (0..2), top_p "
                             f"{self.top_p} (0..1], seed {self.seed} (-1 or >= 0)")
        if not 0 <= self.hit_tokens < self.prompt_tokens or self.gen_tokens < 1:
            raise UsageError(f"payload: need 0 <= hit < prompt and gen >= 1, got "
                             f"{self.hit_tokens}, {self.prompt_tokens}, {self.gen_tokens}")

    def encode(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes) -> Payload:
        try:
            return cls(**json.loads(data))
        except (ValueError, TypeError) as e:
            raise UsageError(f"malformed request payload: {e}") from None

    @property
    def oracle(self) -> bool:
        return self.mode == "oracle"

    @property
    def key_root(self) -> bytes:
        """The root of this request's block keys: its tenant's."""
        return tenant_root(self.tenant)

    def token_ids(self, stop: int, source: TokenSource) -> np.ndarray:
        """Ids of stream positions ``[0, stop)`` (prompt, or prompt + generation): the
        carried ones, else ``source``'s for the trajectory."""
        if self.token_ids_b64:
            ids = np.frombuffer(base64.b64decode(self.token_ids_b64), dtype="<i4")
            if stop > ids.size:
                raise UsageError(f"payload carries {ids.size} token ids, {stop} needed")
            return ids[:stop].astype(np.int64)
        return source(self.trajectory, stop)


def encode_token_ids(ids: np.ndarray) -> str:
    return base64.b64encode(np.asarray(ids, dtype="<i4").tobytes()).decode()
