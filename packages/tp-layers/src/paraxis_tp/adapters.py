"""Low-rank adapters split with their base layer (LoRA, Hu et al., arXiv:2106.09685;
DESIGN section 10, "Trainable vs frozen": the side of the adapter that multiplies the
base's sharded dimension is sharded the same way).

A LoRA layer computes ``y = base(x) + B(A(dropout(x))) * s`` in its own forward (peft's
``lora.Linear``), ``A`` of shape rank x in, ``B`` out x rank. It is sharded in place
like any layer (:mod:`paraxis_tp.layers`), the hooks on the LoRA layer itself, so the
base's output and the adapter's are summed before anything leaves the region:

* **Column-parallel base** (``y`` split by output features): ``B`` is split by its rows
  with the base's (the same packed blocks and padding), ``A`` stays whole. Each rank
  computes ``A x`` in full (rank-sized, cheap) and its slice of ``B (A x)``. ``A``'s
  gradient ``s B^T dy x^T`` only sums this rank's output rows, so it is a partial sum
  over the tensor group, summed once per step (:class:`~paraxis_tp.strategy.PartialGradSync`,
  its placement says ``partial``). The input's gradient, the base's and the adapter's
  together, is summed by the region's entry as for any column layer.
* **Row-parallel base** (``x`` split by input features): ``A`` is split by its columns
  with the base's, ``B`` stays whole. ``A_r x_r`` is this rank's partial sum of ``A x``,
  so ``B (A_r x_r)`` is a partial sum of the adapter's output; it is added to the base's
  partial output and the one reduction (all-reduce, or reduce-scatter under sequence
  parallelism) sums both; the base's bias is added once, after it. ``B``'s gradient
  ``s dy (A_r x_r)^T`` is then a partial sum too, summed like ``A``'s above.

Splitting ``A`` of a row-parallel base by its rows instead (the wrong side) computes
``B_r A_r`` products of mismatched halves; tests/test_lora_parity.py plants that and
watches the parity check fail.

Dropout on the adapter's input: a column-parallel base's input is whole and the same on
every tensor rank, so its mask must be too: it is drawn from the shared stream even
inside a block whose other dropouts use the per-rank one. A row-parallel base's input is
this rank's features: the per-rank stream, as for the activations around it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from paraxis.parallel.model_plan import Adapter, PlanError
from paraxis.runtime.grid import AxisGroup
from paraxis_tp.layers import shard_column, shard_row
from paraxis_tp.rng import TensorParallelRNG

__all__ = ["shard_column_adapter", "shard_row_adapter"]


def _parts(model: nn.Module, adapter: Adapter, style: str) -> tuple[nn.Linear, ...]:
    """(base, down, up, dropout or None): what a LoRA layer holds, checked."""
    base, down, up = (model.get_submodule(n) for n in (adapter.base, adapter.down, adapter.up))
    for name, module in ((adapter.base, base), (adapter.down, down), (adapter.up, up)):
        if not isinstance(module, nn.Linear):
            raise PlanError(f"{name}: style {style!r} splits a LoRA layer whose parts must "
                            f"be linear layers; found {type(module).__name__}")
    dropout = model.get_submodule(adapter.dropout) if adapter.dropout else None
    return base, down, up, dropout


def shard_column_adapter(model: nn.Module, adapter: Adapter, group: AxisGroup,
                         memo: dict[int, nn.Parameter], *, style: str, rng: TensorParallelRNG,
                         **column: Any) -> list[nn.Parameter]:
    """Shard a LoRA layer whose base is column-parallel (``column``: what
    :func:`~paraxis_tp.layers.shard_column` takes); returns the parameters whose
    gradients are partial sums over the group (``A``)."""
    base, down, up, dropout = _parts(model, adapter, style)
    shard_column(model.get_submodule(adapter.module), group, memo, holders=(base, up),
                 **column)
    if dropout is not None and not isinstance(dropout, nn.Identity):
        _shared_stream(dropout, rng)
    return list(down.parameters())


def shard_row_adapter(model: nn.Module, adapter: Adapter, group: AxisGroup,
                      memo: dict[int, nn.Parameter], *, style: str,
                      **row: Any) -> list[nn.Parameter]:
    """Shard a LoRA layer whose base is row-parallel (``row``: what
    :func:`~paraxis_tp.layers.shard_row` takes); returns the parameters whose gradients
    are partial sums over the group (``B``)."""
    base, down, up, _ = _parts(model, adapter, style)
    for name, part in ((adapter.down, down), (adapter.up, up)):
        if part.bias is not None:  # added on every rank before the sum: t times
            raise PlanError(f"{name}: a bias in the adapter of a row-parallel layer would "
                            "be added on every tensor rank before the reduction sums them; "
                            "not supported under tensor parallelism (peft's lora_bias: "
                            "set it false)")
    shard_row(model.get_submodule(adapter.module), group, memo, holders=(base, down), **row)
    return list(up.parameters())


def _shared_stream(dropout: nn.Module, rng: TensorParallelRNG) -> None:
    """Run ``dropout`` on the shared stream, whichever stream is active around it."""
    def pre(module: nn.Module, args: Any) -> None:
        module._paraxis_per_rank = rng.active
        rng.exit()

    def post(module: nn.Module, args: Any, out: torch.Tensor) -> None:
        if module._paraxis_per_rank:
            rng.enter()

    dropout.register_forward_pre_hook(pre)
    dropout.register_forward_hook(post)

