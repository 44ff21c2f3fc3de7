"""The ``context`` strategy (phase PARTITION): the sequence of every step is split over
the context ranks, and every attention of the model attends over the whole of it.

Written against core's coming contract (``ApplyContext.batch_transforms``, a list of
``Batch -> Batch`` callables applied per step before microbatching; ``Batch`` holds
``input_ids``, ``targets`` already shifted by one, and ``position_ids``). Applying it:

1. selects context-parallel attention for the model through transformers' attention
   interface (:func:`paraxis_seq.hf_attention.use_context_attention`; a model it cannot
   intercept is refused with the reason), and turns the KV cache off;
2. appends :class:`SequenceSplit`, which cuts ids, targets and position ids into this
   rank's zigzag shard, so the model sees true positions (rotary) and the loss each
   rank computes is its part of the global one. Targets were shifted before the cut,
   so no label is lost where the cut falls.

Gradients of dense parameters are then partial per context rank and are summed by the
data strategy over ``data x expert x context`` (core's DENSE_REPLICA_AXES).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch
from torch import nn

from paraxis.strategy import ApplyContext, Phase, Strategy
from paraxis_seq.hf_attention import MODES, use_context_attention
from paraxis_seq.zigzag import shard

__all__ = ["ContextParallelStrategy", "SequenceSplit"]


@dataclasses.dataclass(frozen=True)
class SequenceSplit:
    """Batch transform: this rank's shard of ``input_ids``, ``targets`` and
    ``position_ids`` (made ``0..s-1`` when absent) along the sequence."""

    size: int
    rank: int
    layout: str = "zigzag"

    def __call__(self, batch: Any) -> Any:
        ids = batch.input_ids
        expect = torch.arange(ids.shape[1], device=ids.device).expand(ids.shape[0], -1)
        pos = batch.position_ids
        if pos is None:
            pos = expect
        elif not torch.equal(pos.expand_as(ids), expect):
            raise ValueError(
                "context parallelism got position ids other than 0..s-1 in a row (packed "
                "documents?): the attention kernels mask by global position only, with no "
                "document boundaries; pack without resetting positions, or run without "
                "the context axis")
        cut = dict(size=self.size, rank=self.rank, layout=self.layout)
        return dataclasses.replace(batch, input_ids=shard(ids, **cut),
                                   targets=shard(batch.targets, **cut),
                                   position_ids=shard(pos, **cut))


class ContextParallelStrategy(Strategy):
    """Ring attention (default) or Ulysses over the grid's ``context`` group, zigzag
    sharding. ``mode`` comes from ``config.parallelism.context_mode`` once core has
    that field; until then it is this class attribute."""

    axis = "context"
    phase = Phase.PARTITION
    mode: ClassVar[str] = "ring"
    layout: ClassVar[str] = "zigzag"

    def apply(self, model: nn.Module, ctx: ApplyContext) -> nn.Module:
        group = ctx.grid.group("context")
        mode = getattr(ctx.config.parallelism, "context_mode", self.mode)
        if mode not in MODES:
            raise ValueError(f"parallelism.context_mode must be one of {MODES}, not {mode!r}")
        name = use_context_attention(model, group, mode=mode, layout=self.layout)
        model.config.use_cache = False  # a cache would hold one shard's keys
        ctx.batch_transforms.append(SequenceSplit(group.size, group.rank, self.layout))
        ctx.extras["context"] = {"mode": mode, "layout": self.layout,
                                 "attn_implementation": name}
        return model
