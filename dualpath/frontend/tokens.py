"""Text <-> token ids for the front end: the model's own tokenizer (Hugging Face
``tokenizer.json`` and chat template in ``frontend.tokenizer``), loaded once.
Without one, the front end takes token-id prompts only (text is a 400)."""

from __future__ import annotations

import json
from pathlib import Path

from dualpath.errors import ConfigError


class Tokens:
    def __init__(self, directory: str):
        self.directory = directory
        self.tok = None
        if directory:
            if not Path(directory).is_dir():
                raise ConfigError(f"frontend.tokenizer = {directory!r}: not a directory")
            try:
                from transformers import AutoTokenizer
            except ImportError as e:
                raise ConfigError(f"frontend.tokenizer needs the transformers package: "
                                  f"{e}") from None
            self.tok = AutoTokenizer.from_pretrained(directory)

    @property
    def available(self) -> bool:
        return self.tok is not None

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text))

    def chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        ids = self.tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                           tokenize=True)
        if hasattr(ids, "keys"):             # newer transformers: a BatchEncoding
            ids = ids["input_ids"]
        return [int(t) for t in ids]

    def pieces(self, ids: list[int]) -> list[str]:
        """Each token's own text, as vLLM's logprobs name it (its
        ``convert_ids_list_to_tokens``): ``decode([id])``, with the leading spaces a
        SentencePiece-style decode strips put back. Without a tokenizer, vLLM's
        ``token_id:N`` placeholders."""
        if self.tok is None:
            return [f"token_id:{i}" for i in ids]
        out = [self.tok.decode([i]) or "" for i in ids]
        marker = self._marker()
        if marker is None:
            return out
        for j, raw in enumerate(self.tok.convert_ids_to_tokens(list(ids))):
            lead = len(raw) - len(raw.lstrip(marker)) if raw else 0
            missing = lead - (len(out[j]) - len(out[j].lstrip(" ")))
            if missing > 0:
                out[j] = " " * missing + out[j]
        return out

    def _marker(self) -> str | None:
        """The leading-space marker of a Metaspace pre-tokenizer (SentencePiece: "▁"),
        whose leading instance decode() drops; None for byte-level BPE and others."""
        if not hasattr(self, "_space_marker"):
            marker = None
            backend = getattr(self.tok, "backend_tokenizer", None)
            try:
                pre = json.loads(backend.to_str()).get("pre_tokenizer") or {} \
                    if backend is not None else {}
            except (ValueError, AttributeError):
                pre = {}
            subs = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
            for p in subs:
                if p.get("type") == "Metaspace":
                    marker = p.get("replacement", "\u2581")
                    break
            self._space_marker = marker
        return self._space_marker

    def decode(self, ids: list[int]) -> str:
        if self.tok is None:
            return ""
        return self.tok.decode(ids, skip_special_tokens=True)
