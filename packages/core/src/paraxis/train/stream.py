"""A ``datasets`` stream as packed rows, each sample-splitting rank reading its own part.

``data.streaming: true`` reads local parquet, arrow or JSONL files through
``datasets.load_dataset(..., streaming=True)``: nothing is loaded ahead, a rank holds the
chunk ``datasets`` is reading and the row it is packing, so its memory does not grow
with the corpus (the in-memory path tokenizes everything on every rank).

The stream is cut into ``S`` *stream shards* with ``split_dataset_by_node(ds, s, S)``
(whole files when ``S`` divides their number, else every ``S``-th document). Shard ``s``
is tokenized and packed on its own (documents joined by the separator, cut into rows),
and global batch ``b`` is ``global_batch / S`` rows of shard 0, then of shard 1, and so
on. ``S`` is fixed for the life of a run (``data.stream_shards``, by default data x
expert at the start) and the rank with sample index ``r`` of ``R`` reads shards
``[r S/R, (r+1) S/R)``: its share is the same contiguous slice of each global batch
that :class:`paraxis.train.data.BatchStream` serves, and no two ranks read one shard.

Exact resume: a shard's position is the ``datasets`` state before the document it is
in the middle of, plus how many of that document's tokens were already served. The
checkpoint holds every shard's position (gathered from the ranks that read them), so a
resume on any ``R'`` dividing ``S`` continues at the same global batches; any other
``R'`` is refused, saying why. ``data.shuffle`` shuffles the order of the files, each
epoch anew: a shuffle buffer would be lost on resume (``datasets`` says so), and the
resume would not be exact.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Mapping
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from paraxis.train.shards import is_prepared

__all__ = ["StreamBatches", "check_stream", "open_stream_shard", "stream_files",
           "stream_records"]

# suffix -> the datasets builder that reads it; .json only when nothing else is there
# (a save_to_disk directory holds .arrow data beside .json metadata).
BUILDERS = {".parquet": "parquet", ".arrow": "arrow", ".jsonl": "json", ".json": "json"}


def stream_files(source: str) -> tuple[str, list[str]]:
    """(builder, files) of a local file or directory: its files of one builder, sorted.
    Raises ValueError naming what is wrong."""
    src = Path(source)
    if not src.exists():
        raise ValueError("does not exist")
    if is_prepared(src):
        raise ValueError("was written by paraxis data prepare: its tokens are memory-mapped "
                         "already, set data.streaming: false")
    files = sorted(p for p in src.rglob("*") if p.is_file()) if src.is_dir() else [src]
    found = {p.suffix for p in files} & BUILDERS.keys()
    if found - {".json"}:
        found -= {".json"}
    builders = {BUILDERS[s] for s in found}
    if len(builders) != 1:
        why = "mixes " + ", ".join(sorted(found)) if builders else "has no .parquet, " \
            ".arrow, .jsonl or .json file"
        raise ValueError(why)
    files = [p for p in files if p.suffix in found]
    if not any(p.stat().st_size for p in files):
        raise ValueError("holds only empty files")
    return builders.pop(), [str(p) for p in files]


def open_stream_shard(source: str, *, shard: int = 0, shards: int = 1,
                      order_seed: int | None = None) -> Any:
    """The streaming dataset of ``source`` (files in order, or shuffled by
    ``order_seed``), split to its ``shard``-th of ``shards``."""
    from datasets import load_dataset  # only when asked for
    from datasets.distributed import split_dataset_by_node

    builder, files = stream_files(source)
    if order_seed is not None:
        random.Random(order_seed).shuffle(files)
    # JSON is read in blocks of ``chunksize`` bytes, parsed into a table about twice
    # that: 1 MB keeps a rank's reading a few MB (datasets' default is 10 MB).
    extra = {"chunksize": 1 << 20} if builder == "json" else {}
    ds = load_dataset(builder, data_files=files, split="train", streaming=True, **extra)
    return split_dataset_by_node(ds, rank=shard, world_size=shards) if shards > 1 else ds


def check_stream(source: str, row_problem: Callable[[Mapping[str, Any]], str | None]
                 ) -> str | None:
    """What is wrong with a streaming source, or None; reads its first row only, which
    ``row_problem`` judges (the fields the format reads)."""
    try:
        stream_files(source)
        first = next(iter(open_stream_shard(source)), None)
    except ValueError as exc:
        return str(exc)
    except Exception as exc:  # datasets' and pyarrow's own errors on a damaged file
        return f"cannot be streamed ({type(exc).__name__}: {exc})"
    if first is None:
        return "holds no rows"
    return row_problem(first)


def stream_records(source: str) -> Iterator[Mapping[str, Any]]:
    """Every row of a streaming source, in order (for an eval source, or prepare)."""
    yield from open_stream_shard(source)


class _ShardPacker:
    """Rows of one stream shard: documents tokenized, joined by the separator, cut.

    Between calls the unserved tail is always a suffix of the last document read (a row
    is cut as soon as the tail reaches ``seq_length``), so the position is the
    ``datasets`` state before that document and how many of its tokens were served."""

    def __init__(self, source: str, shard: int, shards: int, *, tokenizer: Any,
                 text_field: str, seq_length: int, shuffle_seed: int | None):
        self.source, self.shard, self.shards = source, shard, shards
        self.tokenizer, self.text_field, self.seq = tokenizer, text_field, seq_length
        self.shuffle_seed = shuffle_seed
        self._start(epoch=0)

    def _start(self, epoch: int, resume: dict[str, Any] | None = None) -> None:
        seed = None if self.shuffle_seed is None else self.shuffle_seed + epoch
        self.ds = open_stream_shard(self.source, shard=self.shard, shards=self.shards,
                                    order_seed=seed)
        if resume is not None:
            self.ds.load_state_dict(resume)
        self.epoch, self.docs = epoch, iter(self.ds)
        self.before, self.length = self.ds.state_dict(), 0  # the last document read
        self.tail, self.cut = torch.empty(0, dtype=torch.long), 0  # rows cut this epoch

    def _read(self, skip: int = 0) -> bool:
        """Append the next document and its separator, less ``skip`` tokens, to the
        tail; False at the end of the epoch."""
        before = self.ds.state_dict()
        row = next(self.docs, None)
        if row is None:
            return False
        sep = torch.tensor([self.tokenizer.separator], dtype=torch.long)
        tokens = torch.cat([self.tokenizer.encode(str(row[self.text_field])), sep])
        self.before, self.length = before, len(tokens)
        self.tail = torch.cat([self.tail, tokens[skip:]])
        return True

    def rows(self, n: int) -> torch.Tensor:
        """The next ``n`` rows of this shard; at its end a new epoch starts (the partial
        row left there is dropped)."""
        out = []
        while len(out) < n:
            while len(self.tail) < self.seq:
                if not self._read():
                    if not self.cut:
                        raise ValueError(f"stream shard {self.shard} of {self.shards} of "
                                         f"{self.source!r} holds fewer tokens than one row "
                                         f"of {self.seq}")
                    self._start(self.epoch + 1)
            out.append(self.tail[: self.seq])
            self.tail, self.cut = self.tail[self.seq:], self.cut + 1
        return torch.stack(out)

    def state(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "dataset": self.before, "cut": self.cut,
                "served": self.length - len(self.tail)}

    def load(self, state: dict[str, Any]) -> None:
        """Continue where ``state`` was taken: reopen at the document it was in, and
        drop what had been served of it."""
        self._start(int(state["epoch"]), state["dataset"])
        self.cut = int(state["cut"])
        if self.cut:  # nothing was read yet when no row was cut
            self._read(skip=int(state["served"]))


class StreamBatches:
    """Global batches from ``S`` stream shards; this rank reads its shards only.

    The interface of :class:`paraxis.train.data.BatchStream` (``next_batch``,
    ``state_dict``, ``load_state_dict``), plus :meth:`gathered_state`, which a
    checkpoint needs because each rank knows only its own shards' positions."""

    def __init__(self, source: str, *, tokenizer: Any, text_field: str = "text",
                 seq_length: int, global_batch: int, rank: int, ranks: int,
                 shards: int | None = None, shuffle: bool = False, seed: int = 0,
                 packer: Callable[..., Any] | None = None):
        """``packer(source, shard, shards, seq_length=, shuffle_seed=)`` makes a shard's
        packer (``rows``, ``state``, ``load``); by default documents of ``text_field``
        joined by the tokenizer's separator and cut (fine-tuning examples:
        :class:`paraxis.train.stream_examples.ExamplePacker`)."""
        self.rank, self.ranks, self.global_batch, self.batches = rank, ranks, global_batch, 0
        self._packer = packer or partial(_ShardPacker, tokenizer=tokenizer,
                                         text_field=text_field)
        self._options = dict(source=source, seq_length=seq_length,
                             shuffle_seed=seed if shuffle else None)
        self._cut(shards or ranks)

    def _cut(self, shards: int) -> None:
        """Open this rank's shards of ``shards``, refusing a count its ranks cannot share."""
        if shards % self.ranks or self.global_batch % shards:
            raise ValueError(
                f"the stream is cut into {shards} shards (data.stream_shards, or data x "
                f"expert when the run began), which {self.ranks} sample-splitting ranks "
                f"cannot share equally with global batch {self.global_batch}: a shard's "
                f"position holds its own packed tail, so regrouping its documents would "
                f"not continue at the same samples. Resume with data x expert dividing "
                f"{shards}")
        self.shards, self.per_shard = shards, self.global_batch // shards
        mine = shards // self.ranks
        self.packers = {s: self._packer(shard=s, shards=shards, **self._options)
                        for s in range(self.rank * mine, (self.rank + 1) * mine)}

    def next_batch(self) -> Any:
        """This rank's share of the next global batch: (global_batch / ranks, seq), a
        tensor or (fine-tuning examples) a mapping of them."""
        self.batches += 1
        parts = [p.rows(self.per_shard) for p in self.packers.values()]
        if isinstance(parts[0], Mapping):
            return {key: torch.cat([part[key] for part in parts]) for key in parts[0]}
        return torch.cat(parts)

    def state_dict(self) -> dict[str, Any]:
        """This rank's shards' positions (:meth:`gathered_state` adds the others')."""
        return {"kind": "stream", "shards": self.shards, "batches": self.batches,
                "positions": {str(s): p.state() for s, p in self.packers.items()}}

    def gathered_state(self) -> dict[str, Any]:
        """Every shard's position: a collective over the world when there is one (ranks
        that share samples hold the same positions)."""
        state = self.state_dict()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            every: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(every, state["positions"])
            state["positions"] = {k: v for part in every for k, v in part.items()}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind") != "stream":
            raise ValueError("the checkpoint's data position is not a stream's: resume "
                             "with the data settings it was saved with")
        if int(state["shards"]) != self.shards:
            self._cut(int(state["shards"]))
        missing = [s for s in self.packers if str(s) not in state["positions"]]
        if missing:
            raise ValueError(f"the checkpoint holds no position for stream shards {missing}")
        for s, packer in self.packers.items():
            packer.load(state["positions"][str(s)])
        self.batches = int(state["batches"])
