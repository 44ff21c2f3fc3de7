"""The tokenizers ``data.tokenizer`` names: UTF-8 bytes, or a local Hugging Face one.

Both encode text to a tensor of ids without special tokens and name a *separator*, the
token that ends a document in packed rows (and a prompt/response example's answer).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
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

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Each text's ids (as :meth:`encode`), as arrays."""
        return [np.frombuffer(t.encode("utf-8", errors="replace"), dtype=np.uint8)
                .astype(np.int64) for t in texts]


# What a save_pretrained tokenizer directory holds at least one of.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model",
                    "vocab.json", "vocab.txt")


class HFTokenizer:
    """A local ``AutoTokenizer`` directory; ``hf`` is the transformers tokenizer (its chat
    template renders chat rows, :mod:`paraxis.train.sft`). The separator is its EOS."""

    def __init__(self, path: str):
        if not Path(path).is_dir():  # a name transformers would take for a Hub repo id
            raise FileNotFoundError(
                f"tokenizer {path!r} is not a directory: give a local directory a "
                "tokenizer was saved to (save_pretrained; paraxis never downloads one), "
                "or bytes")
        if not any((Path(path) / name).is_file() for name in _TOKENIZER_FILES):
            raise FileNotFoundError(f"{path} holds no tokenizer files (none of "
                                    f"{', '.join(_TOKENIZER_FILES)}): give the directory "
                                    "a tokenizer was saved to, or bytes")
        from transformers import AutoTokenizer  # only when asked for

        try:
            self.hf = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as exc:  # unreadable tokenizer files
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise OSError(f"{path} holds no tokenizer transformers can load "
                          f"({type(exc).__name__}: {first})") from None
        self.vocab_size = len(self.hf)
        sep = self.hf.eos_token_id
        self.separator = sep if sep is not None else 0

    @property
    def tok(self) -> Any:  # the name this attribute had before issue 34
        return self.hf

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor(self.hf.encode(text, add_special_tokens=False), dtype=torch.long)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Each text's ids (as :meth:`encode`), as arrays: a fast tokenizer's Rust batch
        encoding, which ``encode`` also ends in, without its per-call Python."""
        backend = getattr(self.hf, "backend_tokenizer", None) if self.hf.is_fast else None
        if backend is None:
            return [self.encode(t).numpy() for t in texts]
        return [np.asarray(e.ids, dtype=np.int64)
                for e in backend.encode_batch(texts, add_special_tokens=False)]


def load_tokenizer(name: str) -> Any:
    return ByteTokenizer() if name == "bytes" else HFTokenizer(name)
