"""A LoRA run's counts (Hu et al., arXiv:2106.09685; issue 34): ``paraxis plan
--lora-rank R [--lora-targets ...]`` and ``paraxis train --dry-run`` of a run with a
``lora:`` section count the model as the run builds it, wrapped by peft
(``paraxis_apply_lora``, paraxis-hf) on the meta device: every weight frozen but the
adapters, ``R (in + out)`` parameters beside each targeted linear layer (A: R x in,
B: out x R), which the model's anatomy names (``Anatomy.adapters``).

Frozen parameters keep their weights (sharded by ZeRO-3 like any other) but no gradient
and no optimizer state (DESIGN section 10, "Trainable vs frozen"):
:func:`paraxis.planner.memory.model_state_bytes` counts the adapters alone for those.
Under tensor parallelism an adapter is split with its base (paraxis-tp's ``adapters``):
B of a column-parallel base and A of a row-parallel one; the other side is whole on
every tensor rank (``LayerCount.adapters_whole``).
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

from torch import nn

from paraxis.config.errors import ConfigError
from paraxis.parallel.anatomy import Anatomy
from paraxis.parallel.model_plan import ModelPlan
from paraxis.planner.model import ModelCounts
from paraxis.planner.units import PlanInputError

__all__ = ["adapted", "lora_section", "with_adapters"]


def lora_section(rank: int, targets: list[str] | None) -> Any:
    """The ``lora:`` section ``--lora-rank`` and ``--lora-targets`` stand for (no
    targets: every linear layer but the head, peft's ``all-linear``)."""
    from paraxis.config.lora import LoraSection

    if rank < 1:
        raise PlanInputError(f"--lora-rank {rank} must be at least 1 (e.g. 8)")
    return LoraSection(rank=rank, alpha=2 * rank, target_modules=targets or "all-linear")


def adapted(model: nn.Module, lora: Any, plugin_manager: Any) -> nn.Module:
    """``model`` wrapped with ``lora``'s adapters by the installed plugin; its refusal
    (a target matching no module, peft missing) as one line."""
    from paraxis.engine.lora import with_lora

    try:
        return with_lora(model, SimpleNamespace(lora=lora), plugin_manager)
    except ConfigError as exc:
        raise PlanInputError("; ".join(str(p) for p in exc.problems)) from None


def with_adapters(counts: ModelCounts, model: nn.Module, anatomy: Anatomy,
                  plan: ModelPlan) -> ModelCounts:
    """``counts`` of a model with low-rank adapters (``anatomy.adapters``; unchanged
    without any): per layer, the adapters' parameters and those of them kept whole
    under tensor parallelism (A of a column-parallel base, B of a row-parallel one)."""
    if not anatomy.adapters:
        return counts
    prefix = f"{anatomy.layers}."
    adapters = [0] * counts.num_layers
    whole = [0] * counts.num_layers
    rank = 0
    for a in anatomy.adapters:
        if not a.module.startswith(prefix):
            continue
        index = int(a.module[len(prefix):].partition(".")[0])
        down, up = (model.get_submodule(n).weight for n in (a.down, a.up))
        rank = down.shape[0]
        adapters[index] += down.numel() + up.numel()
        style = plan.tensor_style(a.module) or ""
        # transformers' style names: a column split ("colwise", "packed_colwise"...)
        # keeps A whole, a row split ("rowwise"...) keeps B whole.
        whole[index] += down.numel() if "colwise" in style else \
            up.numel() if "rowwise" in style else 0
    layers = tuple(dataclasses.replace(c, adapters=n, adapters_whole=w)
                   for c, n, w in zip(counts.layers, adapters, whole, strict=True))
    return dataclasses.replace(counts, layers=layers, lora_rank=rank)
