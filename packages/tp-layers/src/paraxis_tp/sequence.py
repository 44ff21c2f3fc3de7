"""Sequence parallelism around an applied tensor plan: split the residual stream along
the sequence at a chunk's first layer, run whole the sequence mixers the plan does not
enter, and give a head the plan leaves whole the whole sequence.

Megatron-LM splits the sequence between its tensor-parallel regions (arXiv:2205.05198);
every block the plan enters gathers it at its input (:mod:`paraxis_tp.apply`). What the
plan does not enter but mixes tokens (multi-head latent attention, linear attention,
Mamba mixers, short convolutions: a layer's sequence mixers, as the model's anatomy
names them, :mod:`paraxis.parallel.anatomy`) would see 1/t of the sequence; it runs
whole on every tensor rank instead (:func:`paraxis_tp.regions.run_whole`). A mixer the
plan shards only through column layers that gather their output (Qwen3-Next's
``linear_attn``) runs whole too: those layers' entries become Megatron's f (identity
forward, summed input gradient), since their input is already whole. Any other sharded
part is refused.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

from torch import nn

from paraxis.parallel.anatomy import Anatomy
from paraxis.parallel.model_plan import PlanError
from paraxis.parallel.placement import placement_of
from paraxis.runtime.differentiable import copy_to
from paraxis.runtime.grid import AxisGroup
from paraxis_tp.apply import TensorParallelApplied
from paraxis_tp.layers import gather_tokens, map_first_input, split_tokens
from paraxis_tp.regions import run_whole

__all__ = ["shard_sequence"]


def _under(prefix: str, names: Iterable[str]) -> list[str]:
    return [n for n in names if n == prefix or n.startswith(f"{prefix}.")]


def _mixers_not_entered(chunk: nn.Module, anatomy: Anatomy,
                        applied: TensorParallelApplied) -> list[tuple[nn.Module, list[str]]]:
    """The sequence mixers of the chunk's layers that the tensor plan enters none of,
    each with its sharded column layers that gather their output. Any other part the
    plan shards inside such a mixer is refused: run whole, it would see the whole
    sequence where the plan expects its rank's share. A mixture-of-experts block works
    token by token whatever its name (Nemotron-H calls every layer's block ``mixer``):
    the anatomy lists it among the experts, and it routes this rank's tokens."""
    out = []
    for index, layer in anatomy.owned_layers(chunk):
        for child, full in zip(anatomy.parts[index].sequence_mixers,
                               anatomy.sequence_mixers_of(index), strict=True):
            if _under(full, applied.entered):
                continue
            sharded = _under(full, applied.replaced)
            if other := [n for n in sharded if n not in applied.gathered_entries]:
                raise PlanError(
                    f"{anatomy.model_class}: {full} mixes the sequence and the tensor plan "
                    f"shards {other[0]} ({applied.replaced[other[0]]}) without entering the "
                    "block at its input, so under sequence parallelism it would see 1/t of "
                    "the sequence, and run whole its sharded part would see the whole one; "
                    "set sequence_parallel: false (tensor parallelism without it runs this "
                    "model)")
            out.append((layer.get_submodule(child), sharded))
    return out


def shard_sequence(chunk: nn.Module, anatomy: Anatomy, group: AxisGroup,
                   out: TensorParallelApplied, *, first_layer: int, first_stage: bool) -> None:
    """Split the residual stream at the input of the chunk's first layer; on a stage
    after the first, first gather the split activations the previous stage sent. A
    parameter still replicated over the tensor axis that acts on the split stream (a
    layer's norms) then sees only its rank's tokens, so its gradient is partial; one used
    before the split (a learned position embedding) sees them all.
    :class:`~paraxis_tp.strategy.PartialGradSync` tells them apart at the first backward.
    A layer's sequence mixer that the plan does not enter runs whole on every tensor
    rank (:func:`~paraxis_tp.regions.run_whole`)."""
    layers = anatomy.layer_list(chunk)
    for mixer, gathered in _mixers_not_entered(chunk, anatomy, out):
        run_whole(mixer, group)
        for column in gathered:
            # Its input is the whole sequence, the same on every rank: it enters as
            # Megatron's f, and its gathered output is the same whole on every rank.
            out.gathered_entries[column].enter = functools.partial(copy_to, group=group)
    # Once per forward of the chunk: a looped model may call its first layer again on
    # the split stream (Dory's input and output sections, a recurrent block at layer 0).
    split_done = [False]

    def split_once(m: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if split_done[0]:
            return None
        split_done[0] = True
        return map_first_input(lambda x: split_tokens(x, group), args, kwargs)

    chunk.register_forward_pre_hook(lambda m, args: split_done.__setitem__(0, False))
    layers[first_layer].register_forward_pre_hook(split_once, with_kwargs=True)
    head = anatomy.head_of(chunk)
    if isinstance(head, nn.Linear) and ("tensor" not in placement_of(head.weight).sharded_axes
                                        or getattr(head, "paraxis_tensor", None) == "row"):
        # A head the plan leaves whole, or splits by rows, gets the whole sequence
        # (every rank computes the same logits, so the gathered input's gradient is
        # this rank's slice); a column-parallel one gathers it at its own entry. First
        # (prepend): the tokens are gathered before a row split cuts the features.
        head.register_forward_pre_hook(
            lambda m, args, kwargs: map_first_input(
                lambda x: gather_tokens(x, group, grad="slice"), args, kwargs),
            with_kwargs=True, prepend=True)
    if not first_stage:
        # Every use of the gathered input is replicated over the tensor group (masks,
        # positions, then the split above), so its gradient is this rank's slice.
        chunk.register_forward_pre_hook(
            lambda m, args, kwargs: map_first_input(
                lambda x: gather_tokens(x, group, grad="slice"), args, kwargs),
            with_kwargs=True)
