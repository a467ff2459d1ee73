"""Text <-> token ids for the front end: the model's own tokenizer (Hugging Face
``tokenizer.json`` and chat template in ``frontend.tokenizer``), loaded once.
Without one, the front end takes token-id prompts only (text is a 400)."""

from __future__ import annotations

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

    def chat(self, messages: list[dict]) -> list[int]:
        ids = self.tok.apply_chat_template(messages, add_generation_prompt=True,
                                           tokenize=True)
        if hasattr(ids, "keys"):             # newer transformers: a BatchEncoding
            ids = ids["input_ids"]
        return [int(t) for t in ids]

    def decode(self, ids: list[int]) -> str:
        if self.tok is None:
            return ""
        return self.tok.decode(ids, skip_special_tokens=True)
