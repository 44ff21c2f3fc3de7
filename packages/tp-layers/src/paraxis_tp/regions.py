"""Tensor parallelism where a plan names parameters, not layers, and the regions around
them: mixture-of-experts blocks with 3-D expert weights, per-head parameters (attention
sinks, gate biases), multi-head latent attention's shared rotary key.

**Parameter styles** (a plan entry naming a parameter; transformers' DTensor styles on a
parameter of any rank, Megatron-LM's splits, arXiv:1909.08053):

| style            | split dimension of an ``n``-D parameter                      |
| ---------------- | ------------------------------------------------------------ |
| ``colwise``      | ``n - 2`` (output features; a 1-D per-head vector: its heads) |
| ``packed_colwise`` | same, each of the 2 packed blocks (gate, up) split         |
| ``rowwise``      | ``n - 1`` (input features); a 1-D one is refused (a bias    |
|                  | added before the reduction would be summed ``t`` times)      |
| ``packed_rowwise`` | ``n - 1``, each of the 2 packed blocks split               |

**Module styles:**

* ``moe_tp_experts`` and ``all_reduce``: a *region*, a module whose output is a partial
  sum because its parameters are split (Megatron-Core's expert tensor parallelism: every
  rank runs its slice of every expert for every token). Its tensor inputs enter the
  region (f: identity forward, summed gradient; the routing weights too, since every
  rank's partial output depends on them) and its output leaves it (g: all-reduce).
  Under sequence parallelism the inputs are all-gathered along the token dimension
  (gradient reduce-scattered) and the output reduce-scattered, so a block that routes
  its rank's tokens needs nothing else.
* ``moe_identity_expert``: an expert that returns its input (LongCat's zero experts)
  inside a region runs on every rank; its input is divided by ``t`` so the region's sum
  counts it once.
* ``mla_kv_a_proj``: the rotary part of the latent key (``qk_rope_head_dim`` last
  features) reaches the split attention heads without a column-parallel layer, so its
  gradient is partial over heads: f on that part (transformers' ``MlaKvAProjParallel``).
  Under sequence parallelism the attention block's entry already sums it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from paraxis.parallel.model_plan import PlanError
from paraxis.runtime.differentiable import all_gather, copy_to, reduce_from, reduce_scatter, split
from paraxis.runtime.grid import AxisGroup
from paraxis_tp.layers import map_first_input, sharded_parameter

__all__ = ["PARAM_STYLES", "REGION_STYLES", "enter_region", "mla_rotary_entry",
           "scale_identity_expert", "shard_parameter"]

# style -> (split dimension of an n-D parameter, packed blocks)
PARAM_STYLES: dict[str, Callable[[int], tuple[int, int]]] = {
    "colwise": lambda n: (max(n - 2, 0), 1),
    "packed_colwise": lambda n: (max(n - 2, 0), 2),
    "rowwise": lambda n: (n - 1, 1),
    "packed_rowwise": lambda n: (n - 1, 2),
}
REGION_STYLES = frozenset({"moe_tp_experts", "all_reduce"})


def shard_parameter(module: nn.Module, name: str, style: str, group: AxisGroup,
                    memo: dict[int, nn.Parameter], *, where: str) -> None:
    """Replace ``module.<name>`` by this rank's shard under a parameter ``style``."""
    if style not in PARAM_STYLES:
        raise PlanError(f"{where}: tensor-parallel style {style!r} on a parameter is not "
                        f"supported; supported on parameters: {sorted(PARAM_STYLES)}")
    param = module._parameters[name]
    assert param is not None
    if style.endswith("rowwise") and param.ndim == 1:
        raise PlanError(f"{where}: style {style!r} on a 1-D parameter (a bias added before "
                        "the row-parallel reduction would be counted once per rank)")
    dim, parts = PARAM_STYLES[style](param.ndim)
    if param.shape[dim] % (parts * group.size):
        raise PlanError(f"{where}: dimension {dim} of size {param.shape[dim]} does not "
                        f"split into {parts} block(s) over {group.size} tensor ranks; "
                        "choose a tensor degree that divides it")
    module._parameters[name] = sharded_parameter(param, group, memo, dim=dim, parts=parts)


def _token_dim(t: torch.Tensor) -> int:
    return -2 if t.ndim >= 2 else 0  # (..., tokens, features) or a flat token list


