"""Model plans: which modules an axis rewrites, as plain data (house rule 4).

A plan is built by an integration (paraxis-hf reads Hugging Face's own
``_tp_plan``/``_pp_plan``) or written by hand for a torch module. Axis packages read it;
they never look up per-model tables of their own.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from paraxis.config.errors import Problem

__all__ = ["Adapter", "ModelPlan", "PlanError", "find_plan"]


class PlanError(ValueError):
    """A plan is missing, or names a module or style that does not exist."""


@dataclass(frozen=True)
class Adapter:
    """A low-rank adapter beside a base linear layer (LoRA, Hu et al., arXiv:2106.09685):
    ``module`` computes ``base(x) + up(down(dropout(x))) * scaling`` in its own forward.
    Names are full module names; ``down`` is A (rank x in), ``up`` is B (out x rank).
    The integration that knows the adapter library names them (paraxis-hf for peft);
    an axis that splits ``module``'s base splits the adapter with it (DESIGN section 10,
    "Trainable vs frozen")."""

    module: str
    base: str
    down: str
    up: str
    dropout: str | None = None


@dataclass(frozen=True)
class ModelPlan:
    """What the parallel axes need to know about one model.

    ``tensor``: module-name pattern (``*`` for a layer index) -> style, in the vocabulary
    of transformers' tensor-parallel plans (``colwise``, ``rowwise``, ``embedding_rowwise``,
    ``colwise_gather_output``...). ``pipeline``: module name -> (input names, output
    names), in forward order; the entry whose module is a ModuleList holds the layers.
    ``experts``: names of mixture-of-experts blocks. ``source`` says where it came from.
    """

    model_class: str
    tensor: dict[str, str] = field(default_factory=dict)
    pipeline: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = field(default_factory=dict)
    experts: tuple[str, ...] = ()
    source: str = "hand-written"
    extra: dict[str, Any] = field(default_factory=dict)
    # Layouts the plan's author knows this model cannot run, each with the reason: an
    # axis ("tensor", "context"...) or "sequence_parallel". Refused at parallelize.
    unsupported: dict[str, str] = field(default_factory=dict)
    # Low-rank adapters (a peft LoRA model's), read by the anatomy (``Anatomy.adapters``).
    adapters: tuple[Adapter, ...] = ()

    def refusals(self, config: Any) -> list[Problem]:
        """A :class:`Problem` for each layout of ``config`` (a ``ParallelConfig``) that
        :attr:`unsupported` names."""
        degrees = config.degrees
        used = {axis for axis, n in degrees.items() if n > 1}
        if degrees.get("tensor", 1) > 1 and config.parallelism.sequence_parallel:
            used.add("sequence_parallel")
        return [Problem(field=f"parallelism.{layout}",
                        value=True if layout == "sequence_parallel" else degrees[layout],
                        rule=f"{self.model_class}: {self.unsupported[layout]}",
                        fix=f"set {layout}: " + ("false" if layout == "sequence_parallel"
                                                 else "1"))
                for layout in sorted(used & set(self.unsupported))]

    def require(self, axis: str) -> None:
        """Raise a clear error if ``axis`` needs a part of the plan this model lacks."""
        have = {"tensor": bool(self.tensor), "pipeline": bool(self.pipeline),
                "expert": bool(self.experts)}
        if axis in have and not have[axis]:
            raise PlanError(
                f"{self.model_class} has no {axis}-parallel plan ({self.source}); "
                f"{axis} parallelism needs one. Pass plan=ModelPlan(...) to parallelize(), "
                f"or set {axis}=1")

    def tensor_style(self, module_name: str) -> str | None:
        """The tensor-parallel style for a module, matching ``*`` against layer indices."""
        for pattern, style in self.tensor.items():
            if fnmatch.fnmatchcase(module_name, pattern):
                return style
        return None

    def check_against(self, model: nn.Module) -> None:
        """Every pattern must name at least one module of ``model``."""
        names = [n for n, _ in model.named_modules()]
        missing = [p for p in [*self.tensor, *self.pipeline, *self.experts]
                   if not any(fnmatch.fnmatchcase(n, p) for n in names)]
        if missing:
            raise PlanError(f"{self.model_class}: plan entries match no module: {missing}")


def find_plan(model: nn.Module, plugin_manager: Any, given: ModelPlan | None) -> ModelPlan:
    """The given plan, else the first plugin's answer, else an empty one."""
    if given is not None:
        return given
    found = plugin_manager.hook.paraxis_model_plan(model=model)
    return found or ModelPlan(type(model).__name__, source="no plugin knows this model")
