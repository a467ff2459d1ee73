"""Model profiles: the KV geometry and the compute constants of the emulated models.

There are no model weights in DualPath: a profile is the handful of numbers the data
plane and the cost model need. KV geometry comes from the paper (appendix "KV sizes used
to check Table 1" in the DualPath paper) and the models' public configs; compute
constants are estimates (documented per field) used only by the *emulated* execution of
the cost model (dualpath.kv.cost), scaled by ``speed_scale`` to fit a small machine.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from dualpath.errors import UsageError


@dataclass(frozen=True)
class ModelProfile:
    name: str
    layers: int
    kv_bytes_per_token_layer: int      # bytes of KV one token adds to one layer
    dtype: str                         # KV element type (documentation; bytes are opaque)
    # Compute constants for the emulated cost model (FLOPs; per layer).
    linear_flops_per_token_layer: float  # dense/MoE-active matmuls for one token, one layer
    attn_flops_per_pair_layer: float     # attention for one (query token, key token) pair
    attn_key_cap: int                    # keys attended per query (sparse attention), 0 = all
    gpu_flops_per_s: float               # effective (not peak) FLOP/s of one GPU
    decode_s_per_token: float            # one decode step of one request (batched), seconds
    hbm_bytes: int                       # HBM one engine can devote to KV
    block_tokens: int = 64               # tokens per KV block (paper §4.1: "e.g., 64")
    context_tokens: int = 131072         # longest prompt + generation the model takes
    # HBM bandwidth a decode step reads its batch's KV at (decode is memory-bound: a
    # step's time grows with the keys its batch attends); 0: the batch costs nothing.
    hbm_bytes_per_s: float = 0.0
    # A forward batch's efficiency: its time is its FLOPs at ``gpu_flops_per_s`` times
    # (1 + batch_half_tokens / new tokens in the batch), so a batch of n new tokens runs
    # at n / (n + batch_half_tokens) of the GPU's rate (kernels fill the GPU as batches
    # grow; dualpath/kv/cost.py). 800 fits the paper's Fig. 3 right: requests of 30K
    # context with 300 new tokens get 2.9x the token throughput at a batch of 10 than
    # alone. 0: every batch at the full rate.
    batch_half_tokens: int = 800

    def __post_init__(self) -> None:
        for f in ("layers", "kv_bytes_per_token_layer", "block_tokens", "context_tokens"):
            if getattr(self, f) <= 0:
                raise UsageError(f"model profile {self.name}: {f} must be > 0")
        if self.batch_half_tokens < 0:
            raise UsageError(f"model profile {self.name}: batch_half_tokens must be >= 0")

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of KV per token over all layers."""
        return self.layers * self.kv_bytes_per_token_layer

    @property
    def layer_block_bytes(self) -> int:
        """Bytes of one Layer Block ([1, block_tokens, kv_bytes_per_token_layer])."""
        return self.block_tokens * self.kv_bytes_per_token_layer

    @property
    def full_block_bytes(self) -> int:
        """Bytes of one Full Block ([layers, block_tokens, kv_bytes_per_token_layer])."""
        return self.layers * self.layer_block_bytes

    def tokens_to_bytes(self, tokens: int) -> int:
        """The one place token counts become bytes (scheduler currency -> data plane)."""
        return tokens * self.kv_bytes_per_token

    def with_block_tokens(self, block_tokens: int) -> ModelProfile:
        return replace(self, block_tokens=block_tokens)

    def scaled(self, speed_scale: float) -> ModelProfile:
        """The same model on a GPU ``speed_scale`` times as fast (e.g. 0.01 for 2 CPUs)."""
        return replace(self, gpu_flops_per_s=self.gpu_flops_per_s * speed_scale,
                       decode_s_per_token=self.decode_s_per_token / speed_scale,
                       hbm_bytes_per_s=self.hbm_bytes_per_s * speed_scale)


GiB = 1 << 30
# Effective GPU throughput assumed for Hopper (H800): ~40% of ~990 dense TFLOP/s.
_HOPPER_EFFECTIVE = 0.4 * 990e12
# Effective HBM3 bandwidth of the same GPU: ~80% of 3.35 TB/s.
_HOPPER_HBM = 0.8 * 3.35e12

PROFILES: dict[str, ModelProfile] = {
    # Contexts: 128K tokens (DeepSeek-V3.2's; Qwen2.5-32B's with YaRN; the DS 27B of
    # the paper shares V3.2's architecture).
    # DeepSeek-V3.2 (660B MoE, MLA + DSA sparse attention, FP8 KV): 61 layers,
    # 656 B/token/layer (paper appendix). 37B active params -> 2*37e9/61 FLOPs/token/layer.
    # MLA absorbed: 128 heads x (576 qk + 512 v) x 2 FLOPs per pair; DSA attends top 2048.
    "ds660b": ModelProfile("ds660b", 61, 656, "fp8", 2 * 37e9 / 61, 2 * 128 * (576 + 512),
                           2048, _HOPPER_EFFECTIVE, 0.030, 40 * GiB,
                           hbm_bytes_per_s=_HOPPER_HBM),
    # DS 27B (paper §7: hidden 2560, 30 layers, 32 heads, MoE 72 routed/6 active/2 shared;
    # same per-layer KV size as V3.2). ~2.5B active params estimated.
    "ds27b": ModelProfile("ds27b", 30, 656, "fp8", 2 * 2.5e9 / 30, 2 * 32 * (576 + 512),
                          1024, _HOPPER_EFFECTIVE, 0.015, 40 * GiB,
                          hbm_bytes_per_s=_HOPPER_HBM),
    # Qwen2.5-32B (dense GQA): 64 layers, 8 KV heads x 128 dims x (K,V) x FP16 = 4096
    # B/token/layer; 40 query heads x 128 dims x (QK + PV) x 2 FLOPs per pair.
    "qwen32b": ModelProfile("qwen32b", 64, 4096, "fp16", 2 * 32e9 / 64, 2 * 40 * 128 * 2,
                            0, _HOPPER_EFFECTIVE, 0.025, 40 * GiB,
                            hbm_bytes_per_s=_HOPPER_HBM),
    # A small model sized for a 2-core machine: 8 layers x 2 KiB/token/layer, so a Full
    # Block of 64 tokens is 1 MiB and a Layer Block 128 KiB. Compute is emulated. Its
    # context is what one engine's 1 GiB of HBM holds (16 KiB of KV per token); a decode
    # step over 32K tokens of a batch's KV (512 MiB) takes 2 ms more than a lone one's.
    "demo": ModelProfile("demo", 8, 2048, "fp16", 2e6, 4096, 0, 1e12, 0.002, 1 * GiB,
                         context_tokens=65536, hbm_bytes_per_s=256e9),
}


def geometry_profile(name: str, layers: int, kv_bytes_per_token_layer: int,
                     block_tokens: int, dtype: str = "opaque") -> ModelProfile:
    """A profile that only names a KV geometry (a real engine's model: its compute is
    real, so the emulated cost constants are zero and never used)."""
    return ModelProfile(name, layers, kv_bytes_per_token_layer, dtype, 0.0, 0.0, 0, 0.0, 0.0,
                        0, block_tokens)


def get_profile(name: str, block_tokens: int | None = None) -> ModelProfile:
    try:
        p = PROFILES[name]
    except KeyError:
        raise UsageError(
            f"unknown model profile {name!r}; known profiles: {', '.join(sorted(PROFILES))}"
        ) from None
    return p.with_block_tokens(block_tokens) if block_tokens else p
