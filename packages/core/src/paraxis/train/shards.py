"""Pre-tokenized corpora: one flat token file and a document index, memory-mapped.

``paraxis data prepare SOURCE --out DIR`` tokenizes a source once, over several worker
processes, into the layout of Megatron's indexed datasets and nanoGPT's ``.bin`` files:

* ``tokens.bin``: every document's tokens followed by the separator, back to back, as
  ``uint16`` when the vocabulary fits, else ``uint32``; a fine-tuning example's tokens
  as its encoding made them (:mod:`paraxis.train.sft`: no separator is added);
* ``loss_mask.bin`` (fine-tuning formats only, version 2): one byte per token, 1 where
  it is an answer token, so ``data.loss_on`` can still be chosen when training;
* ``documents.npy``: the end offset of each document or example (int64, ascending);
* ``meta.json``: format and version, dtype, token and document counts, the tokenizer
  and its vocabulary size and separator, the source, and what a row was (``rows``).

``data.source: DIR`` then trains on it: :class:`TokenRows` cuts the token file into
rows of ``seq_length`` without reading it (fine-tuning rows: :class:`paraxis.train.
example_rows.ExampleRows` plans rows of whole examples from the index), and a batch
reads only its rows' pages, so a rank's memory does not grow with the corpus. The files
are checked against the metadata before anything is read (:func:`check_shards`).
"""

from __future__ import annotations

import json
import multiprocessing
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["FORMAT", "TokenRows", "check_shards", "is_prepared", "prepare",
           "prepared_examples", "shard_rows", "text_encoding", "token_rows"]

# Version 2 adds the loss mask of fine-tuning rows; text is still written as version 1,
# which every reader since the first understands.
FORMAT, VERSION, VERSIONS = "paraxis-tokens", 1, (1, 2)
TOKENS, DOCUMENTS, META, LOSS_MASK = "tokens.bin", "documents.npy", "meta.json", "loss_mask.bin"


def is_prepared(path: Path) -> bool:
    return path.is_dir() and (path / META).exists()


# An encoding: (make, args), ``make(*args)`` returning what turns a record into
# (token ids, answer mask or None for text): built once in each worker process.
Encoding = tuple[Callable[..., Callable[[Any], tuple[np.ndarray, np.ndarray | None]]],
                 tuple[Any, ...]]
_worker_encode: Any = None


