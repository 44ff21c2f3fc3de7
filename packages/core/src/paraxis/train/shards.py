"""Pre-tokenized corpora: one flat token file and a document index, memory-mapped.

``paraxis data prepare SOURCE --out DIR`` tokenizes a source once, over several worker
processes, into the layout of Megatron's indexed datasets and nanoGPT's ``.bin`` files:

* ``tokens.bin``: every document's tokens followed by the separator, back to back, as
  ``uint16`` when the vocabulary fits, else ``uint32``;
* ``documents.npy``: the end offset of each document (int64, ascending);
* ``meta.json``: format and version, dtype, token and document counts, the tokenizer
  and its vocabulary size and separator, the source.

``data.source: DIR`` then trains on it: :class:`TokenRows` cuts the token file into
rows of ``seq_length`` without reading it, and a batch reads only its rows' pages, so a
rank's memory does not grow with the corpus. The files are checked against the metadata
before anything is read (:func:`check_shards`).
"""

from __future__ import annotations

import json
import multiprocessing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["FORMAT", "TokenRows", "check_shards", "is_prepared", "prepare", "token_rows"]

FORMAT, VERSION = "paraxis-tokens", 1
TOKENS, DOCUMENTS, META = "tokens.bin", "documents.npy", "meta.json"


def is_prepared(path: Path) -> bool:
    return path.is_dir() and (path / META).exists()


_worker_tokenizer: Any = None


def _init_worker(load: Any, name: str) -> None:
    global _worker_tokenizer
    _worker_tokenizer = load(name)


def _encode(text: str) -> np.ndarray:
    return _worker_tokenizer.encode(text).numpy()


def _encoded(documents: Iterator[str], load: Any, tokenizer_name: str, workers: int
             ) -> Iterator[np.ndarray]:
    """Each document's tokens, in order, from ``workers`` processes (1: this one), each
    with the tokenizer ``load(tokenizer_name)`` gives (a module-level function)."""
    if workers <= 1:
        _init_worker(load, tokenizer_name)
        yield from map(_encode, documents)
        return
    ctx = multiprocessing.get_context("spawn")  # no forked torch state in the workers
    with ctx.Pool(workers, _init_worker, (load, tokenizer_name)) as pool:
        yield from pool.imap(_encode, documents, chunksize=64)


def prepare(documents: Iterator[str], out: str | Path, *, load_tokenizer: Any,
            tokenizer_name: str, source: str, workers: int = 1,
            progress: Any = None) -> dict[str, Any]:
    """Tokenize ``documents`` into ``out`` (created; existing files are replaced) with
    ``load_tokenizer(tokenizer_name)`` in each worker; ``progress(documents, tokens)`` is
    called as they are written. Returns the metadata."""
    tokenizer = load_tokenizer(tokenizer_name)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32
    sep = np.array([tokenizer.separator], dtype=dtype)
    ends, written = [], 0
    with (out / TOKENS).open("wb") as f:
        for tokens in _encoded(documents, load_tokenizer, tokenizer_name, workers):
            f.write(tokens.astype(dtype).tobytes())
            f.write(sep.tobytes())
            written += len(tokens) + 1
            ends.append(written)
            if progress is not None:
                progress(len(ends), written)
    np.save(out / DOCUMENTS, np.asarray(ends, dtype=np.int64))
    meta = {"format": FORMAT, "version": VERSION, "dtype": np.dtype(dtype).name,
            "tokens": written, "documents": len(ends), "tokenizer": tokenizer_name,
            "vocab_size": tokenizer.vocab_size, "separator": tokenizer.separator,
            "source": source}
    (out / META).write_text(json.dumps(meta, indent=1) + "\n")
    return meta


def _meta(path: Path) -> dict[str, Any]:
    return json.loads((path / META).read_text())


def check_shards(path: Path, tokenizer_name: str | None = None) -> str | None:
    """What is wrong with a prepared directory, or None: unreadable or foreign metadata,
    an unknown dtype, a token file or index whose size disagrees with the metadata, a
    tokenizer other than the one it was prepared with."""
    try:
        meta = _meta(path)
    except (OSError, ValueError) as exc:
        return f"{path / META} cannot be read ({type(exc).__name__}: {exc})"
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        return f"{path / META} is not {FORMAT} version {VERSION}"
    if meta.get("dtype") not in ("uint16", "uint32"):
        return f"{path / META} names dtype {meta.get('dtype')!r}; uint16 or uint32 expected"
    want = meta["tokens"] * np.dtype(meta["dtype"]).itemsize
    have = (path / TOKENS).stat().st_size if (path / TOKENS).exists() else None
    if have != want:
        what = "is missing" if have is None else f"holds {have} bytes, not {want}"
        return f"{path / TOKENS} {what} ({meta['tokens']} {meta['dtype']} tokens in {META})"
    try:
        ends = np.load(path / DOCUMENTS, mmap_mode="r")
    except (OSError, ValueError) as exc:
        return f"{path / DOCUMENTS} cannot be read ({type(exc).__name__}: {exc})"
    if len(ends) != meta["documents"] or (len(ends) and int(ends[-1]) != meta["tokens"]):
        return (f"{path / DOCUMENTS} indexes {len(ends)} documents ending at "
                f"{int(ends[-1]) if len(ends) else 0}, not {meta['documents']} ending at "
                f"{meta['tokens']}")
    if tokenizer_name is not None and meta["tokenizer"] != tokenizer_name:
        return (f"{path} was prepared with tokenizer {meta['tokenizer']!r}, not "
                f"data.tokenizer {tokenizer_name!r}")
    return None


class TokenRows:
    """Rows of ``seq_length`` tokens over a memory-mapped token file. ``rows[i]`` for a
    tensor of row numbers reads those rows only (as int64); a slice is another
    :class:`TokenRows` over part of the file."""

    def __init__(self, grid: np.ndarray):
        self.grid = grid  # (rows, seq_length), a view of the memory map

    def __len__(self) -> int:
        return len(self.grid)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return TokenRows(self.grid[index])
        picked = np.asarray(index.numpy() if isinstance(index, torch.Tensor) else index)
        return torch.from_numpy(self.grid[picked].astype(np.int64))


def token_rows(path: Path, seq_length: int) -> TokenRows:
    """The prepared directory ``path`` cut into rows (the tail shorter than a row is
    left out); call :func:`check_shards` first."""
    meta = _meta(path)
    tokens = np.memmap(path / TOKENS, dtype=meta["dtype"], mode="r")
    rows = len(tokens) // seq_length
    if rows == 0:
        raise ValueError(f"{path} holds {len(tokens)} tokens, fewer than one sequence of "
                         f"{seq_length}")
    return TokenRows(tokens[: rows * seq_length].reshape(rows, seq_length))
