"""Activation checkpointing, core's own strategy (phase WRAP).

``schedule.activation_checkpointing``:

* ``full``: every transformer layer keeps only its input; its activations are
  recomputed in backward (Chen et al., arXiv:1604.06174).
* ``selective``: only each layer's attention block is recomputed, the cheap-to-redo,
  costly-to-store part (in the spirit of Korthikanti et al., arXiv:2205.05198, section 5,
  at module granularity: the block's projections are recomputed too).
* ``none``: nothing.

The layers, and each layer's attention (its first sequence mixer: a linear-attention or
state-space layer recomputes its mixer), are the model's anatomy's
(:mod:`paraxis.parallel.anatomy`); on a pipeline stage only the layers it runs (each
chunk's, under an interleaved schedule), never the stand-ins for other stages' layers.
Recomputation replays every RNG stream an axis registered (the tensor-parallel dropout
stream included) from its state at the forward, so dropout masks match; torch's
checkpoint replays the default generator itself.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from paraxis.parallel.anatomy import Anatomy
from paraxis.parallel.model_plan import PlanError
from paraxis.parallel.stages import chunks_of
from paraxis.parallel.strategy import ApplyContext, Phase, Strategy

__all__ = ["ActivationCheckpointing"]


def _attention_of(anatomy: Anatomy, index: int, layer: nn.Module) -> nn.Module:
    mixers = anatomy.parts[index].sequence_mixers
    if not mixers:
        raise PlanError(f"{type(layer).__name__} (layer {index}): no attention block or "
                        "other sequence mixer for selective recomputation; use full")
    return layer.get_submodule(mixers[0])


class _Replay:
    """Puts every stream back to its state at the forward while a recomputation runs.
    A class, not a generator: a split backward (zero-bubble schedules) may recompute the
    same checkpoint twice, once for input gradients and once for weight gradients."""

    def __init__(self, streams: dict[str, Any], at_forward: dict[str, Any]):
        self.streams, self.at_forward = streams, at_forward
        self.saved: list[dict[str, Any]] = []

    def __enter__(self) -> None:
        self.saved.append({n: s.get_state() for n, s in self.streams.items()})
        for n, s in self.streams.items():
            s.set_state(self.at_forward[n])

    def __exit__(self, *exc: object) -> None:
        for n, state in self.saved.pop().items():
            self.streams[n].set_state(state)


def _wrap(module: nn.Module, streams: dict[str, Any]) -> None:
    forward = module.forward

    @functools.wraps(forward)
    def recomputed(*args: Any, **kwargs: Any) -> Any:
        replay = _Replay(streams, {n: s.get_state() for n, s in streams.items()})

        def contexts() -> tuple[Any, Any]:
            return contextlib.nullcontext(), replay

        # Tensors given by keyword reach checkpoint positionally: it keeps keyword
        # arguments by reference, outside saved_tensors_hooks, where offloading hooks and
        # the planner's measurement (issue 15) could not see the block's input.
        names = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
        rest = {k: v for k, v in kwargs.items() if k not in names}

        def call(*flat: Any) -> Any:
            n = len(flat) - len(names)
            return forward(*flat[:n], **rest, **dict(zip(names, flat[n:], strict=True)))

        return checkpoint(call, *args, *(kwargs[k] for k in names), use_reentrant=False,
                          context_fn=contexts)

    module.forward = recomputed  # type: ignore[method-assign]


class ActivationCheckpointing(Strategy):
    axis = "activation_checkpointing"
    phase = Phase.WRAP
    takes_meta = True  # it wraps forwards and reads no parameter

    def apply(self, model: nn.Module, ctx: ApplyContext) -> nn.Module:
        selective = ctx.config.schedule.activation_checkpointing == "selective"
        for chunk in chunks_of(model):
            for index, layer in ctx.anatomy.owned_layers(chunk):
                target = _attention_of(ctx.anatomy, index, layer) if selective else layer
                _wrap(target, ctx.rng_streams)
        return model
