"""Bad data named before anything is tokenized: each a :class:`Problem`, all at once.

:func:`check_data` runs in the CLI with the configuration's own problems (before any
process starts) and in ``train()`` before any process group. It reads at most the first
row of each file: a source that does not exist or holds nothing, rows without the fields
``data.format`` reads (a chat row whose messages are not a conversation), prepared
shards that are damaged or were prepared for another format, a tokenizer the model
cannot embed or, for chat, one without a chat template.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from paraxis.config.errors import Problem
from paraxis.config.run import DataSection, RunConfig
from paraxis.train.reading import field_names, source_kind
from paraxis.train.sft import messages_problem, template_problem
from paraxis.train.shards import check_shards
from paraxis.train.stream import check_stream
from paraxis.train.tokenize import load_tokenizer

__all__ = ["check_data", "row_problem"]


def check_data(cfg: RunConfig, tokenizer: Any | None = None) -> list[Problem]:
    """What is wrong with the data sections, found without tokenizing anything.
    ``tokenizer``: the loaded one, else loaded here."""
    problems = [*cfg.check_data_modes(), *cfg.data.check_rows()]
    for field, source in [("data.source", cfg.data.source),
                          ("data.eval.source", cfg.data.eval.source)]:
        if source is not None:
            problems += _check_source(field, source, cfg.data)
    try:
        tokenizer = tokenizer or load_tokenizer(cfg.data.tokenizer)
    except OSError as exc:
        return [*problems, Problem("data.tokenizer", cfg.data.tokenizer,
                                   f"cannot be loaded ({exc})", "give a local tokenizer "
                                   "directory, or bytes")]
    vocab, model_vocab = tokenizer.vocab_size, cfg.model.config.get("vocab_size")
    if isinstance(model_vocab, int) and vocab > model_vocab:
        problems.append(Problem(
            "data.tokenizer", cfg.data.tokenizer,
            f"has {vocab} tokens but model.config.vocab_size is {model_vocab}: ids past "
            "the embedding would index out of range", f"set model.config.vocab_size to at "
            f"least {vocab}, or use the model's own tokenizer"))
    why = template_problem(tokenizer) if cfg.data.format == "chat" else None
    if why is not None:
        problems.append(Problem(
            "data.tokenizer", cfg.data.tokenizer, f"{why}: data.format chat renders each "
            "conversation with the tokenizer's own template", "use the model's tokenizer "
            "directory with its chat template, or data.format: prompt_response"))
    return problems


def _setting(cfg: DataSection) -> str:
    return " and ".join(f"data.{name}" for name in {
        "text": ("text_field",), "prompt_response": ("prompt_field", "response_field"),
        "chat": ("messages_field",)}[cfg.format])


def row_problem(row: Any, cfg: DataSection, noun: str = "field") -> str | None:
    """What a row lacks for ``cfg.format`` (``noun``: field or column), or None."""
    if not isinstance(row, Mapping):
        return f"rows are {type(row).__name__}, not objects with fields"
    missing = [name for name in field_names(cfg) if name not in row]
    if missing:
        names = " or ".join(map(repr, missing))
        return (f"rows have no field {names} (the first has: {', '.join(row)})"
                if noun == "field" else f"has no column {names} (columns: {', '.join(row)})")
    if cfg.format == "chat":
        why = messages_problem(row[cfg.messages_field])
        return None if why is None else f"rows' {cfg.messages_field!r} {why}"
    return None


def _check_source(field: str, source: str, cfg: DataSection) -> list[Problem]:
    fix = f"set {_setting(cfg)}"
    if source == "stdlib":
        return [] if not cfg.finetuning else [Problem(
            field, source, f"holds Python sources, not {cfg.format} rows",
            "give JSONL files or a saved dataset of such rows")]
    if cfg.streaming:
        why = check_stream(source, lambda row: row_problem(row, cfg, "column"))
        return [] if why is None else [Problem(field, source, why, "give local parquet, "
                                               "arrow or JSONL files with that column")]
    src = Path(source)
    if not src.exists():
        return [Problem(field, source, "does not exist", "give an existing file or directory")]
    kind = source_kind(src, cfg.source_format)
    if kind == "tokens":
        why = check_shards(src, cfg.tokenizer, rows=cfg.format)
        return [] if why is None else [Problem(field, source, why, "prepare it again with "
                                               "paraxis data prepare")]
    if kind == "hf_disk":
        return _check_saved(field, src, cfg, fix)
    files = sorted(p for p in src.rglob("*") if p.is_file()) if src.is_dir() else [src]
    if not any(p.stat().st_size for p in files):
        return [Problem(field, source, "holds no text (empty)", "give a non-empty source")]
    jsonl = kind == "jsonl" or any(p.suffix == ".jsonl" for p in files)
    if cfg.finetuning and not jsonl:
        return [Problem(field, source, f"holds plain text, not {cfg.format} rows",
                        "give JSONL files or a saved dataset of such rows")]
    for path in files if jsonl else []:
        with path.open(encoding="utf-8") as f:
            line = next((line for line in f if line.strip()), None)
        why = None if line is None else row_problem(json.loads(line), cfg)
        if why is not None:
            return [Problem(field, str(path), why, fix)]
    return []


def _check_saved(field: str, src: Path, cfg: DataSection, fix: str) -> list[Problem]:
    from datasets import load_from_disk  # memory-mapped: nothing is read here

    try:
        ds = load_from_disk(str(src))
    except Exception as exc:  # datasets' own errors (an empty save cannot be opened)
        return [Problem(field, str(src), f"cannot be opened as a saved dataset "
                        f"({type(exc).__name__}: {exc})", "save it again with rows")]
    ds = (ds["train"] if "train" in ds else ds[next(iter(ds.keys()))]) \
        if hasattr(ds, "keys") else ds
    if len(ds) == 0:
        return [Problem(field, str(src), "is an empty dataset", "give one with rows")]
    why = row_problem(ds[0], cfg, "column")
    return [] if why is None else [Problem(field, str(src), why, fix)]
