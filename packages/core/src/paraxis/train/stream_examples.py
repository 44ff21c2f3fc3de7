"""A stream shard of fine-tuning rows packed whole, as it reads (``data.streaming`` with
``format: prompt_response | chat``).

The rule is :func:`paraxis.train.example_rows.row_plan`'s, applied one example at a time:
an example joins the row being filled when it fits, else the row is closed (padded) and
the example starts the next; at the end of an epoch the last row is closed too. So a
shard's rows are the rows :class:`~paraxis.train.example_rows.ExampleRows` plans from
the same examples in memory or from prepared shards.

The unserved part is always whole examples (those of the row being filled), so a
shard's position is the ``datasets`` state before the first of them: a resume reopens
there and reads them again (where the text packer keeps the state before one document
and how many of its tokens were served, :mod:`paraxis.train.stream`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from paraxis.train.example_rows import row_of, stack_rows
from paraxis.train.sft import Example
from paraxis.train.stream import open_stream_shard

__all__ = ["ExamplePacker"]


class ExamplePacker:
    """Rows of one stream shard of fine-tuning rows (the packer interface of
    :class:`paraxis.train.stream.StreamBatches`: ``rows``, ``state``, ``load``)."""

    def __init__(self, source: str, shard: int, shards: int, *,
                 encode: Callable[[Mapping[str, Any]], Example], seq_length: int,
                 shuffle_seed: int | None, pad: int, answers_only: bool):
        self.source, self.shard, self.shards = source, shard, shards
        self.encode, self.seq, self.shuffle_seed = encode, seq_length, shuffle_seed
        self.pad, self.answers_only = pad, answers_only
        self._start(epoch=0)

    def _start(self, epoch: int, resume: dict[str, Any] | None = None) -> None:
        seed = None if self.shuffle_seed is None else self.shuffle_seed + epoch
        self.ds = open_stream_shard(self.source, shard=self.shard, shards=self.shards,
                                    order_seed=seed)
        if resume is not None:
            self.ds.load_state_dict(resume)
        self.epoch, self.examples = epoch, iter(self.ds)
        self.filling: list[Example] = []  # whole examples of the row being filled
        self.first = self.ds.state_dict()  # the state before the first of them
        self.used, self.cut, self.ended = 0, 0, False

    def _close(self) -> dict[str, torch.Tensor]:
        row = row_of(self.filling, self.seq, pad=self.pad, answers_only=self.answers_only)
        self.filling, self.used, self.cut = [], 0, self.cut + 1
        return row

    def _row(self) -> dict[str, torch.Tensor]:
        """The next row; at the end of the epoch its last row, then a new epoch."""
        while True:
            if self.ended:
                if not self.cut:
                    raise ValueError(f"stream shard {self.shard} of {self.shards} of "
                                     f"{self.source!r} holds no example")
                self._start(self.epoch + 1)
            before = self.ds.state_dict()
            record = next(self.examples, None)
            if record is None:
                self.ended = True
                if self.filling:
                    return self._close()
                continue
            example = self.encode(record)
            length = min(len(example.ids), self.seq)
            closed = self._close() if self.filling and self.used + length > self.seq \
                else None
            if not self.filling:
                self.first = before
            if length:
                self.filling.append(example)
                self.used += length
            if closed is not None:
                return closed

    def rows(self, n: int) -> dict[str, torch.Tensor]:
        return stack_rows([self._row() for _ in range(n)])

    def state(self) -> dict[str, Any]:
        # Nothing waits to be served after a closed last row: the next read ends the
        # epoch (the state holds ``ended`` so a resume does not serve that row again).
        return {"epoch": self.epoch, "dataset": self.first if self.filling else
                self.ds.state_dict(), "cut": self.cut, "ended": self.ended}

    def load(self, state: dict[str, Any]) -> None:
        """Continue where ``state`` was taken: reopen before the examples of the row
        being filled; they are read again."""
        self._start(int(state["epoch"]), state["dataset"])
        self.cut, self.ended = int(state["cut"]), bool(state.get("ended", False))
