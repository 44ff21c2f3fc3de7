"""Apply a model's tensor-parallel plan: shard modules in place, mark region entries, and
(with sequence parallelism) shard the residual stream along the sequence.

Styles follow transformers' tensor-parallel plans:

| style                     | paraxis                                                  |
| ------------------------- | -------------------------------------------------------- |
| ``colwise``               | column parallel, output stays split                      |
| ``packed_colwise``        | same, each of the 2 packed blocks (gate, up) split       |
| ``colwise_gather_output`` | column parallel gathering its output; on the output      |
|                           | embedding the logits stay split for vocab-parallel loss  |
| ``rowwise``               | row parallel, input already split                        |
| ``rowwise_split_input``   | row parallel that splits its (full) input first          |
| ``embedding_rowwise``     | vocab parallel embedding                                 |
| ``replicated_with_grad_allreduce`` | kept whole; gradients summed over the group     |
| ``replicate``, ``local_params``    | kept whole (``local_params``: its parameters    |
|                           | have entries of their own, e.g. attention sinks)         |
| ``moe_tp_experts``, ``all_reduce`` | a region around split parameters              |
| ``moe_identity_expert``, ``mla_kv_a_proj`` | see :mod:`paraxis_tp.regions`         |

A plan entry naming a *parameter* (3-D expert weights, per-head sinks) shards that
parameter (:data:`paraxis_tp.regions.PARAM_STYLES`); its module keeps its forward.
A plan entry naming a LoRA layer (the anatomy's ``adapters``) splits its base layer and
the adapter's matching side with it (:mod:`paraxis_tp.adapters`).

Any ``nn.Linear`` / ``nn.Embedding``, subclasses included, is sharded in place: its own
forward still runs (see :mod:`paraxis_tp.layers`). Modules a pipeline stage does not own
(:class:`paraxis.parallel.standins.Absent`) are left alone.

Region entries. Without sequence parallelism each column-parallel module enters the
region itself (Megatron's f), but sibling projections fed the *same* tensor (q, k and v;
gate and up) share one entry, so backward all-reduces their input gradient once, as
Megatron's fused QKV does; a residual branch of the same tensor is never touched. Under
sequence parallelism the entry is an all-gather along the sequence, and it happens at
the input of the block that holds the projections (an attention or MLP module), because
transformers' attention reshapes q, k, v with its *input*'s sequence length; such
blocks must not add a residual inside (a block that does fails with a shape error, and
the parity probe at ``parallelize`` catches anything subtler).

Sequence parallelism departs from Megatron in one place, on purpose: the embedding
all-reduces (rather than reduce-scatters) and the sequence is split at each stage's first
layer. transformers builds the causal mask and rotary positions from the embedding
output's (or ``inputs_embeds``') length, so that must stay whole; a pipeline stage after
the first receives its activations split and gathers them at its input.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch import nn

from paraxis.parallel.anatomy import Anatomy
from paraxis.parallel.model_plan import ModelPlan, PlanError
from paraxis.parallel.placement import placement_of, set_placement
from paraxis.parallel.standins import Absent
from paraxis.runtime.differentiable import copy_to, plain_linear
from paraxis.runtime.grid import AxisGroup
from paraxis_tp.adapters import shard_column_adapter, shard_row_adapter
from paraxis_tp.cross_entropy import VocabParallelLoss
from paraxis_tp.layers import (
    gather_tokens,
    map_first_input,
    shard_column,
    shard_embedding,
    shard_row,
)
from paraxis_tp.overlap import OverlappedEntry
from paraxis_tp.regions import (
    REGION_STYLES,
    enter_region,
    mla_rotary_entry,
    scale_identity_expert,
    shard_parameter,
)
from paraxis_tp.rng import TensorParallelRNG

__all__ = ["SUPPORTED_STYLES", "TensorParallelApplied", "apply_tensor_plan"]

COLUMN = {"colwise", "packed_colwise", "colwise_gather_output"}
ROW = {"rowwise", "rowwise_split_input"}
KEEP = {"replicate", "local_params"}
PARTIAL = {"replicated_with_grad_allreduce"}
OTHER = REGION_STYLES | {"moe_identity_expert", "mla_kv_a_proj"}
SUPPORTED_STYLES = sorted(COLUMN | ROW | KEEP | PARTIAL | OTHER | {"embedding_rowwise"})


class TensorParallelApplied:
    """What applying the plan left behind: parameters whose gradients are partial sums
    over the tensor group, the RNG stream and the loss (if the logits stay split)."""

    def __init__(self) -> None:
        self.partial_params: list[nn.Parameter] = []
        self.loss: VocabParallelLoss | None = None
        self.rng: TensorParallelRNG | None = None
        self.replaced: dict[str, str] = {}
        self.entered: set[str] = set()  # blocks entered at their input
        # Under sequence parallelism, column layers outside any entered block that gather
        # their output: name -> their entry, which a mixer run whole rebinds
        # (:func:`paraxis_tp.sequence.shard_sequence`).
        self.gathered_entries: dict[str, Entry] = {}


def _padded(n: int, t: int) -> int:
    return -(-n // t) * t


def _check_type(name: str, module: nn.Module, style: str, kind: type) -> None:
    if not isinstance(module, kind):
        raise PlanError(f"{name}: style {style!r} needs {kind.__name__}, found "
                        f"{type(module).__name__} (not supported for tensor parallelism)")


def _styles(model: nn.Module, plan: ModelPlan) -> dict[str, str]:
    styles = {}
    for name, module in model.named_modules():
        style = plan.tensor_style(name)
        if style is None or isinstance(module, Absent):
            continue
        if style not in SUPPORTED_STYLES:
            raise PlanError(f"{name}: tensor-parallel style {style!r} is not supported by "
                            f"paraxis-tp-layers; supported styles: {SUPPORTED_STYLES}")
        styles[name] = style
    return styles


def _param_styles(model: nn.Module, plan: ModelPlan) -> list[tuple[str, str, str]]:
    """(module, parameter, style) for plan entries that name a parameter."""
    found = []
    for module_name, module in model.named_modules():
        if isinstance(module, Absent):
            continue
        for name, param in module._parameters.items():
            full = f"{module_name}.{name}" if module_name else name
            style = plan.tensor_style(full) if param is not None else None
            if style is not None:
                found.append((module_name, name, style))
    return found


def apply_tensor_plan(model: nn.Module, plan: ModelPlan, anatomy: Anatomy, group: AxisGroup,
                      *, sequence_parallel: bool, rng: TensorParallelRNG,
                      out: TensorParallelApplied, memo: dict[int, nn.Parameter],
                      overlap: bool = False) -> None:
    """Shard one model (or pipeline stage) in place; ``memo`` is shared across the
    stages of one rank so a tied weight stays one parameter. ``overlap`` (sequence
    parallel only): entries and exits of plain ``nn.Linear`` layers overlap their
    collectives with the GEMMs (:mod:`paraxis_tp.overlap`)."""
    sp = sequence_parallel
    overlap = overlap and sp
    fused: dict[str, OverlappedEntry] = {}  # block -> its entry fused with its columns
    styles = _styles(model, plan)
    output_embedding = anatomy.head_of(model)
    rows = {n for n, s in styles.items() if s in ROW}
    parents_with_rows = {n.rpartition(".")[0] for n in rows}
    enter = functools.partial(gather_tokens, group=group, grad="sum") if sp \
        else functools.partial(copy_to, group=group)
    shared: dict[str, SharedEntry] = {}
    blocks: set[str] = set()  # blocks entered at their input
    split_blocks: set[str] = set()  # ...whose inner activations are split (heads, MLP)
    for module_name, name, style in _param_styles(model, plan):
        shard_parameter(model.get_submodule(module_name), name, style, group, memo,
                        where=f"{module_name}.{name}")
        out.replaced[f"{module_name}.{name}"] = style
    for name, style in styles.items():
        module = model.get_submodule(name)
        if style in OTHER:
            _apply_other(model, name, style, group, sp, blocks=parents_with_rows)
            out.replaced[name] = style
        elif style in COLUMN:
            adapter = anatomy.adapter_of(name)
            if adapter is None:
                _check_type(name, module, style, nn.Linear)
            # The head, or a copy of it a wrapper holds (peft's modules_to_save)
            is_logits = output_embedding is not None and any(
                module is m for m in output_embedding.modules())
            parent = name.rpartition(".")[0]
            in_block = parent in parents_with_rows
            if in_block:
                blocks.add(parent)
            gather = style == "colwise_gather_output" and not is_logits
            # Logits and gathered outputs may be padded to a multiple of the degree (the
            # padding is masked in the loss, or cut after the gather); split activations
            # feeding a row-parallel layer may not, and validation guarantees they split.
            vocab = module.out_features
            padded = _padded(vocab, group.size) if is_logits or gather else None
            entry = (None if sp else shared.setdefault(parent, SharedEntry(enter))) \
                if in_block else enter
            if sp and gather and not in_block:
                # Not overlapped: a mixer run whole rebinds this entry (Megatron's f).
                entry = out.gathered_entries[name] = Entry(enter)
            elif overlap and plain_linear(module):
                entry = None if in_block else OverlappedEntry(group)
                (fused.setdefault(parent, OverlappedEntry(group)) if in_block
                 else entry).add(module)
            column = {"parts": 2 if style == "packed_colwise" else 1, "padded": padded,
                      "gather_output": gather, "enter": entry}
            if adapter is not None:  # B split with the base, A whole (paraxis_tp.adapters)
                out.partial_params += shard_column_adapter(model, adapter, group, memo,
                                                           style=style, rng=rng, **column)
            else:
                shard_column(module, group, memo, **column)
            if in_block and not gather:
                split_blocks.add(parent)
            if is_logits:
                out.loss = VocabParallelLoss(start=group.rank * module.out_features,
                                             vocab=vocab, group=group)
        elif style in ROW:
            adapter = anatomy.adapter_of(name)
            if adapter is None:
                _check_type(name, module, style, nn.Linear)
            # A row-parallel head (Inkling's rowwise_split_input) gets the gathered
            # sequence (shard_sequence) and all-reduces the logits, never scatters them.
            head = module is output_embedding
            row = {"split_input": style == "rowwise_split_input",
                   "sequence_parallel": sp and not head, "on_enter": rng.exit}
            if adapter is not None:  # A split with the base, B whole (paraxis_tp.adapters)
                out.partial_params += shard_row_adapter(model, adapter, group, memo,
                                                        style=style, **row)
            else:
                shard_row(module, group, memo, **row,
                          overlap=overlap and not head and plain_linear(module))
        elif style == "embedding_rowwise":
            _check_type(name, module, style, nn.Embedding)
            shard_embedding(module, group, memo,
                            padded=_padded(module.num_embeddings, group.size))
        else:
            if style in PARTIAL:
                out.partial_params += list(module.parameters())
            continue
        out.replaced[name] = style
    for name in sorted(blocks):
        entry = fused.get(name)
        _enter_block(model.get_submodule(name), entry or (enter if sp else None),
                     rng if name in split_blocks else None, shared.get(name) or entry)
    out.entered |= blocks


def _apply_other(model: nn.Module, name: str, style: str, group: AxisGroup, sp: bool, *,
                 blocks: set[str]) -> None:
    """Regions, identity experts and MLA's latent key (:mod:`paraxis_tp.regions`)."""
    module = model.get_submodule(name)
    entered = [b for b in blocks if sp and (name == b or name.startswith(f"{b}."))]
    if style in REGION_STYLES:
        if entered:  # its tokens are gathered already; it would gather them twice
            raise PlanError(f"{name}: style {style!r} inside block {entered[0]}, which "
                            "sequence parallelism enters at its input, is not supported; "
                            "set sequence_parallel: false")
        enter_region(module, group, sequence_parallel=sp)
    elif style == "moe_identity_expert":
        scale_identity_expert(module, group)
    elif not sp:  # mla_kv_a_proj
        rope = getattr(getattr(model, "config", None), "qk_rope_head_dim", None)
        if not isinstance(rope, int):
            raise PlanError(f"{name}: style 'mla_kv_a_proj' needs the model config's "
                            "qk_rope_head_dim (the rotary part of the latent key)")
        mla_rotary_entry(module, group, rope)
    elif name.rpartition(".")[0] not in blocks:
        raise PlanError(f"{name}: style 'mla_kv_a_proj' under sequence parallelism needs "
                        "its attention block entered at its input (a row-parallel output "
                        "projection beside it)")


