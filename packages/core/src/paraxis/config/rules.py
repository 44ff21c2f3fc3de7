"""Cross-field rules, checked before any process group exists (DESIGN section 2).

:func:`check` returns every problem; :func:`validate` raises one
:class:`~paraxis.config.errors.ConfigError` listing them all. Axis packages add their own rules
through the ``paraxis_validate_config`` hook.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from typing import Any

from paraxis.config.errors import ConfigError, Problem
from paraxis.config.parallel import ParallelConfig
from paraxis.config.shape import ModelShape

__all__ = ["check", "divides", "divisors", "validate"]


def divides(problems: list[Problem], field: str, value: int | None, degree: int,
            axis: str) -> None:
    """Append a problem unless ``value`` is divisible by ``degree`` (the rule every axis
    that splits a dimension shares); a per-layer list (Gemma-3n's intermediate sizes)
    is checked value by value."""
    if isinstance(value, Sequence) and not isinstance(value, str):  # one per layer
        for v in dict.fromkeys(value):
            divides(problems, field, v, degree, axis)
        return
    if value is not None and degree > 1 and value % degree:
        problems.append(Problem(
            field, value, f"must be divisible by the {axis} degree {degree}",
            f"choose {axis} among {divisors(value)} or change {field}"))


def divisors(n: int) -> list[int]:
    return [d for d in range(1, min(n, 64) + 1) if n % d == 0]


def check(config: ParallelConfig, *, world_size: int | None = None,
          model: ModelShape | None = None) -> list[Problem]:
    """Every grid-wide rule the configuration breaks. Each axis checks its own rules
    (divisibility of what it splits, the combinations it supports) in its package,
    through the ``paraxis_validate_config`` hook, so they travel with the axis."""
    problems: list[Problem] = []
    if world_size is not None and world_size != config.world_size:
        degrees = " x ".join(f"{a}={d}" for a, d in config.degrees.items())
        problems.append(Problem(
            "world_size", world_size, f"must equal the product of degrees {degrees} = "
            f"{config.world_size}", "launch that many processes or change the degrees"))
    par = config.parallelism
    for name in par.axes:
        if name not in config.axis_table.names:
            near = difflib.get_close_matches(name, config.axis_table.names, n=1)
            problems.append(Problem(
                f"parallelism.axes.{name}", par.axes[name],
                "names no grid axis: an axis a package adds is registered by that package "
                f"(the axes are {list(config.axis_table.names)})",
                f"did you mean {near[0]!r}?" if near else
                "install the package that adds it, or remove the entry"))
    if par.expert_tensor not in (1, par.tensor):
        # A group strictly inside the tensor group would leave each expert shard
        # replicated over the rest of it: a placement no grid axis names (neither the
        # gradient reduction nor a checkpoint could read it), so it is refused.
        why = (f"must divide the tensor degree {par.tensor}" if par.tensor % par.expert_tensor
               else f"must be 1 or the tensor degree {par.tensor} (a sub-group of the "
               "tensor group is not a grid group paraxis builds)")
        problems.append(Problem("parallelism.expert_tensor", par.expert_tensor, why,
                                f"set expert_tensor: 1 or {par.tensor}"))
    return problems


def validate(config: ParallelConfig, *, world_size: int | None = None,
             model: ModelShape | None = None, plugin_manager: Any = None,
             extra: Sequence[Problem] = ()) -> None:
    """Raise :class:`ConfigError` listing every problem: core's, the plugins', and any
    ``extra`` the caller found (run rules, missing axis packages)."""
    problems = [*extra, *check(config, world_size=world_size, model=model)]
    if plugin_manager is not None:
        plugin_manager.hook.paraxis_validate_config(config=config, model=model,
                                                    problems=problems)
    if problems:
        raise ConfigError(problems)
