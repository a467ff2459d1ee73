"""What a P/D cluster's nodes need, derived from the model: buffer sizes and CPU cores.

Pure functions over a model's ``config.json`` and the host's cores, used by
:class:`~dualpath.cluster.vllm_pd.VllmPdCluster` (``dualpath up --engine vllm``) and printed at
its start-up.

Buffers. A prefill node stages each request's prompt blocks in its PE buffer (the hit it
loads and the blocks its instance computes, in one reservation); a decode node holds
each request's prompt blocks in its DE buffer from PrepareRequest until its decode
instance loaded them, plus the blocks its decode fills. So each node holds up to
``ceil(max_model_len / block_tokens) + 1`` blocks per request it serves at once, and a
buffer for ``concurrency`` such requests lets that many run while the rest wait their
turn (the pools serve first come, first served). A request larger than a whole buffer is
refused at once, naming the key to raise.

Cores. vLLM's CPU build binds each instance's OpenMP threads; left to itself every
instance on a host picks the same cores (all on core 0 on a small host). Each instance
gets its own slice of the cores this process may run on. Everything else (the
scheduler, the node daemons, the front end, vLLM's API servers and engine cores) runs
on control cores of its own when the host has more cores than instances, as vLLM's own
CPU binding reserves cores for its scheduler (:func:`plan_cores`); on a host with no
core to spare it runs wherever the kernel puts it. Measured on a 2-core host, 1P1D
(bench/vllm_load.py): with the control processes confined to the prefill instance's
core, that core ran the prefill, both engine cores' busy-wait for their workers, two
API servers and every daemon; the scheduler's event loop waited 1 s at a time for the
CPU, a node lost its lease, and K = 8 concurrent requests took 16.9 s instead of
9.6-11.4 s.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from dualpath.buffers.pool import SLOT_ALIGN
from dualpath.cpus import cpu_list
from dualpath.errors import UsageError

#: vLLM's CPU block size (the KV block of the instances; DualPath's block_tokens with
#: block_units 1).
CPU_BLOCK_TOKENS = 128
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def kv_bytes_per_token(config: dict, dtype: str = "float32") -> int:
    """K and V of every layer for one token (a GQA / MHA model's config.json)."""
    try:
        layers = int(config["num_hidden_layers"])
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    except (KeyError, TypeError, ValueError) as e:
        raise UsageError(f"the model's config.json lacks its KV geometry ({e})") from None
    if dtype not in DTYPE_BYTES:
        raise UsageError(f"dtype {dtype!r}: one of {', '.join(DTYPE_BYTES)}")
    return 2 * layers * kv_heads * head_dim * DTYPE_BYTES[dtype]


@dataclass(frozen=True)
class BufferPlan:
    """A node buffer for ``concurrency`` requests of up to ``max_model_len`` tokens."""

    token_bytes: int          # KV bytes per token
    block_tokens: int
    max_model_len: int
    concurrency: int

    @property
    def block_bytes(self) -> int:
        """One Full Block's slot (rounded up to the pool's alignment)."""
        raw = self.token_bytes * self.block_tokens
        return -(-raw // SLOT_ALIGN) * SLOT_ALIGN

    @property
    def request_blocks(self) -> int:
        """Blocks one request holds at most: its whole context, and one it decodes into."""
        return -(-self.max_model_len // self.block_tokens) + 1

    @property
    def mib(self) -> int:
        return -(-self.concurrency * self.request_blocks * self.block_bytes // (1 << 20))

    def describe(self) -> str:
        return (f"{self.mib} MiB per node buffer: {self.concurrency} requests x "
                f"{self.request_blocks} blocks of {self.block_bytes / (1 << 20):.2f} MiB "
                f"({self.token_bytes} KV bytes per token, context {self.max_model_len})")


def plan_buffers(model: Path, max_model_len: int, concurrency: int, *,
                 dtype: str = "float32", block_tokens: int = CPU_BLOCK_TOKENS) -> BufferPlan:
    if concurrency < 1:
        raise UsageError(f"concurrency {concurrency}: must be >= 1")
    if max_model_len < 1:
        raise UsageError(f"max_model_len {max_model_len}: must be >= 1")
    try:
        config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"{model}: cannot read its config.json ({e})") from None
    return BufferPlan(kv_bytes_per_token(config, dtype), block_tokens, max_model_len,
                      concurrency)


def core_slices(instances: int, cores: list[int] | None = None) -> list[str]:
    """VLLM_CPU_OMP_THREADS_BIND for each of ``instances``: the allowed ``cores`` cut
    into that many contiguous slices (one core each, shared round robin, when there
    are more instances than cores)."""
    if instances < 1:
        return []
    cores = sorted(cores if cores is not None else os.sched_getaffinity(0))
    if not cores:
        raise UsageError("no CPU cores to run the instances on")
    if instances >= len(cores):
        return [str(cores[i % len(cores)]) for i in range(instances)]
    per, extra = divmod(len(cores), instances)
    out, at = [], 0
    for i in range(instances):
        n = per + (1 if i < extra else 0)
        part = cores[at:at + n]
        at += n
        out.append(f"{part[0]}-{part[-1]}" if _contiguous(part) else ",".join(map(str, part)))
    return out


def rank_binds(bind: str, tp: int) -> str:
    """An instance's VLLM_CPU_OMP_THREADS_BIND (``"a-b"``, ``"a,b"`` or ``"a"``) cut for
    its ``tp`` ranks (vLLM's ``"x|y"``: one list per rank): contiguous slices, or one
    core each, shared round robin, when the instance has fewer cores than ranks."""
    if tp <= 1:
        return bind
    cores: list[int] = []
    for part in bind.split(","):
        lo, _, hi = part.partition("-")
        cores.extend(range(int(lo), int(hi or lo) + 1))
    return "|".join(core_slices(tp, cores))


@dataclass(frozen=True)
class CorePlan:
    """Where a P/D cluster's processes run: ``instances`` the VLLM_CPU_OMP_THREADS_BIND
    of each instance (prefill instances first), ``control`` the cores of every other
    process (the daemons, the front end, vLLM's API servers and their engine cores'
    threads outside OpenMP)."""

    instances: tuple[str, ...]
    control: tuple[int, ...]

    def describe(self) -> str:
        return f"control processes on cores {cpu_list(self.control)}"


def plan_cores(prefill: int, decode: int, cores: list[int] | None = None) -> CorePlan:
    """The cores of ``prefill`` + ``decode`` instances and of the control processes:
    with more cores than instances, one per 8 cores (at least one) for the control
    processes and the rest cut among the instances (:func:`core_slices`); otherwise the
    instances share them all and so do the control processes."""
    cores = sorted(cores if cores is not None else os.sched_getaffinity(0))
    n = prefill + decode
    if not cores:
        raise UsageError("no CPU cores to run the instances on")
    if len(cores) > n:
        own = min(max(1, len(cores) // 8), len(cores) - n)
        return CorePlan(tuple(core_slices(n, cores[own:])), tuple(cores[:own]))
    return CorePlan(tuple(core_slices(n, cores)), tuple(cores))


def _contiguous(part: list[int]) -> bool:
    return len(part) > 1 and part[-1] - part[0] == len(part) - 1
