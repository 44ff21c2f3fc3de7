"""Packed fixed-length token sequences, each sample-splitting rank reading its own slice.

Documents come from local text or JSONL files, a ``datasets`` dataset saved to disk, or
by default the running interpreter's standard-library sources (present offline on every
machine with Python). They are tokenized (bytes by default, or a local Hugging Face
tokenizer), joined with a separator token and cut into rows of ``seq_length`` tokens.
:class:`BatchStream` serves global batch after global batch in a seeded order and keeps
its position (samples consumed) so a resumed run continues with the next sample.
"""

from __future__ import annotations

import json
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from paraxis.config.errors import Problem
from paraxis.config.run import DataSection, RunConfig
from paraxis.train.order import permute
from paraxis.train.shards import TokenRows, check_shards, is_prepared, token_rows
from paraxis.train.stream import check_stream, stream_documents

__all__ = ["BatchStream", "ByteTokenizer", "check_data", "document_positions",
           "iter_documents", "load_tokenizer", "pack", "prepack", "split_held_out"]


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, no files needed. Token 0 (NUL, absent from
    text) separates documents."""

    vocab_size = 256
    separator = 0

    def encode(self, text: str) -> torch.Tensor:
        raw = bytearray(text.encode("utf-8", errors="replace"))
        if not raw:
            return torch.empty(0, dtype=torch.long)
        return torch.frombuffer(raw, dtype=torch.uint8).long()


# What a save_pretrained tokenizer directory holds at least one of.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model",
                    "vocab.json", "vocab.txt")


class _HFTokenizer:
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
            self.tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as exc:  # no tokenizer files, or unreadable ones
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise OSError(f"{path} holds no tokenizer transformers can load "
                          f"({type(exc).__name__}: {first})") from None
        self.vocab_size = len(self.tok)
        sep = self.tok.eos_token_id
        self.separator = sep if sep is not None else 0

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor(self.tok.encode(text, add_special_tokens=False), dtype=torch.long)


def load_tokenizer(name: str) -> Any:
    return ByteTokenizer() if name == "bytes" else _HFTokenizer(name)


def _stdlib_files() -> list[Path]:
    """The standard library's ``.py`` files, tests and installed packages left out. The
    walk prunes those directories instead of filtering a ``rglob`` of everything: a
    site-packages of 52k files made the listing 0.23 s of the packing, now 0.004 s."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idlelib", "__pycache__"}
    found = []
    for where, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in skip]
        found += [Path(where) / f for f in files if f.endswith(".py")]
    return sorted(found)


def iter_documents(cfg: DataSection) -> Iterator[str]:
    """Documents of the configured source, in a fixed order, up to ``max_bytes``."""
    budget = cfg.max_bytes
    for doc in _documents(cfg):
        if budget <= 0:
            return
        doc = doc[:budget]
        budget -= len(doc.encode("utf-8", errors="replace"))
        yield doc


def check_data(cfg: RunConfig, tokenizer: Any | None = None) -> list[Problem]:
    """What is wrong with the data sections, found without tokenizing anything: a source
    that does not exist or holds nothing, a text field the rows lack, a tokenizer whose
    vocabulary the model cannot embed. ``tokenizer``: the loaded one, else loaded here."""
    problems = cfg.check_data_modes()
    for field, source in [("data.source", cfg.data.source),
                          ("data.eval.source", cfg.data.eval.source)]:
        if source is not None:
            problems += _check_source(field, source, cfg.data)
    try:
        vocab = (tokenizer or load_tokenizer(cfg.data.tokenizer)).vocab_size
    except OSError as exc:
        return [*problems, Problem("data.tokenizer", cfg.data.tokenizer,
                                   f"cannot be loaded ({exc})", "give a local tokenizer "
                                   "directory, or bytes")]
    model_vocab = cfg.model.config.get("vocab_size")
    if isinstance(model_vocab, int) and vocab > model_vocab:
        problems.append(Problem(
            "data.tokenizer", cfg.data.tokenizer,
            f"has {vocab} tokens but model.config.vocab_size is {model_vocab}: ids past "
            "the embedding would index out of range", f"set model.config.vocab_size to at "
            f"least {vocab}, or use the model's own tokenizer"))
    return problems