class _TextEncoding:
    """Documents: their tokens, no mask (the separator is added when writing); a batch of
    them through the tokenizer's own batch encoding where it has one (a fast tokenizer's
    Rust ``encode_batch``: the per-document path through transformers' ``encode`` and a
    tensor ran at 0.49 of the bare tokenizer's rate, issue 38)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    def __call__(self, text: str) -> tuple[np.ndarray, None]:
        return self.tokenizer.encode(text).numpy(), None

    def batch(self, texts: list[str]) -> list[tuple[np.ndarray, None]]:
        many = getattr(self.tokenizer, "encode_batch", None)
        if many is None:
            return [self(text) for text in texts]
        return [(ids, None) for ids in many(texts)]


def text_encoding(load_tokenizer: Any, name: str) -> Callable[[str], tuple[np.ndarray, None]]:
    """Documents: their tokens, no mask (the separator is added when writing)."""
    return _TextEncoding(load_tokenizer(name))


def _init_worker(make: Any, args: tuple[Any, ...]) -> None:
    global _worker_encode
    _worker_encode = make(*args)


def _encode_chunk(records: list[Any]) -> list[tuple[np.ndarray, np.ndarray | None]]:
    """A chunk of records, through the encoding's ``batch`` where it has one: one call
    (and, from a worker, one message each way) per chunk, not per record."""
    batch = getattr(_worker_encode, "batch", None)
    return batch(records) if batch is not None else [_worker_encode(r) for r in records]


def _chunks(records: Iterable[Any], size: int) -> Iterator[list[Any]]:
    chunk: list[Any] = []
    for record in records:
        chunk.append(record)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _start_method() -> str:
    """Workers forked where that is safe, else spawned: a spawned worker re-imports torch
    and transformers (3-5 s each, longer than tokenizing a small corpus: 2 workers ran at
    0.19 of the bare tokenizer's rate per worker, benchmarks/data_prepare.py), while a
    process holding a CUDA context cannot fork. ``data prepare`` never makes one."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return "spawn"
    return "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"


def _encoded(records: Iterable[Any], encoding: Encoding, workers: int, chunk: int = 64
             ) -> Iterator[tuple[np.ndarray, np.ndarray | None]]:
    """Each record encoded, in order, by ``workers`` processes (1: this one), in chunks
    of ``chunk`` records."""
    if workers <= 1:
        _init_worker(*encoding)
        for encoded in map(_encode_chunk, _chunks(records, chunk)):
            yield from encoded
        return
    # One thread a worker; also keeps a fast tokenizer the parent used from warning, and
    # disabling its pool, in each forked worker.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    ctx = multiprocessing.get_context(_start_method())
    with ctx.Pool(workers, _init_worker, encoding) as pool:
        for encoded in pool.imap(_encode_chunk, _chunks(records, chunk)):
            yield from encoded


def prepare(documents: Iterable[Any], out: str | Path, *, load_tokenizer: Any,
            tokenizer_name: str, source: str, workers: int = 1, progress: Any = None,
            rows: str = "text", encoding: Encoding | None = None,
            tokenizer: Any = None) -> dict[str, Any]:
    """Tokenize ``documents`` into ``out`` (created; existing files are replaced) with
    ``load_tokenizer(tokenizer_name)`` (``tokenizer`` when the caller loaded it already),
    or, for fine-tuning ``rows`` (prompt_response, chat), the records with
    ``encoding``; ``progress(documents, tokens)`` is called as they are written.
    Returns the metadata."""
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(tokenizer_name)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32
    sep = np.array([tokenizer.separator], dtype=dtype)
    ends, written = [], 0
    if encoding is None and (workers <= 1 or _start_method() == "fork"):
        # The tokenizer loaded above, inherited: loading one takes about a second (a 32k
        # BPE here), as long as tokenizing 8 MB, and each worker would load its own.
        encoding = (_TextEncoding, (tokenizer,))
    encoding = encoding or (text_encoding, (load_tokenizer, tokenizer_name))
    masked = rows != "text"
    with (out / TOKENS).open("wb") as f, (out / LOSS_MASK).open("wb") as m:
        for tokens, answer in _encoded(documents, encoding, workers):
            f.write(tokens.astype(dtype).tobytes())
            if answer is None:  # a document: the separator ends it
                f.write(sep.tobytes())
            else:
                m.write(answer.astype(np.uint8).tobytes())
            written += len(tokens) + (answer is None)
            ends.append(written)
            if progress is not None:
                progress(len(ends), written)
    if not masked:
        (out / LOSS_MASK).unlink()
    np.save(out / DOCUMENTS, np.asarray(ends, dtype=np.int64))
    meta = {"format": FORMAT, "version": 2 if masked else VERSION,
            "dtype": np.dtype(dtype).name, "tokens": written, "documents": len(ends),
            "tokenizer": tokenizer_name, "vocab_size": tokenizer.vocab_size,
            "separator": tokenizer.separator, "source": source, "rows": rows}
    (out / META).write_text(json.dumps(meta, indent=1) + "\n")
    return meta


def _meta(path: Path) -> dict[str, Any]:
    return json.loads((path / META).read_text())


def shard_rows(path: Path) -> str:
    """What a row of a prepared directory was: text, prompt_response or chat."""
    return str(_meta(path).get("rows", "text"))


def check_shards(path: Path, tokenizer_name: str | None = None,
                 rows: str | None = None) -> str | None:
    """What is wrong with a prepared directory, or None: unreadable or foreign metadata,
    an unknown dtype, a token file, loss mask or index whose size disagrees with the
    metadata, a tokenizer other than the one it was prepared with, rows of another
    ``data.format`` than ``rows``."""
    try:
        meta = _meta(path)
    except (OSError, ValueError) as exc:
        return f"{path / META} cannot be read ({type(exc).__name__}: {exc})"
    if meta.get("format") != FORMAT or meta.get("version") not in VERSIONS:
        return f"{path / META} is not {FORMAT} version {' or '.join(map(str, VERSIONS))}"
    if meta.get("dtype") not in ("uint16", "uint32"):
        return f"{path / META} names dtype {meta.get('dtype')!r}; uint16 or uint32 expected"
    prepared_as = meta.get("rows", "text")
    files = [(TOKENS, meta["dtype"])] + ([(LOSS_MASK, "uint8")] if prepared_as != "text"
                                         else [])
    for name, dtype in files:
        want = meta["tokens"] * np.dtype(dtype).itemsize
        have = (path / name).stat().st_size if (path / name).exists() else None
        if have != want:
            what = "is missing" if have is None else f"holds {have} bytes, not {want}"
            return f"{path / name} {what} ({meta['tokens']} {dtype} tokens in {META})"
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
    if rows is not None and prepared_as != rows:
        return (f"{path} was prepared from {prepared_as} rows, not data.format {rows} "
                f"(paraxis data prepare --format {prepared_as})")
    return None


def prepared_examples(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
    """(tokens, answer mask, example ends, metadata) of a directory prepared from
    fine-tuning rows, memory-mapped; call :func:`check_shards` first."""
    meta = _meta(path)
    tokens = np.memmap(path / TOKENS, dtype=meta["dtype"], mode="r")
    answer = np.memmap(path / LOSS_MASK, dtype=np.uint8, mode="r")
    return tokens, answer, np.load(path / DOCUMENTS, mmap_mode="r"), meta


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
