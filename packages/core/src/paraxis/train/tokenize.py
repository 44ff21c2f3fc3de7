"""The tokenizers ``data.tokenizer`` names: UTF-8 bytes, or a local Hugging Face one.

Both encode text to a tensor of ids without special tokens and name a *separator*, the
token that ends a document in packed rows (and a prompt/response example's answer).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["ByteTokenizer", "HFTokenizer", "load_tokenizer"]


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, no files needed. Token 0 (NUL, absent from
    text) separates documents. It has no chat template."""

    vocab_size = 256
    separator = 0
    hf = None

    def encode(self, text: str) -> torch.Tensor:
        raw = bytearray(text.encode("utf-8", errors="replace"))
        if not raw:
            return torch.empty(0, dtype=torch.long)
        return torch.frombuffer(raw, dtype=torch.uint8).long()


class HFTokenizer:
    """A local ``AutoTokenizer`` directory; ``hf`` is the transformers tokenizer (its chat
    template renders chat rows, :mod:`paraxis.train.sft`). The separator is its EOS."""

    def __init__(self, path: str):
        from transformers import AutoTokenizer  # only when asked for

        self.hf = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.vocab_size = len(self.hf)
        sep = self.hf.eos_token_id
        self.separator = sep if sep is not None else 0

    @property
    def tok(self) -> Any:  # the name this attribute had before issue 34
        return self.hf

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor(self.hf.encode(text, add_special_tokens=False), dtype=torch.long)


def load_tokenizer(name: str) -> Any:
    return ByteTokenizer() if name == "bytes" else HFTokenizer(name)
