"""Packed fixed-length token sequences, each sample-splitting rank reading its own slice.

Documents come from local text or JSONL files, a ``datasets`` dataset saved to disk, or
by default the running interpreter's standard-library sources (:mod:`paraxis.train.
reading`). They are tokenized (bytes by default, or a local Hugging Face tokenizer:
:mod:`paraxis.train.tokenize`), joined with a separator token and cut into rows of
``seq_length`` tokens (fine-tuning rows are packed whole instead:
:mod:`paraxis.train.example_rows`). :class:`BatchStream` serves global batch after
global batch in a seeded order and keeps its position (samples consumed) so a resumed
run continues with the next sample.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from paraxis.config.run import DataSection
from paraxis.train.checks import check_data
from paraxis.train.order import permute
from paraxis.train.reading import iter_documents, source_kind
from paraxis.train.shards import TokenRows, token_rows
from paraxis.train.tokenize import ByteTokenizer, load_tokenizer

__all__ = ["BatchStream", "ByteTokenizer", "check_data", "document_positions",
           "iter_documents", "load_tokenizer", "pack", "prepack", "split_held_out"]


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
    if cfg.finetuning:
        raise ValueError(f"data.format {cfg.format} rows are packed whole with their "
                         "labels: paraxis.train.example_rows.pack_examples")
    if cfg.source != "stdlib" and source_kind(Path(cfg.source), cfg.source_format) == "tokens":
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


def split_held_out(cfg: DataSection, seq_length: int, tokenizer: Any,
                   packer: Callable[[DataSection, int, Any], Any] = pack) -> tuple[Any, Any]:
    """The training rows and the held-out rows of ``cfg.eval`` (None when it names
    none): the last ``fraction`` of the rows ``packer`` makes (:func:`pack`, or
    :func:`paraxis.train.example_rows.pack_examples`), cut off before any training order
    is drawn, or the rows of its own ``source``."""
    rows = packer(cfg, seq_length, tokenizer)
    if cfg.eval.source:
        return rows, packer(cfg.model_copy(update={"source": cfg.eval.source}), seq_length,
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