def _map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], args: tuple,
                 kwargs: dict) -> tuple[tuple, dict]:
    args = tuple(fn(a) if isinstance(a, torch.Tensor) else a for a in args)
    kwargs = {k: fn(v) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    return args, kwargs


def _map_output(fn: Callable[[torch.Tensor], torch.Tensor], out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return fn(out)
    if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor):
        return (fn(out[0]), *out[1:])
    raise PlanError(f"a tensor-parallel region returned {type(out).__name__}, not a tensor")


def _per_sample(t: torch.Tensor, samples: tuple[int, int] | None) -> int | None:
    """The batch size, when ``t`` holds a region's tokens flattened over (batch,
    sequence) beside a (batch, sequence, hidden) first input (``samples``: its batch and
    sequence length on this rank, the whole one for an output)."""
    if samples is None or t.ndim > 2 or t.shape[0] != samples[0] * samples[1]:
        return None
    return samples[0]


def enter_region(module: nn.Module, group: AxisGroup, *, sequence_parallel: bool) -> None:
    """Hooks making ``module`` a region (see the module docstring). Under sequence
    parallelism a tensor flattened over (batch, sequence) beside a (batch, sequence,
    hidden) input (Inkling's shared-expert weights) is gathered and scattered per sample,
    so its rows stay in the order of the gathered sequence flattened (batch-major)."""
    samples: list[tuple[int, int] | None] = [None]

    def enter(t: torch.Tensor) -> torch.Tensor:
        if not sequence_parallel:
            return copy_to(t, group) if t.is_floating_point() else t
        if (b := _per_sample(t, samples[0])) is not None:
            whole = all_gather(t.reshape(b, -1, *t.shape[1:]), group, dim=1, grad="sum")
            return whole.reshape(-1, *t.shape[1:]).contiguous()
        return all_gather(t, group, dim=_token_dim(t), grad="sum").contiguous()

    def leave(t: torch.Tensor) -> torch.Tensor:
        if not sequence_parallel:
            return reduce_from(t, group)
        local = samples[0]
        whole = None if local is None else (local[0], local[1] * group.size)
        if (b := _per_sample(t, whole)) is not None:
            part = reduce_scatter(t.reshape(b, -1, *t.shape[1:]), group, dim=1)
            return part.reshape(-1, *t.shape[1:]).contiguous()
        return reduce_scatter(t, group, dim=_token_dim(t)).contiguous()

    def pre(m: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        first = next((t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)), None)
        samples[0] = (first.shape[0], first.shape[1]) if first is not None and \
            first.ndim == 3 and first.shape[0] > 1 else None
        return _map_tensors(enter, args, kwargs)

    module.register_forward_pre_hook(pre, with_kwargs=True)
    module.register_forward_hook(lambda m, args, out: _map_output(leave, out))
    module.paraxis_tensor = "region"


def run_whole(module: nn.Module, group: AxisGroup) -> None:
    """Under sequence parallelism, a sequence mixer the tensor plan does not enter (an
    attention, state-space or convolution block the plan leaves whole: multi-head latent
    attention, linear attention, Mamba mixers) runs on the whole sequence on every
    tensor rank: its hidden-state input is all-gathered along the tokens and its output
    split back to this rank's tokens. Every rank then computes the same whole function
    from the same whole output gradient (the split's backward gathers it), so the
    input's gradient is this rank's slice of an identical whole (``grad="slice"``) and
    the module's parameters get whole, identical gradients on every rank: nothing is
    summed. The cost is t copies of that module's compute and one all-gather of its
    input per call; the masks and rotary tables it takes are already whole (transformers
    builds them from the embedding's output, before the sequence is split)."""

    def enter(t: torch.Tensor) -> torch.Tensor:
        return all_gather(t, group, dim=_token_dim(t), grad="slice").contiguous()

    def leave(t: torch.Tensor) -> torch.Tensor:
        return split(t, group, dim=_token_dim(t)).contiguous()

    module.register_forward_pre_hook(
        lambda m, args, kwargs: map_first_input(enter, args, kwargs), with_kwargs=True)
    module.register_forward_hook(lambda m, args, out: _map_output(leave, out))
    module.paraxis_tensor = "whole on every rank (sequence gathered)"


def scale_identity_expert(module: nn.Module, group: AxisGroup) -> None:
    module.register_forward_pre_hook(
        lambda m, args, kwargs: map_first_input(lambda x: x / group.size, args, kwargs),
        with_kwargs=True)
    module.paraxis_tensor = f"identity expert (input / {group.size})"


def mla_rotary_entry(linear: nn.Module, group: AxisGroup, rope_dim: int) -> None:
    """f on the last ``rope_dim`` output features of the latent key projection."""

    def post(m: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        latent, rotary = out.split([out.shape[-1] - rope_dim, rope_dim], dim=-1)
        return torch.cat([latent, copy_to(rotary, group)], dim=-1)

    linear.register_forward_hook(post)
    linear.paraxis_tensor = f"latent key (rotary {rope_dim} entered)"
