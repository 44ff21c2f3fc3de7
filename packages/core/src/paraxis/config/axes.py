"""The axes of the process grid, as data: one table of what core knows about each axis.

Core holds four facts per axis (issue 33): its name, its place in the mesh, its role
(what its ranks hold apart, and so which parameters are replicated and averaged over
it) and the package that implements it. Every rule that used to list axis names by hand
(the mesh order, the ranks holding distinct samples or tokens, the groups dense and
expert gradients are averaged over, the package a missing axis needs) is derived from
the table here. An axis package adds an axis through the ``paraxis_register_axes`` hook
(:func:`paraxis.engine.plugins.axis_table` builds the run's table); its degree is set
under ``parallelism.axes`` in the configuration. docs/architecture.md ("Adding an axis")
gives the recipe, and ``tests/test_seventh_axis.py`` follows it.

Roles:

* ``stages``: ranks hold consecutive layers (pipeline): nothing is replicated over it.
* ``samples``: ranks hold distinct samples of each global batch (data): parameters are
  replicated over it and their gradients averaged there.
* ``experts``: ranks hold distinct samples and distinct experts (expert): dense
  parameters are replicated and averaged over it, expert parameters are split over it.
* ``tokens``: ranks hold distinct tokens of the same samples (context): parameters are
  replicated and averaged over it.
* ``model``: ranks hold parts of each layer for the same tokens (tensor): a parameter
  not split over it is replicated there, and its gradient is not averaged (every rank
  computed it from the same tokens).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

__all__ = ["BUILTIN_AXES", "ROLES", "AxisSpec", "AxisTable"]

Role = Literal["stages", "samples", "experts", "tokens", "model"]
ROLES: tuple[str, ...] = ("stages", "samples", "experts", "tokens", "model")


@dataclass(frozen=True)
class AxisSpec:
    """One axis of the grid: ``mesh`` orders the axes, outermost (slowest links) first;
    ``plan_part`` names the part of a model plan the axis rewrites modules from
    (:meth:`paraxis.parallel.model_plan.ModelPlan.require`), if any."""

    name: str
    mesh: int
    role: Role
    package: str
    plan_part: str | None = None

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"axis {self.name!r}: role {self.role!r} is not one of {ROLES}")
        if not self.name.isidentifier():
            raise ValueError(f"axis name {self.name!r} must be an identifier")


@dataclass(frozen=True)
class AxisTable:
    """The axes of a run, in mesh order, and the groups of them the rules need."""

    specs: tuple[AxisSpec, ...]

    def __post_init__(self) -> None:
        ordered = tuple(sorted(self.specs, key=lambda s: s.mesh))
        names = [s.name for s in ordered]
        places = [s.mesh for s in ordered]
        if len(set(names)) != len(names) or len(set(places)) != len(places):
            raise ValueError(f"axes must have distinct names and mesh places: "
                             f"{[(s.name, s.mesh) for s in ordered]}")
        object.__setattr__(self, "specs", ordered)

    def extended(self, specs: Iterable[AxisSpec]) -> AxisTable:
        """This table with ``specs`` added (a spec equal to one it has is ignored)."""
        new = [s for s in specs if s not in self.specs]
        return AxisTable((*self.specs, *new)) if new else self

    def _with(self, *roles: str) -> tuple[str, ...]:
        return tuple(s.name for s in self.specs if s.role in roles)

    @property
    def names(self) -> tuple[str, ...]:
        """Every axis, in mesh order, outermost first."""
        return tuple(s.name for s in self.specs)

    def spec(self, name: str) -> AxisSpec:
        for s in self.specs:
            if s.name == name:
                return s
        raise KeyError(f"unknown grid axis {name!r}; the axes are {list(self.names)}")

    @property
    def token_axes(self) -> tuple[str, ...]:
        """Axes whose ranks hold distinct tokens: dense parameters are replicated over
        them and their gradients averaged there (the dense replica group)."""
        return self._with("samples", "experts", "tokens")

    @property
    def sample_axes(self) -> tuple[str, ...]:
        """Axes whose ranks hold distinct samples of each global batch."""
        return self._with("samples", "experts")

    @property
    def expert_replica_axes(self) -> tuple[str, ...]:
        """Axes an expert parameter is replicated and averaged over (not the expert
        axis, which splits the experts)."""
        return self._with("samples", "tokens")

    @property
    def sequence_shard_axes(self) -> tuple[str, ...]:
        """Under sequence parallelism a module outside the tensor-parallel regions (a
        router) sees only its tensor rank's share of the sequence: these ranks hold
        distinct tokens there."""
        return self._with("samples", "experts", "tokens", "model")

    @property
    def replicated(self) -> tuple[str, ...]:
        """What a parameter is replicated over before any axis splits it: every axis
        but those of stages (a stage holds its own layers)."""
        return self._with("samples", "experts", "tokens", "model")

    @property
    def planned(self) -> dict[str, str]:
        """Axis -> the part of a model plan it needs when its degree is above one."""
        return {s.name: s.plan_part for s in self.specs if s.plan_part}


# Mesh places leave room between the built-in axes for ones a package adds.
BUILTIN_AXES = AxisTable((
    AxisSpec("pipeline", 100, "stages", "paraxis-pp-schedules", plan_part="pipeline"),
    AxisSpec("data", 200, "samples", "paraxis-dp-core"),
    AxisSpec("expert", 300, "experts", "paraxis-moe-ep", plan_part="expert"),
    AxisSpec("context", 400, "tokens", "paraxis-seq-context"),
    AxisSpec("tensor", 500, "model", "paraxis-tp-layers", plan_part="tensor"),
))
