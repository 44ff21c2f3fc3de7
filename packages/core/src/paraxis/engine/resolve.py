"""Which strategies a run needs, and the installed packages that provide them.

:func:`required_axes` reads the configuration (and whether the model has
mixture-of-experts blocks); :func:`resolve` collects the registered strategies once and
maps each required axis to its class, in the order they apply, noting the axes no
installed package provides (the ``pip install`` that does is in the problem).

The apply order is the phase (:class:`~paraxis.parallel.strategy.Phase`), then each
strategy's declared ``order`` within it; two strategies of one phase may not declare the
same order (the order would then be an accident of names, as it was before issue 33).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from paraxis.config.errors import MissingAxisPackageError, Problem
from paraxis.engine.plugins import collect_strategies
from paraxis.parallel.strategy import Strategy

if TYPE_CHECKING:
    import pluggy

    from paraxis.config.parallel import ParallelConfig

__all__ = ["PACKAGE_FOR_STRATEGY", "Resolution", "apply_order", "package_for",
           "required_axes", "resolve", "resolve_strategies"]


# The distribution that provides each strategy that is not a grid axis's own, for the
# "pip install" hint; a grid axis's package is in the axis table (paraxis.config.axes).
PACKAGE_FOR_STRATEGY: dict[str, str] = {
    "zero": "paraxis-zero-shard",
    "offload": "paraxis-deepspeed",
    "activation_checkpointing": "paraxis",  # core's own
}


def package_for(axis: str, config: ParallelConfig) -> str:
    """The distribution that provides strategy ``axis``."""
    table = config.axis_table
    return table.spec(axis).package if axis in table.names else PACKAGE_FOR_STRATEGY[axis]


def required_axes(config: ParallelConfig, *, has_experts: bool = False) -> list[str]:
    """The strategy axes a configuration needs, in no particular order: every grid axis
    above degree one (the data axis through the data strategy below), the reduction of
    the data axes, activation checkpointing. A model with mixture-of-experts blocks
    (``has_experts``: its plan names some) always needs the expert axis, even at degree
    1: its router losses and statistics live there."""
    par = config.parallelism
    wanted = [a for a, n in config.degrees.items() if n > 1 and a != "data"]
    if has_experts and "expert" not in wanted:
        wanted.append("expert")
    # Gradients of dense parameters are averaged over data x expert x context. Offload
    # (ZeRO-Offload / ZeRO-Infinity) is the DeepSpeed bridge's, which then owns ZeRO too.
    if par.offload.enabled:
        wanted.append("offload")
    elif par.zero > 0:
        wanted.append("zero")
    elif config.token_replicas > 1:
        wanted.append("data")
    if config.schedule.activation_checkpointing != "none":
        wanted.append("activation_checkpointing")
    return wanted


def _setting(config: ParallelConfig, axis: str) -> tuple[str, Any]:
    """The config field that asks for ``axis`` (axes are named after their field; one a
    package adds is under ``parallelism.axes``)."""
    if axis in config.parallelism.axes:
        return f"parallelism.axes.{axis}", config.parallelism.axes[axis]
    section = "parallelism" if axis in type(config.parallelism).model_fields else "schedule"
    return f"{section}.{axis}", getattr(getattr(config, section), axis)


def apply_order(strategies: list[type[Strategy]]) -> tuple[type[Strategy], ...]:
    """``strategies`` in the order they apply: by phase, then the order each declares
    within its phase. Two of one phase declaring the same order is a plugin's error."""
    ordered = sorted(strategies, key=lambda cls: (cls.phase, cls.order))
    for a, b in itertools.pairwise(ordered):
        if (a.phase, a.order) == (b.phase, b.order):
            raise ValueError(
                f"strategies {a.__qualname__} ({a.axis}) and {b.__qualname__} ({b.axis}) "
                f"both declare order {a.order} in phase {a.phase.name}: give each its own "
                "place (Strategy.order), so the apply order is stated, not an accident")
    return tuple(ordered)


@dataclass(frozen=True)
class Resolution:
    """The strategies a run applies (those installed, in apply order) and a problem for
    every required axis no installed package provides."""

    strategies: tuple[type[Strategy], ...]
    missing: tuple[Problem, ...]
    packages: tuple[tuple[str, str], ...]  # (axis, distribution) of each missing axis

    def require(self, problems: list[Problem] | None = None) -> tuple[type[Strategy], ...]:
        """The strategies; raises :class:`MissingAxisPackageError` naming the first
        missing package, with every missing axis and ``problems`` (the configuration's
        others, so one message says everything)."""
        if self.packages:
            axis, package = self.packages[0]
            raise MissingAxisPackageError(axis, package, [*self.missing, *(problems or [])])
        return self.strategies


def resolve(config: ParallelConfig, pm: pluggy.PluginManager, *,
            has_experts: bool = False) -> Resolution:
    """Collect the registered strategies once and resolve every required axis."""
    available = collect_strategies(pm)
    chosen, missing, packages = [], [], []
    for axis in required_axes(config, has_experts=has_experts):
        if axis in available:
            chosen.append(available[axis])
            continue
        package = package_for(axis, config)
        packages.append((axis, package))
        missing.append(Problem(
            *_setting(config, axis), f"no installed package provides the {axis} axis"
            + (" (a mixture-of-experts model trains with its router losses)"
               if axis == "expert" and has_experts else ""),
            f"pip install {package}"))
    return Resolution(apply_order(chosen), tuple(missing), tuple(packages))


def resolve_strategies(config: ParallelConfig, pm: pluggy.PluginManager, *,
                       has_experts: bool = False, problems: list[Problem] | None = None,
                       ) -> tuple[type[Strategy], ...]:
    """The strategy classes to apply, in apply order; a missing axis raises
    :class:`MissingAxisPackageError` naming its package (see :meth:`Resolution.require`)."""
    return resolve(config, pm, has_experts=has_experts).require(problems)
