"""Fine-tuning examples in rows: packed whole, or one per right-padded row.

Packing (``data.packing: true``) fills each row of ``seq_length`` with whole examples in
order: an example that does not fit in what is left of the row starts the next row, and
the rest of the row is padding (torchtune's ``PackedDataset`` without
``split_across_pack``; TRL's packing never splits an example either). Cutting one where
the row ends, as text packing does, would train its second half's answers without their
prompt. An example longer than a row is cut to it, its end lost (TRL's ``max_length``).

Each row is a mapping for :meth:`paraxis.parallel.batch.Batch.from_user`: ``input_ids``;
``position_ids`` restarting at 0 at each example and at the padding, so the model keeps
examples apart and no target crosses from one into the next (DESIGN 10, "Loss masks are
data"); ``labels``, the ids where a token scores (its answer, or with ``loss_on: all``
every token of an example) and -100 elsewhere. The engine divides the summed loss by the
global count of scoring targets: the loss is the mean over the answers of the batch.

:class:`ExampleRows` plans the rows from the examples' lengths (:func:`row_plan`) and
cuts a row when asked for it, over tensors in memory or over the memory-mapped files of
``paraxis data prepare`` (``tokens.bin``, ``loss_mask.bin``, ``documents.npy``); a stream
shard applies the same rule as it reads (:mod:`paraxis.train.stream_examples`), so the
three give the same rows.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from paraxis.config.run import DataSection
from paraxis.parallel.batch import IGNORE_INDEX
from paraxis.train.balance import PaddedRows
from paraxis.train.reading import iter_examples, source_kind
from paraxis.train.sft import Example, example_encoder
from paraxis.train.shards import prepared_examples

__all__ = ["ExampleRows", "pack_examples", "padded_examples", "row_of", "row_plan"]


def row_plan(lengths: np.ndarray, seq_length: int) -> np.ndarray:
    """The first example of each row and, last, the number of examples: row r holds
    examples ``plan[r]:plan[r + 1]``, whole, in order, at most ``seq_length`` tokens
    (an example longer than that alone, cut)."""
    plan, used = [0], 0
    for i, n in enumerate(lengths.tolist()):
        n = min(n, seq_length)
        if used and used + n > seq_length:
            plan.append(i)
            used = 0
        used += n
    if used:
        plan.append(len(lengths))
    return np.asarray(plan, dtype=np.int64)


def row_of(pieces: Iterable[tuple[torch.Tensor, torch.Tensor]], seq_length: int, *,
           pad: int, answers_only: bool) -> dict[str, torch.Tensor]:
    """One row from examples' (ids, answer) that fit in it, padded to ``seq_length``."""
    ids, labels, positions, used = [], [], [], 0
    for piece_ids, answer in pieces:
        piece_ids, answer = piece_ids[: seq_length - used], answer[: seq_length - used]
        scored = answer if answers_only else torch.ones_like(answer)
        ids.append(piece_ids)
        labels.append(piece_ids.masked_fill(~scored, IGNORE_INDEX))
        positions.append(torch.arange(len(piece_ids)))
        used += len(piece_ids)
    rest = seq_length - used
    ids.append(torch.full((rest,), pad, dtype=torch.long))
    labels.append(torch.full((rest,), IGNORE_INDEX, dtype=torch.long))
    positions.append(torch.arange(rest))
    return {"input_ids": torch.cat(ids), "labels": torch.cat(labels),
            "position_ids": torch.cat(positions)}


def stack_rows(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {key: torch.stack([row[key] for row in rows]) for key in rows[0]}


class ExampleRows:
    """Packed rows over examples laid end to end: ``tokens`` and ``answer`` (flat, a
    tensor or a memory map), ``ends`` each example's end offset. ``rows[index]`` (a
    tensor of row numbers) cuts those rows only; a slice is another ExampleRows over
    part of the plan (held-out rows)."""

    def __init__(self, tokens: Any, answer: Any, ends: np.ndarray, seq_length: int, *,
                 pad: int, answers_only: bool, plan: np.ndarray | None = None):
        self.tokens, self.answer, self.ends = tokens, answer, np.asarray(ends)
        self.seq, self.pad, self.answers_only = seq_length, pad, answers_only
        self.starts = np.concatenate([[0], self.ends[:-1]]).astype(np.int64)
        self.plan = row_plan(self.ends - self.starts, seq_length) if plan is None else plan

    def __len__(self) -> int:
        return len(self.plan) - 1

    def _piece(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        start, end = int(self.starts[e]), int(self.ends[e])
        ids, answer = self.tokens[start:end], self.answer[start:end]
        if isinstance(ids, np.ndarray):  # a memory map: read this example's pages
            ids = torch.from_numpy(ids.astype(np.int64))
            answer = torch.from_numpy(answer.astype(np.bool_))
        return ids, answer

    def row(self, r: int) -> dict[str, torch.Tensor]:
        examples = range(int(self.plan[r]), int(self.plan[r + 1]))
        return row_of(map(self._piece, examples), self.seq, pad=self.pad,
                      answers_only=self.answers_only)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                raise ValueError("rows are sliced contiguously (step 1)")
            return ExampleRows(self.tokens, self.answer, self.ends, self.seq, pad=self.pad,
                               answers_only=self.answers_only,
                               plan=self.plan[start:max(start, stop) + 1])
        picked = index.tolist() if isinstance(index, torch.Tensor) else list(index)
        return stack_rows([self.row(int(r)) for r in picked])

    @classmethod
    def from_examples(cls, examples: Iterable[Example], seq_length: int, *, pad: int,
                      answers_only: bool) -> ExampleRows:
        examples = [e for e in examples if len(e.ids)]
        if not examples:
            raise ValueError("the fine-tuning source holds no example")
        ends = np.cumsum([len(e.ids) for e in examples])
        return cls(torch.cat([e.ids for e in examples]),
                   torch.cat([e.answer for e in examples]), ends, seq_length, pad=pad,
                   answers_only=answers_only)


def padded_examples(examples: Iterable[Example], seq_length: int, *, answers_only: bool,
                    multiple: int | None = None) -> PaddedRows:
    """One example per row, cut at ``seq_length``, right-padded with 0 (``packing:
    false``); examples of fewer than two tokens (nothing to predict) are left out."""
    kept = [e for e in examples if len(e.ids) > 1]
    if not kept:
        raise ValueError("the fine-tuning source holds no example of two tokens")
    both = stack_rows([row_of([(e.ids, e.answer)], seq_length, pad=0,
                              answers_only=answers_only) for e in kept])
    lengths = torch.tensor([min(len(e.ids), seq_length) for e in kept])
    return PaddedRows(both["input_ids"], lengths, multiple, both["labels"])


def pack_examples(cfg: DataSection, seq_length: int, tokenizer: Any) -> ExampleRows:
    """The rows of a fine-tuning source: its examples encoded and packed whole, or, for a
    directory ``paraxis data prepare`` wrote, its memory-mapped files planned."""
    src = Path(cfg.source)
    if cfg.source != "stdlib" and source_kind(src, cfg.source_format) == "tokens":
        tokens, answer, ends, meta = prepared_examples(src)
        return ExampleRows(tokens, answer, ends, seq_length, pad=int(meta["separator"]),
                           answers_only=cfg.answers_only)
    encode = example_encoder(cfg, tokenizer)
    return ExampleRows.from_examples(map(encode, iter_examples(cfg)), seq_length,
                                     pad=tokenizer.separator, answers_only=cfg.answers_only)
