"""Apply a model's tensor-parallel plan: swap modules, mark region entries, and (with
sequence parallelism) shard the residual stream along the sequence.

Styles follow transformers' tensor-parallel plans:

| style                     | paraxis                                                  |
| ------------------------- | -------------------------------------------------------- |
| ``colwise``               | ColumnParallelLinear, output stays split                 |
| ``packed_colwise``        | same, each of the 2 packed blocks (gate, up) split       |
| ``colwise_gather_output`` | ColumnParallelLinear gathering its output; on the output |
|                           | embedding the logits stay split for vocab-parallel loss  |
| ``rowwise``               | RowParallelLinear, input already split                   |
| ``rowwise_split_input``   | RowParallelLinear that splits its (full) input first     |
| ``embedding_rowwise``     | VocabParallelEmbedding                                   |
| ``replicated_with_grad_allreduce`` | kept whole; gradients summed over the group     |
| ``replicate``, ``local_params``    | kept whole                                      |

Region entries. Without sequence parallelism each column-parallel module enters the
region itself (Megatron's f), but sibling projections fed the *same* tensor (q, k and v;
gate and up) share one entry, so backward all-reduces their input gradient once, as
Megatron's fused QKV does; a residual branch of the same tensor is never touched. Under
sequence parallelism the entry is an all-gather along the sequence, and it happens at
the input of the block that holds the projections (an attention or MLP module), because
transformers' attention reshapes q, k, v with its *input*'s sequence length; such
blocks must not add a residual inside (true of the Llama, Mistral, Qwen2 and Phi-3
families; a block that does fails with a shape error, never silently).

Sequence parallelism departs from Megatron in one place, on purpose: the embedding
all-reduces (rather than reduce-scatters) and the sequence is split at the first
decoder layer's input. transformers builds the causal mask and rotary positions from
the embedding output's length, so that output must stay whole.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch import nn

from paraxis.plan import ModelPlan, PlanError
from paraxis.strategy import ApplyContext
from paraxis_tp.cross_entropy import VocabParallelLoss
from paraxis_tp.functional import CommStats, copy_to_region, gather_seq, split_seq
from paraxis_tp.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from paraxis_tp.rng import TensorParallelRNG

__all__ = ["SUPPORTED_STYLES", "TensorParallelApplied", "apply_tensor_plan"]

COLUMN = {"colwise", "packed_colwise", "colwise_gather_output"}
ROW = {"rowwise", "rowwise_split_input"}
KEEP = {"replicate", "local_params"}
PARTIAL = {"replicated_with_grad_allreduce"}
SUPPORTED_STYLES = sorted(COLUMN | ROW | KEEP | PARTIAL | {"embedding_rowwise"})


class TensorParallelApplied:
    """What applying the plan left behind: parameters whose gradients are partial sums
    over the tensor group, the RNG stream, the byte counter and the loss (if the logits
    stay split)."""

    def __init__(self) -> None:
        self.partial_params: list[nn.Parameter] = []
        self.stats = CommStats()
        self.loss: VocabParallelLoss | None = None
        self.rng: TensorParallelRNG | None = None
        self.replaced: dict[str, str] = {}


def _padded(n: int, t: int) -> int:
    return -(-n // t) * t


def _map_hidden(fn: Callable, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Apply ``fn`` to a module call's hidden-state input (first positional argument, or
    the ``hidden_states`` keyword that transformers' layers use)."""
    if args:
        return (fn(args[0]), *args[1:]), kwargs
    if "hidden_states" in kwargs:
        return args, {**kwargs, "hidden_states": fn(kwargs["hidden_states"])}
    raise PlanError("cannot find the hidden-state input of a tensor-parallel block")


def _maybe_submodule(model: nn.Module, name: str) -> nn.Module | None:
    try:
        return model.get_submodule(name)
    except AttributeError:  # a pipeline stage holds only part of the model
        return None


def _set_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def _check_type(name: str, module: nn.Module, style: str, kind: type) -> None:
    if type(module) is not kind:
        raise PlanError(f"{name}: style {style!r} needs {kind.__name__}, found "
                        f"{type(module).__name__} (not supported for tensor parallelism)")


