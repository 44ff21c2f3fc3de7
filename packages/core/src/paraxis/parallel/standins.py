"""What stands in a pipeline stage for the modules another stage owns.

A stage is the model with what it does not own taken out (:mod:`paraxis.parallel.stages`):
a layer of another stage becomes a :class:`SkipLayer`, a module before or after the
layers that this stage does not run becomes :class:`Absent`. Both live here, below the
anatomy (:mod:`paraxis.parallel.anatomy`), which tells a stage's own layers and head from
these stand-ins.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from paraxis.parallel.model_plan import PlanError

__all__ = ["Absent", "AbsentModuleError", "SkipLayer", "stands_in"]


class SkipLayer(nn.Module):
    """Stands for a layer another stage owns: returns its hidden-state input."""

    def __init__(self, index: int):
        super().__init__()
        self.index = index

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return args[0] if args else kwargs["hidden_states"]

    def extra_repr(self) -> str:
        return f"layer {self.index} lives on another stage"


class AbsentModuleError(PlanError, AttributeError):
    """A stage's forward used a module another stage owns."""


class Absent(nn.Module):
    """Stands for a module another stage owns; using it is a bug, said plainly."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise AbsentModuleError(f"{self.name} lives on another pipeline stage, but this "
                                "stage's forward called it")

    def __getattr__(self, item: str) -> Any:
        try:
            return super().__getattr__(item)
        except AttributeError:
            if item.startswith("_"):
                raise
            raise AbsentModuleError(f"{self.__dict__.get('name')} lives on another pipeline "
                                    f"stage, but this stage's forward used its {item!r}"
                                    ) from None

    def extra_repr(self) -> str:
        return f"{self.name} lives on another stage"


def stands_in(module: nn.Module | None) -> bool:
    """Whether ``module`` is missing or a stand-in for what another stage runs
    (:class:`Absent`, :class:`SkipLayer`, or the ``Identity`` a stage puts in place of
    a module it has no use for)."""
    return module is None or isinstance(module, Absent | SkipLayer | nn.Identity)