def _check_source(field: str, source: str, cfg: DataSection) -> list[Problem]:
    if source == "stdlib":
        return []
    if cfg.streaming:
        why = check_stream(source, cfg.text_field)
        return [] if why is None else [Problem(field, source, why, "give local parquet, "
                                               "arrow or JSONL files with that column")]
    src = Path(source)
    if not src.exists():
        return [Problem(field, source, "does not exist", "give an existing file or directory")]
    fmt = _format(src, cfg.format)
    if fmt == "tokens":
        why = check_shards(src, cfg.tokenizer)
        return [] if why is None else [Problem(field, source, why, "prepare it again with "
                                               "paraxis data prepare")]
    if fmt == "hf_disk":
        from datasets import load_from_disk  # memory-mapped: nothing is read here

        try:
            ds = load_from_disk(str(src))
        except Exception as exc:  # datasets' own errors (an empty save cannot be opened)
            return [Problem(field, source, f"cannot be opened as a saved dataset "
                            f"({type(exc).__name__}: {exc})", "save it again with rows")]
        ds = (ds["train"] if "train" in ds else ds[next(iter(ds.keys()))]) \
            if hasattr(ds, "keys") else ds
        if len(ds) == 0:
            return [Problem(field, source, "is an empty dataset", "give one with rows")]
        if cfg.text_field not in ds.column_names:
            return [Problem(field, source, f"has no column {cfg.text_field!r} (columns: "
                            f"{', '.join(ds.column_names)})", "set data.text_field")]
        return []
    files = sorted(p for p in src.rglob("*") if p.is_file()) if src.is_dir() else [src]
    if not any(p.stat().st_size for p in files):
        return [Problem(field, source, "holds no text (empty)", "give a non-empty source")]
    if fmt == "jsonl" or any(p.suffix == ".jsonl" for p in files):
        for path in files:
            with path.open(encoding="utf-8") as f:
                line = next((line for line in f if line.strip()), None)
            if line is not None and cfg.text_field not in json.loads(line):
                return [Problem(field, str(path), f"rows have no field {cfg.text_field!r}",
                                "set data.text_field")]
    return []


def _format(src: Path, fmt: str) -> str:
    """``data.format``, with ``auto`` resolved from what ``src`` looks like."""
    if fmt != "auto":
        return fmt
    if is_prepared(src):
        return "tokens"
    saved = ("dataset_info.json", "state.json", "dataset_dict.json")
    if src.is_dir() and any((src / name).exists() for name in saved):
        return "hf_disk"
    return "jsonl" if src.suffix in (".jsonl", ".json") else "text"


def _documents(cfg: DataSection) -> Iterator[str]:
    if cfg.source == "stdlib":
        for path in _stdlib_files():
            yield path.read_text(encoding="utf-8", errors="replace")
        return
    if cfg.streaming:  # an eval source beside a stream, or paraxis data prepare
        yield from stream_documents(cfg.source, cfg.text_field)
        return
    src = Path(cfg.source)
    fmt = _format(src, cfg.format)
    if fmt == "tokens":
        raise ValueError(f"data.source {cfg.source!r} is already tokenized "
                         "(paraxis data prepare): it has rows, not documents")
    if not src.exists():
        raise FileNotFoundError(f"data.source {cfg.source!r} does not exist")
    if fmt == "hf_disk":
        from datasets import load_from_disk  # only when asked for

        ds = load_from_disk(str(src))
        if hasattr(ds, "keys"):  # a DatasetDict: take the train split or the first one
            ds = ds["train"] if "train" in ds else ds[next(iter(ds.keys()))]
        for row in ds:
            yield str(row[cfg.text_field])
        return
    files = sorted(p for p in src.rglob("*") if p.is_file()) if src.is_dir() else [src]
    for path in files:
        if fmt == "jsonl" or path.suffix == ".jsonl":
            for line in path.read_text(encoding="utf-8").splitlines():
                if line.strip():
                    yield str(json.loads(line)[cfg.text_field])
        else:
            yield path.read_text(encoding="utf-8", errors="replace")


# Rows the launcher packed before it forked the workers (paraxis.train.forked), by what
# pack() was asked: a forked worker takes them, shared copy-on-write, instead of
# tokenizing the corpus again. Empty in every other process.
_PREPACKED: dict[tuple[str, int], torch.Tensor] = {}


def prepack(cfg: DataSection, seq_length: int, tokenizer: Any) -> None:
    """Pack ``cfg``'s rows now, for :func:`pack` to return in processes forked later."""
    _PREPACKED[(cfg.model_dump_json(), seq_length)] = pack(cfg, seq_length, tokenizer)


