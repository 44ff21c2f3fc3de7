"""The ``context`` strategy (phase PARTITION): the sequence of every step is split over
the context ranks, and every attention of the model attends over the whole of it.

Core's contracts (docs/architecture.md section 4): :class:`paraxis.parallel.batch.Batch` holds
``input_ids``, ``targets`` already shifted once and ``position_ids``;
``ctx.batch_transforms`` run per step before microbatching; the engine counts tokens
after them and passes ``position_ids`` to the model (and the pipeline runner to every
stage). Applying the strategy:

1. selects context-parallel attention for the model (each pipeline chunk) through
   transformers' attention interface (:func:`paraxis_seq.hf_attention.use_context_attention`;
   a model it cannot intercept was refused before any process group, see
   :mod:`paraxis_seq.rules`), and turns the KV cache off;
2. appends :class:`SequenceSplit`, which cuts ids, targets and position ids into this
   rank's shard (zigzag for ring attention, contiguous for Ulysses; see
   :mod:`paraxis_seq.rules`), so the model sees true positions (rotary) and the loss each rank
   sums is its part of the global one. Targets were shifted before the cut, so no label
   is lost where the cut falls. Padding and packed documents travel as per-token
   document ids (``paraxis_doc_ids``, pads -1) that the kernels mask with; causality
   comes from the layout's global token order, never from the positions (which restart
   at each document).

Composition: the engine sums each rank's loss over its local tokens and divides by the
global token count (all-reduced over ``data x expert x context``), and the data
strategy averages dense gradients over the same group (the grid's token axes,
``grid.axes.token_axes``), times the replica count: exactly the one-process token
mean. Heads are split by tensor first: the tensor axis shards the q/k/v projections
(both axes apply in PARTITION: context first, then tensor), so the attention function
receives this tensor rank's heads and Ulysses splits those again over context; under
sequence parallelism the tensor axis cuts this rank's shard again and gathers it back
at each block's input, so attention sees the whole shard. A pipeline stage
receives ``(b, s/C / activation_sequence_shards, h)`` hidden states: the runner takes
the sequence length after this transform.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from paraxis.config.errors import Problem
from paraxis.config.parallel import ParallelConfig
from paraxis.parallel.anatomy import Anatomy
from paraxis.parallel.batch import Batch, document_ids
from paraxis.parallel.stages import chunks_of
from paraxis.parallel.strategy import ApplyContext, Phase, Strategy
from paraxis_seq.hf_attention import use_context_attention
from paraxis_seq.recurrent import use_state_passing
from paraxis_seq.rules import LAYOUT_OF_MODE
from paraxis_seq.zigzag import check_layout, shard

__all__ = ["ContextParallelStrategy", "DocumentState", "SequenceSplit"]

@dataclasses.dataclass
class DocumentState:
    """Shared by :class:`SequenceSplit` and the attention function of one application:
    whether this step's batch carries document ids, so a model that did not forward
    them to its attention (a family that drops extra keywords) is refused instead of
    attending across documents."""

    expected: bool = False


@dataclasses.dataclass(frozen=True)
class SequenceSplit:
    """Batch transform: this rank's shard of ``input_ids``, ``targets`` and
    ``position_ids`` (made ``0..s-1`` when absent) along the sequence. Padding and packed
    documents become per-token document ids (pads -1), cut the same way, which the
    attention kernels mask with (a whole-sequence mask cannot follow the shards)."""

    size: int
    rank: int
    layout: str = "zigzag"
    documents: DocumentState = dataclasses.field(default_factory=DocumentState)
    # The model's own rule for the positions it makes when given none (whole ids in,
    # (b, s) out); None: 0..s-1.
    positions: Callable[[torch.Tensor], torch.Tensor] | None = None

    def __call__(self, batch: Batch) -> Batch:
        ids = batch.input_ids
        check_layout(ids.shape[1], self.size, self.layout)
        pos = batch.position_ids
        if pos is None and self.positions is not None:
            pos = self.positions(ids)
        if pos is None:
            pos = torch.arange(ids.shape[1], device=ids.device).expand(ids.shape[0], -1)
        docs = None
        if batch.packed or batch.padding_mask is not None:
            docs = (document_ids(pos.expand_as(ids), batch.padding_mask) if batch.packed else
                    torch.zeros_like(ids).masked_fill(~batch.padding_mask.bool(), -1))
        self.documents.expected = docs is not None
        cut = dict(size=self.size, rank=self.rank, layout=self.layout)
        return dataclasses.replace(
            batch, input_ids=shard(ids, **cut), targets=shard(batch.targets, **cut),
            position_ids=shard(pos, **cut), padding_mask=None,
            document_ids=None if docs is None else shard(docs, **cut))


class ContextParallelStrategy(Strategy):
    """Ring attention (``parallelism.context_mode: ring``, the default; zigzag shards)
    or Ulysses (``ulysses``; contiguous shards) over the grid's ``context`` group."""

    axis = "context"
    phase = Phase.PARTITION
    order = 10  # first in its phase: it selects the attention kernel, rewrites nothing

    @classmethod
    def check_model(cls, model: nn.Module, config: ParallelConfig, plan: object | None,
                    anatomy: Anatomy) -> list[Problem]:
        """Attention paraxis cannot intercept (named), or an attention implementation it
        would silently replace (:func:`paraxis_seq.rules.check_module`)."""
        from paraxis_seq.rules import check_module

        return check_module(config, model, anatomy)

    def apply(self, model: nn.Module, ctx: ApplyContext) -> nn.Module:
        group = ctx.grid.group("context")
        mode = ctx.config.parallelism.context_mode
        layout = LAYOUT_OF_MODE[mode]
        names: list[str] = []
        passed: list[str] = []  # recurrent mixers passing their state (issue 35)
        documents = DocumentState()
        for chunk in chunks_of(model):  # each pipeline chunk is a model of its own
            names.append(use_context_attention(chunk, group, anatomy=ctx.anatomy, mode=mode,
                                               layout=layout, documents=documents))
            passed += use_state_passing(chunk, group, anatomy=ctx.anatomy, layout=layout,
                                        documents=documents,
                                        pipelined=ctx.config.parallelism.pipeline > 1)
            chunk.config.use_cache = False  # a cache would hold one shard's keys
        ctx.batch_transforms.append(SequenceSplit(group.size, group.rank, layout, documents,
                                                  own_positions(model)))
        if passed:  # issue 35: every mixer of such a model masks or resets at documents
            ctx.documents_kept = ("context parallel: attention masks by document ids, "
                                  f"{len(passed)} recurrent layers reset their state")
        ctx.extras["context"] = _Applied(mode, layout, names[0], group, tuple(passed))
        return model


def own_positions(model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The positions a model makes from its token ids when given none, where they are
    not 0..s-1: the RoBERTa family counts from ``padding_idx + 1`` and skips pads
    (``create_position_ids_from_input_ids``). A rank holding a shard of the sequence
    would count from its shard's start, so the split computes them on the whole row
    with the model's own function and cuts them like the ids."""
    for module in model.modules():
        make = getattr(module, "create_position_ids_from_input_ids", None)
        pad = getattr(module, "padding_idx", None)
        if callable(make) and isinstance(pad, int):
            return functools.partial(make, padding_idx=pad)
    return None


@dataclasses.dataclass(frozen=True)
class _Applied:
    """What the strategy did, for tests, benchmarks and metrics (``ctx.extras``)."""

    mode: str
    layout: str
    attn_implementation: str
    group: Any
    recurrent: tuple[str, ...] = ()  # mixers passing their state across ranks
