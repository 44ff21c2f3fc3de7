"""Which stream ``paraxis train`` reads, from the data section: one place that chooses
between the in-memory rows, a ``datasets`` stream and unpacked rows, for documents or
fine-tuning examples, so the loop does not.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

from paraxis.config.run import DataSection, RunConfig
from paraxis.train.balance import TokenBalancedStream, padded_rows
from paraxis.train.data import BatchStream, pack, split_held_out
from paraxis.train.example_rows import pack_examples, padded_examples
from paraxis.train.reading import iter_examples
from paraxis.train.sft import example_encoder
from paraxis.train.stream import StreamBatches
from paraxis.train.stream_examples import ExamplePacker

__all__ = ["open_stream", "rows_of"]


def rows_of(data: DataSection) -> Any:
    """The packer of ``data``'s rows: :func:`pack` for text, whole examples otherwise."""
    return pack_examples if data.finetuning else pack


def open_stream(cfg: RunConfig, tokenizer: Any, *, rank: int, ranks: int
                ) -> tuple[Any, Any]:
    """(the training stream for sample index ``rank`` of ``ranks``, the held-out rows or
    None). Every stream has ``next_batch``, ``state_dict`` and ``load_state_dict``."""
    data, train = cfg.data, cfg.train
    if data.streaming:
        packer = None if not data.finetuning else partial(
            ExamplePacker, encode=example_encoder(data, tokenizer), pad=tokenizer.separator,
            answers_only=data.answers_only)
        stream = StreamBatches(data.source, tokenizer=tokenizer, text_field=data.text_field,
                               seq_length=train.seq_length, global_batch=train.global_batch,
                               rank=rank, ranks=ranks, shards=data.stream_shards,
                               shuffle=data.shuffle, seed=train.seed, packer=packer)
        held = None if data.eval.source is None else rows_of(data)(
            data.model_copy(update={"source": data.eval.source}), train.seq_length, tokenizer)
        return stream, held
    common = dict(global_batch=train.global_batch, rank=rank, ranks=ranks,
                  shuffle=data.shuffle, seed=train.seed)
    if not data.packing:
        rows = unpacked_rows(data, train.seq_length, tokenizer, _trim_multiple(cfg))
        kind = TokenBalancedStream if data.balance_tokens else BatchStream
        return kind(rows, **common), None
    rows, held = split_held_out(data, train.seq_length, tokenizer, rows_of(data))
    return BatchStream(rows, **common), held


def unpacked_rows(data: DataSection, seq_length: int, tokenizer: Any,
                  multiple: int | None) -> Any:
    """One document or example per row, right-padded (``packing: false``)."""
    if not data.finetuning:
        return padded_rows(data, seq_length, tokenizer, multiple)
    encode = example_encoder(data, tokenizer)
    return padded_examples(map(encode, iter_examples(data)), seq_length,
                           answers_only=data.answers_only, multiple=multiple)


def _trim_multiple(cfg: RunConfig) -> int | None:
    """What a rank's unpacked rows may be cut to a multiple of: one that tensor (sequence
    parallel) and context (two chunks a rank) still split; None under a pipeline, whose
    stages exchange activations of the configured length."""
    d = cfg.degrees
    if d["pipeline"] > 1:
        return None
    return math.lcm(8, d["tensor"], 2 * d["context"])
