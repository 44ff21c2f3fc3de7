"""Which stream ``paraxis train`` reads, from the data section: one place that chooses
between the in-memory rows, a ``datasets`` stream and unpacked rows, so the loop does not.
"""

from __future__ import annotations

import math
from typing import Any

from paraxis.config.run import RunConfig
from paraxis.train.balance import TokenBalancedStream, padded_rows
from paraxis.train.data import BatchStream, pack, split_held_out
from paraxis.train.stream import StreamBatches

__all__ = ["open_stream"]


def open_stream(cfg: RunConfig, tokenizer: Any, *, rank: int, ranks: int
                ) -> tuple[Any, Any]:
    """(the training stream for sample index ``rank`` of ``ranks``, the held-out rows or
    None). Every stream has ``next_batch``, ``state_dict`` and ``load_state_dict``."""
    data, train = cfg.data, cfg.train
    if data.streaming:
        stream = StreamBatches(data.source, tokenizer=tokenizer, text_field=data.text_field,
                               seq_length=train.seq_length, global_batch=train.global_batch,
                               rank=rank, ranks=ranks, shards=data.stream_shards,
                               shuffle=data.shuffle, seed=train.seed)
        held = None if data.eval.source is None else pack(
            data.model_copy(update={"source": data.eval.source}), train.seq_length, tokenizer)
        return stream, held
    common = dict(global_batch=train.global_batch, rank=rank, ranks=ranks,
                  shuffle=data.shuffle, seed=train.seed)
    if not data.packing:
        rows = padded_rows(data, train.seq_length, tokenizer, _trim_multiple(cfg))
        kind = TokenBalancedStream if data.balance_tokens else BatchStream
        return kind(rows, **common), None
    rows, held = split_held_out(data, train.seq_length, tokenizer)
    return BatchStream(rows, **common), held


def _trim_multiple(cfg: RunConfig) -> int | None:
    """What a rank's unpacked rows may be cut to a multiple of: one that tensor (sequence
    parallel) and context (two chunks a rank) still split; None under a pipeline, whose
    stages exchange activations of the configured length."""
    d = cfg.degrees
    if d["pipeline"] > 1:
        return None
    return math.lcm(8, d["tensor"], 2 * d["context"])