def apply_tensor_plan(model: nn.Module, ctx: ApplyContext, *, seed: int = 0,
                      device: Any = None) -> TensorParallelApplied:
    plan = ctx.plan
    assert isinstance(plan, ModelPlan)
    plan.require("tensor")
    group = ctx.grid.group("tensor")
    sp = ctx.config.parallelism.sequence_parallel
    out = TensorParallelApplied()
    out.rng = TensorParallelRNG(seed, group.rank, device)
    styles = {n: plan.tensor_style(n) for n, _ in model.named_modules()}
    styles = {n: s for n, s in styles.items() if s is not None}
    for name, style in styles.items():
        if style not in SUPPORTED_STYLES:
            raise PlanError(f"{name}: tensor-parallel style {style!r} is not supported by "
                            f"paraxis-tp-layers; supported styles: {SUPPORTED_STYLES}")
    output_embedding = getattr(model, "get_output_embeddings", lambda: None)()
    rows = {n for n, s in styles.items() if s in ROW}
    parents_with_rows = {n.rpartition(".")[0] for n in rows}
    enter = functools.partial(gather_seq if sp else copy_to_region, group=group,
                              stats=out.stats)
    shared: dict[str, SharedEntry] = {}
    memo: dict[int, nn.Parameter] = {}
    blocks: set[str] = set()  # blocks entered at their input
    split_blocks: set[str] = set()  # ...whose inner activations are split (heads, MLP)
    for name, style in styles.items():
        module = model.get_submodule(name)
        if style in COLUMN:
            _check_type(name, module, style, nn.Linear)
            is_logits = module is output_embedding
            parent = name.rpartition(".")[0]
            in_block = parent in parents_with_rows
            if in_block:
                blocks.add(parent)
            gather = style == "colwise_gather_output" and not is_logits
            # Logits and gathered outputs may be padded to a multiple of the degree (the
            # padding is masked in the loss, or cut after the gather); split activations
            # feeding a row-parallel layer may not, and validation guarantees they split.
            padded = _padded(module.out_features, group.size) if is_logits or gather else None
            new = ColumnParallelLinear.from_dense(
                module, group, parts=2 if style == "packed_colwise" else 1, padded=padded,
                memo=memo, gather_output=gather,
                enter=(None if sp else shared.setdefault(parent, SharedEntry(enter)))
                if in_block else enter,
                stats=out.stats)
            if in_block and not new.gather_output:
                split_blocks.add(parent)
            if is_logits:
                out.loss = VocabParallelLoss(start=group.rank * new.out_features,
                                             vocab=module.out_features, group=group)
        elif style in ROW:
            _check_type(name, module, style, nn.Linear)
            new = RowParallelLinear.from_dense(
                module, group, split_input=style == "rowwise_split_input",
                sequence_parallel=sp, stats=out.stats, on_enter=out.rng.exit)
        elif style == "embedding_rowwise":
            _check_type(name, module, style, nn.Embedding)
            padded = _padded(module.num_embeddings, group.size)
            new = VocabParallelEmbedding.from_dense(module, group, padded=padded, memo=memo,
                                                    stats=out.stats)
        else:
            if style in PARTIAL:
                out.partial_params += list(module.parameters())
            continue
        _set_module(model, name, new)
        out.replaced[name] = style
    for name in sorted(blocks):
        _enter_block(model.get_submodule(name), enter if sp else None,
                     out.rng if name in split_blocks else None, shared.get(name))
    if sp:
        pipeline = ctx.extras.get("pipeline")  # split once: on the stage that embeds
        _shard_sequence(model, plan, group, out,
                        split_here=getattr(pipeline, "holds_first_layer", True))
    return out


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
        return _map_hidden(enter, args, kwargs) if enter is not None else None

    def post(module: nn.Module, args: tuple, output: Any) -> None:
        if rng is not None:
            rng.exit()
        if shared is not None:
            shared.clear()

    block.register_forward_pre_hook(pre, with_kwargs=True)
    block.register_forward_hook(post)


def _shard_sequence(model: nn.Module, plan: ModelPlan, group: Any,
                    out: TensorParallelApplied, *, split_here: bool) -> None:
    """Split the residual stream at the first layer (on the pipeline stage that holds it);
    every parameter still replicated over the tensor axis now sees only its rank's
    tokens, so its gradient is partial. A pipeline stage's module is told how many
    sequence shards its activations carry (``sequence_shards``)."""
    containers = [n for n in plan.pipeline
                  if isinstance(_maybe_submodule(model, n), nn.ModuleList)]
    if not containers:
        raise PlanError(f"{plan.model_class}: sequence parallelism needs the layer list "
                        "from the model's pipeline plan")
    if hasattr(model, "sequence_shards"):
        model.sequence_shards = group.size
    if split_here:
        first = model.get_submodule(containers[0])[0]

        def split(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            return _map_hidden(lambda x: split_seq(x, group, out.stats), args, kwargs)

        first.register_forward_pre_hook(split, with_kwargs=True)
    from paraxis.placement import placement_of

    seen = {id(p) for p in out.partial_params}
    for p in model.parameters():
        if "tensor" in placement_of(p).replicated and id(p) not in seen:
            out.partial_params.append(p)
