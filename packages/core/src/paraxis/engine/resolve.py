"""Which strategies a run needs, and the installed packages that provide them.

:func:`required_axes` reads the configuration (and whether the model has
mixture-of-experts blocks); :func:`resolve_strategies` maps each axis to the class an
installed plugin registered, or fails with the ``pip install`` that provides it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from paraxis.config.errors import MissingAxisPackageError, Problem
from paraxis.engine.plugins import collect_strategies
from paraxis.parallel.strategy import Strategy

if TYPE_CHECKING:
    import pluggy

    from paraxis.config.parallel import ParallelConfig

__all__ = ["PACKAGE_FOR_AXIS", "installed_strategies", "missing_axes", "required_axes",
           "resolve_strategies"]


# The distribution that provides each strategy axis, for the "pip install" hint.
PACKAGE_FOR_AXIS: dict[str, str] = {
    "pipeline": "paraxis-pp-schedules",
    "tensor": "paraxis-tp-layers",
    "expert": "paraxis-moe-ep",
    "context": "paraxis-seq-context",
    "data": "paraxis-dp-core",
    "zero": "paraxis-zero-shard",
    "offload": "paraxis-deepspeed",
    "activation_checkpointing": "paraxis",  # core's own
}


def required_axes(config: ParallelConfig, *, has_experts: bool = False) -> list[str]:
    """The strategy axes a configuration needs, in no particular order. A model with
    mixture-of-experts blocks (``has_experts``: its plan names some) always needs the
    expert axis, even at degree 1: its router losses and statistics live there."""
    par = config.parallelism
    wanted = [a for a in ("pipeline", "tensor", "expert", "context") if getattr(par, a) > 1]
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
    """The config field that asks for ``axis`` (axes are named after their field)."""
    section = "parallelism" if axis in type(config.parallelism).model_fields else "schedule"
    return f"{section}.{axis}", getattr(getattr(config, section), axis)


def missing_axes(config: ParallelConfig, pm: pluggy.PluginManager, *,
                 has_experts: bool = False) -> list[Problem]:
    """A problem for every required axis that no installed plugin provides."""
    available = collect_strategies(pm)
    return [Problem(*_setting(config, axis), f"no installed package provides the {axis} axis"
                    + (" (a mixture-of-experts model trains with its router losses)"
                       if axis == "expert" and has_experts else ""),
                    f"pip install {PACKAGE_FOR_AXIS[axis]}")
            for axis in required_axes(config, has_experts=has_experts) if axis not in available]


def resolve_strategies(config: ParallelConfig, pm: pluggy.PluginManager, *,
                       has_experts: bool = False, problems: list[Problem] | None = None,
                       ) -> list[type[Strategy]]:
    """The strategy classes to apply, in phase order. A missing axis raises
    :class:`MissingAxisPackageError` naming its package, together with ``problems`` (the
    configuration's other problems, so one message says everything)."""
    available = collect_strategies(pm)
    chosen = []
    for axis in required_axes(config, has_experts=has_experts):
        if axis not in available:
            found = [*missing_axes(config, pm, has_experts=has_experts), *(problems or [])]
            raise MissingAxisPackageError(axis, PACKAGE_FOR_AXIS[axis], found)
        chosen.append(available[axis])
    return sorted(chosen, key=lambda cls: (cls.phase, cls.axis))


def installed_strategies(config: ParallelConfig, pm: pluggy.PluginManager, *,
                         has_experts: bool = False) -> list[type[Strategy]]:
    """The required strategies whose package is installed, in phase order (their
    ``check_model`` runs even when another axis' package is missing)."""
    available = collect_strategies(pm)
    return sorted((available[a] for a in required_axes(config, has_experts=has_experts)
                   if a in available), key=lambda cls: (cls.phase, cls.axis))
