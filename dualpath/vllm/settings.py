"""The connector's settings (vLLM's ``kv_connector_extra_config``) and model identity.

Keys (every other key is refused, naming the known ones):

============== =========================================================================
node_address   host:port of the node daemon beside vLLM (its engine.control_listen);
               required
config         a DualPath TOML file whose [transport], [transfer] and [kv_lane] the
               worker's data plane uses (the node's own config, so both sides match);
               optional, defaults otherwise
listen         the worker agent's gRPC address (default 127.0.0.1:0: any free port)
advertise      host the node daemon reaches the worker at (default: listen's host)
block_units    engine blocks per DualPath block (DualPath's block_tokens = block_units
               x vLLM's block size; default 1)
lookup_timeout_s  bound on the scheduler's hit lookup (default 2; past it: no hit)
load_timeout_s    a load that makes no progress for this long fails (default 60; its
                  blocks are recomputed, the memory fenced first)
save_timeout_s    bound on persisting one step's new blocks (default 60; past it they
                  are not cached)
shared_buffer  map the node daemon's DRAM buffer (same host, KV in host memory) and copy
               layers from it instead of receiving WRITEs (default true; false forces
               the data plane, e.g. to measure it)
model_id       the model's id as the operator names it (letters, digits, ``._-``; at
               most 64): the store namespace of its KV, used as it is; default: derived
               (below)
============== =========================================================================

The model id names the model, its weights and its KV geometry, so KV of one model can
never be served to another (the store namespace derives from it): the scheduler and the
worker compute it alike from the vLLM config. It is derived from what defines the KV,
never from where or when the files were written, so hosts holding the same weights
agree on it and share their hits: the model config vLLM runs (its hf_config, overrides
included; keys that only record provenance, such as ``_name_or_path``, left out), the
dtypes, the block size, the KV geometry (every head's: not the tensor-parallel size, as
the stored block is the same at any TP), and per weight file its name, size and content:
hashed whole when the weights total at most 1 GiB; else each file by its identity (a
safetensors file's whole header, which names every tensor's dtype, shape and offset,
and the first and last 4 KiB of every tensor, so an edit of any whole tensor changes the
id; other formats 17 evenly spaced 64 KiB samples), since reading every byte of a 600 GB
model at start-up, in the scheduler and in every worker, would take minutes. An edit that leaves every tensor's first and last 4 KiB alone needs the
operator's ``model_id``. A hub name instead of a directory: the name and the revision
(pin one: without it the id does not follow the hub's ``main``).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from dualpath import config as _config
from dualpath.config import Config
from dualpath.errors import UsageError
from dualpath.rpc import parse_listen

KEYS = ("node_address", "config", "listen", "advertise", "block_units", "lookup_timeout_s",
        "load_timeout_s", "save_timeout_s", "shared_buffer", "model_id")


@dataclass(frozen=True)
class ConnectorSettings:
    node_address: str
    config: Config = field(default_factory=lambda: _config.load(None, {}))
    listen: str = "127.0.0.1:0"
    advertise: str = ""
    block_units: int = 1
    lookup_timeout_s: float = 2.0
    load_timeout_s: float = 60.0
    save_timeout_s: float = 60.0
    shared_buffer: bool = True
    model_id: str = ""                  # the operator's; "" = derived (model_id())

    @classmethod
    def from_extra_config(cls, extra: dict) -> ConnectorSettings:
        unknown = sorted(set(extra) - set(KEYS))
        if unknown:
            raise UsageError(f"kv_connector_extra_config: unknown key(s) {', '.join(unknown)};"
                             f" DualPathConnector knows {', '.join(KEYS)}")
        node = extra.get("node_address")
        if not node or not isinstance(node, str):
            raise UsageError("kv_connector_extra_config.node_address is required: the "
                             "host:port of the DualPath node daemon beside this vLLM")
        parse_listen(node, "kv_connector_extra_config.node_address")
        listen = str(extra.get("listen", "127.0.0.1:0"))
        parse_listen(listen, "kv_connector_extra_config.listen")
        cfg = _config.load(str(extra["config"]) if extra.get("config") else None, {})
        units = extra.get("block_units", 1)
        if isinstance(units, bool) or not isinstance(units, int) or not 1 <= units <= 64:
            raise UsageError(f"kv_connector_extra_config.block_units must be 1..64, not "
                             f"{units!r}")
        times = {}
        for k in ("lookup_timeout_s", "load_timeout_s", "save_timeout_s"):
            if k in extra:
                v = extra[k]
                if isinstance(v, bool) or not isinstance(v, int | float) or not 0 < v < 3600:
                    raise UsageError(f"kv_connector_extra_config.{k} must be a number of "
                                     f"seconds in (0, 3600), not {v!r}")
                times[k] = float(v)
        shared = extra.get("shared_buffer", True)
        if not isinstance(shared, bool):
            raise UsageError(f"kv_connector_extra_config.shared_buffer must be true or "
                             f"false, not {shared!r}")
        mid = extra.get("model_id", "")
        if not isinstance(mid, str) or (mid and not re.fullmatch(r"[A-Za-z0-9._-]{1,64}", mid)):
            raise UsageError(f"kv_connector_extra_config.model_id must be 1-64 letters, digits, "
                             f"'.', '_' or '-', not {mid!r}")
        return cls(node, cfg, listen, str(extra.get("advertise", "")), units, **times,
                   shared_buffer=shared, model_id=mid)


def model_id(vllm_config) -> str:
    """``<model type>-<hash>``: the model's architecture type (config.json's
    ``model_type``; not its path or served name, which differ between hosts) and a hash
    of what defines its KV (see the module docstring). Equal in vLLM's scheduler and
    worker processes, and on every host with the same weights."""
    mc, cc = vllm_config.model_config, vllm_config.cache_config
    h = hashlib.blake2b(digest_size=8)
    for part in (str(mc.dtype), str(cc.cache_dtype), cc.block_size,
                 mc.get_num_layers(vllm_config.parallel_config),
                 mc.get_total_num_kv_heads(), mc.get_head_size(),
                 bool(getattr(mc, "use_mla", False))):
        h.update(str(part).encode() + b"\0")
    # The config vLLM runs (hf_overrides, rope scaling included: K is cached after RoPE).
    hf = getattr(mc, "hf_config", None)
    cfg = hf.to_dict() if hf is not None and hasattr(hf, "to_dict") else None
    h.update(model_identity(mc.model, mc.revision or "", cfg))
    kind = (cfg or {}).get("model_type") or _config_of(Path(str(mc.model))).get(
        "model_type") or "model"
    name = "".join(c if c.isalnum() or c in "._-" else "_" for c in str(kind))
    return f"{name[-48:]}-{h.hexdigest()}"


#: Keys of a model config that record where or with what the model was written, not what
#: it is.
PROVENANCE = frozenset({"_name_or_path", "transformers_version", "_commit_hash",
                        "name_or_path"})
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")
#: Files up to this size are hashed whole; larger ones by their identity (below).
WHOLE_BYTES = 1 << 30
SAMPLES, SAMPLE_BYTES = 17, 64 << 10
TENSOR_EDGE = 4096                      # bytes of each tensor's start and end hashed
MAX_HEADER = 100 << 20


def _config_of(d: Path) -> dict:
    try:
        c = json.loads((d / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return c if isinstance(c, dict) else {}


def model_identity(model: str, revision: str = "", config: dict | None = None) -> bytes:
    """What defines a model's weights, as bytes to hash (module docstring): the config
    (``config``, vLLM's effective one; else the directory's config.json) without its
    provenance keys, and each weight file's content; a hub name's name and revision."""
    d = Path(model)
    if not d.is_dir():
        return f"hub:{model}@{revision}".encode()
    h = hashlib.blake2b(digest_size=16)
    c = config if config is not None else _config_of(d)
    c = {k: v for k, v in c.items() if k not in PROVENANCE}
    h.update(json.dumps(c, sort_keys=True, default=str).encode() + b"\0")
    files = [f for f in sorted(d.iterdir()) if f.suffix in WEIGHT_SUFFIXES and f.is_file()]
    # Whole only when all of them together are small: a model in many 1 GiB shards must
    # not be read end to end at each start-up (by the scheduler and every worker).
    whole = sum(f.stat().st_size for f in files) <= WHOLE_BYTES
    for f in files:
        h.update(f"{f.name}:{f.stat().st_size}:".encode() + _content_digest(f, whole) + b"\0")
    return h.digest()


def _content_digest(path: Path, whole: bool) -> bytes:
    """A file's content (``whole``), else its identity: a
    safetensors file's whole header (every tensor's name, dtype, shape, offsets) and the
    first and last TENSOR_EDGE bytes of every tensor (an edit of any whole tensor, such
    as a merged adapter or a targeted weight edit, changes them), else SAMPLES chunks
    of SAMPLE_BYTES evenly spaced."""
    h = hashlib.blake2b(digest_size=16)
    size = path.stat().st_size
    with open(path, "rb") as fh:
        if whole:
            while chunk := fh.read(8 << 20):
                h.update(chunk)
            return h.digest()
        spans: list[tuple[int, int]] = []
        if path.suffix == ".safetensors":
            n = int.from_bytes(fh.read(8), "little")
            header = fh.read(min(n, MAX_HEADER, size - 8))
            h.update(header)
            try:
                meta = json.loads(header)
                spans = sorted((8 + n + int(v["data_offsets"][0]), 8 + n + int(v["data_offsets"][1]))
                               for k, v in meta.items() if k != "__metadata__")
            except (ValueError, KeyError, TypeError, IndexError):
                spans = []
        if not spans:
            spans = [(max(0, (size - SAMPLE_BYTES) * i // (SAMPLES - 1)),
                      min(size, max(0, (size - SAMPLE_BYTES) * i // (SAMPLES - 1))
                          + SAMPLE_BYTES)) for i in range(SAMPLES)]
        for a, b in spans:
            for start in {a, max(a, b - TENSOR_EDGE)}:
                fh.seek(start)
                h.update(fh.read(min(TENSOR_EDGE, b - start)))
    return h.digest()