class Entry:
    """A column layer's entry (Megatron's f, or the all-gather along the sequence) that
    can be rebound after the plan is applied."""

    def __init__(self, enter: Callable):
        self.enter = enter

    def __call__(self, x: Any) -> Any:
        return self.enter(x)


class SharedEntry:
    """Enter the region once per distinct input tensor: siblings fed the same tensor get
    the same entered tensor (one backward all-reduce), anything else enters on its own."""

    def __init__(self, enter: Callable):
        self.enter = enter
        self._last: tuple[Any, Any] | None = None

    def __call__(self, x: Any) -> Any:
        if self._last is None or self._last[0] is not x:
            self._last = (x, self.enter(x))
        return self._last[1]

    def clear(self) -> None:
        self._last = None


def _enter_block(block: nn.Module, enter: Callable | None, rng: TensorParallelRNG | None,
                 shared: SharedEntry | None) -> None:
    """Hooks on a block holding column- and row-parallel layers: ``enter`` its input
    (sequence parallel), and with ``rng`` draw dropout between entry and the row-parallel
    exit from the per-rank stream (the row-parallel layer switches back before its
    reduction). The shared entry's cache is dropped when the block returns."""

    def pre(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if rng is not None:
            rng.enter()
        return map_first_input(enter, args, kwargs) if enter is not None else None

    def post(module: nn.Module, args: tuple, output: Any) -> None:
        if rng is not None:
            rng.exit()
        if shared is not None:
            shared.clear()

    block.register_forward_pre_hook(pre, with_kwargs=True)
    block.register_forward_hook(post)


def mark_partial(params: list[nn.Parameter]) -> None:
    """Record in each placement that its gradient is a partial sum over ``tensor``."""
    for p in params:
        rec = placement_of(p)
        if "tensor" not in rec.partial:
            set_placement(p, rec.with_partial("tensor"))