def pack(cfg: DataSection, seq_length: int, tokenizer: Any) -> torch.Tensor | TokenRows:
    """All documents tokenized, separated, and cut into rows: shape (rows, seq_length).
    Tokens stay tensors throughout (no Python list of millions of ints). A directory
    ``paraxis data prepare`` wrote is not read: its rows are memory-mapped."""
    if cfg.source != "stdlib" and _format(Path(cfg.source), cfg.format) == "tokens":
        return token_rows(Path(cfg.source), seq_length)
    packed = _PREPACKED.get((cfg.model_dump_json(), seq_length))
    if packed is not None:
        return packed
    sep = torch.tensor([tokenizer.separator], dtype=torch.long)
    pieces: list[torch.Tensor] = []
    for doc in iter_documents(cfg):
        pieces += [tokenizer.encode(doc), sep]
    ids = torch.cat(pieces) if pieces else sep[:0]
    rows = len(ids) // seq_length
    if rows == 0:
        raise ValueError(f"data.source {cfg.source!r} holds {len(ids)} tokens, fewer than "
                         f"one sequence of {seq_length}")
    return ids[: rows * seq_length].view(rows, seq_length)


def document_positions(rows: torch.Tensor, separator: int) -> torch.Tensor:
    """Position ids of packed ``rows`` that restart at 0 after each ``separator`` (which
    ends its document) and at each row's start: the layout
    :meth:`paraxis.parallel.batch.Batch.from_user` reads as document boundaries."""
    index = torch.arange(rows.shape[1]).expand_as(rows)
    starts = torch.zeros_like(rows, dtype=torch.bool)
    starts[:, 1:] = rows[:, :-1] == separator
    starts[:, 0] = True
    return index - torch.where(starts, index, 0).cummax(-1).values


def split_held_out(cfg: DataSection, seq_length: int, tokenizer: Any
                   ) -> tuple[Any, Any]:
    """The training rows and the held-out rows of ``cfg.eval`` (None when it names
    none): the last ``fraction`` of the packed rows, cut off before any training order is
    drawn, or the rows of its own ``source``."""
    rows = pack(cfg, seq_length, tokenizer)
    if cfg.eval.source:
        return rows, pack(cfg.model_copy(update={"source": cfg.eval.source}), seq_length,
                          tokenizer)
    if not cfg.eval.fraction:
        return rows, None
    held = max(1, round(cfg.eval.fraction * len(rows)))
    if held >= len(rows):
        raise ValueError(f"data.eval.fraction {cfg.eval.fraction} of {len(rows)} rows "
                         "leaves none to train on")
    return rows[:-held], rows[-held:]


class BatchStream:
    """Global batches of rows in a seeded order; this rank takes its contiguous slice.

    ``position`` counts samples consumed by the whole run; it is saved in checkpoints,
    and a stream built with the same rows, seed and position continues exactly. The
    order of each epoch is :func:`paraxis.train.order.permute` (seed + epoch), evaluated
    for the rows a batch needs, so it costs no memory however many rows there are.
    """

    def __init__(self, rows: Any, *, global_batch: int, rank: int, ranks: int,
                 shuffle: bool = True, seed: int = 0, position: int = 0):
        if global_batch % ranks:
            raise ValueError(f"global batch {global_batch} does not split over {ranks} ranks")
        if len(rows) < global_batch:
            raise ValueError(f"only {len(rows)} sequences for a global batch of {global_batch}")
        self.rows, self.global_batch = rows, global_batch
        self.rank, self.ranks = rank, ranks
        self.shuffle, self.seed, self.position = shuffle, seed, position

    @property
    def batches_per_epoch(self) -> int:
        return len(self.rows) // self.global_batch

    def global_index(self) -> torch.Tensor:
        """The row numbers of the next global batch, in order; advances the position."""
        per_epoch = self.batches_per_epoch * self.global_batch
        epoch, offset = divmod(self.position, per_epoch)
        self.position += self.global_batch
        index = torch.arange(offset, offset + self.global_batch)
        if self.shuffle:  # the epoch's order over every row; the tail past whole batches
            index = permute(index, len(self.rows), self.seed + epoch)  # differs by epoch
        return index

    def next_batch(self) -> Any:
        """This rank's share of the next global batch: (global_batch / ranks, seq)."""
        per = self.global_batch // self.ranks
        return self.rows[self.global_index()[self.rank * per:(self.rank + 1) * per]]

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if "position" not in state:
            raise ValueError(f"the checkpoint's data position ({state.get('kind')}) is not "
                             "rows': resume with the data settings it was saved with")
        self.position, self.seed = int(state["position"]), int(state["seed"])
