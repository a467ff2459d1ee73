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
============== =========================================================================

The model id names the model, its weights and its KV geometry, so KV of one model can
never be served to another (the store namespace derives from it): the scheduler and the
worker compute it alike from the vLLM config.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

from dualpath import config as _config
from dualpath.config import Config
from dualpath.errors import UsageError
from dualpath.rpc import parse_listen

KEYS = ("node_address", "config", "listen", "advertise", "block_units", "lookup_timeout_s",
        "load_timeout_s", "save_timeout_s", "shared_buffer")


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
        return cls(node, cfg, listen, str(extra.get("advertise", "")), units, **times,
                   shared_buffer=shared)


def model_id(vllm_config) -> str:
    """``<name>-<hash>``: the served name, and a hash of the model (its weights' files
    for a local directory, the revision otherwise), the dtypes, the block size and the
    KV geometry. Equal in vLLM's scheduler and worker processes."""
    mc, cc = vllm_config.model_config, vllm_config.cache_config
    h = hashlib.blake2b(digest_size=8)
    for part in (mc.model, mc.revision or "", str(mc.dtype), str(cc.cache_dtype),
                 cc.block_size, mc.get_num_layers(vllm_config.parallel_config),
                 mc.get_total_num_kv_heads(), mc.get_head_size(),
                 vllm_config.parallel_config.tensor_parallel_size):
        h.update(str(part).encode() + b"\0")
    h.update(_weights_fingerprint(mc.model).encode())
    name = mc.served_model_name
    name = name[0] if isinstance(name, list | tuple) else name
    name = Path(str(name or mc.model)).name or "model"
    name = "".join(c if c.isalnum() or c in "._-" else "_" for c in str(name or mc.model))
    return f"{name[-48:]}-{h.hexdigest()}"


def _weights_fingerprint(model: str) -> str:
    """Names, sizes and mtimes of a local model directory's weight and config files (so
    replacing the weights in place changes the id); "" for a hub name."""
    d = Path(model)
    if not d.is_dir():
        return ""
    parts = []
    for f in sorted(d.iterdir()):
        if f.suffix in (".safetensors", ".bin", ".json", ".gguf", ".pt"):
            s = os.stat(f)
            parts.append(f"{f.name}:{s.st_size}:{s.st_mtime_ns}")
    return "|".join(parts)
