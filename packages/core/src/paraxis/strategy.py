"""Strategies, the phases they apply in, and the order core applies them.

Core, not plugin load order, decides the order (DESIGN section 4), as torchtitan's
``parallelize_llama`` applies TP, then CP, then activation checkpointing, then FSDP/DDP:

1. SPLIT      pipeline stages: a stage must exist before its layers are partitioned;
2. PARTITION  tensor/sequence, expert, context: rewrite modules on one stage;
3. WRAP       activation checkpointing: wraps the partitioned blocks;
4. DATA       replicate (dp) or shard (zero) over data: sees final parameter shapes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from torch import nn

from paraxis.errors import MissingAxisPackageError, Problem

if TYPE_CHECKING:
    import pluggy

    from paraxis.config import ParallelConfig
    from paraxis.grid import Grid

__all__ = [
    "PACKAGE_FOR_AXIS",
    "ApplyContext",
    "GradientSync",
    "Phase",
    "Strategy",
    "apply_parallelism",
    "apply_strategies",
    "missing_axes",
    "required_axes",
    "resolve_strategies",
]


class Phase(IntEnum):
    SPLIT = 1
    PARTITION = 2
    WRAP = 3
    DATA = 4


# The distribution that provides each strategy axis, for the "pip install" hint.
PACKAGE_FOR_AXIS: dict[str, str] = {
    "pipeline": "paraxis-pp-schedules",
    "tensor": "paraxis-tp-layers",
    "expert": "paraxis-moe-ep",
    "context": "paraxis-seq-context",
    "data": "paraxis-dp-core",
    "zero": "paraxis-zero-shard",
    "activation_checkpointing": "paraxis",  # core's own
}


class GradientSync(Protocol):
    """What a data strategy hands the engine: gradients are reduced between backward
    and the optimizer step."""

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Within it, backward accumulates locally (non-final microbatches)."""
        ...

    def finish(self) -> float:
        """Complete every reduction of this step; return seconds spent blocked on it."""
        ...


@dataclass
class ApplyContext:
    """What strategies read and leave behind while a model is parallelized."""

    grid: Grid
    config: ParallelConfig
    plan: object | None = None
    grad_syncs: list[GradientSync] = field(default_factory=list)
    # (logits, labels) -> (summed loss, token count); an axis that leaves logits sharded
    # (vocab-parallel cross-entropy) replaces it.
    loss_fn: Callable[..., tuple[Any, int]] | None = None
    # Extra per-rank RNG streams (name -> object with get_state() / set_state(tensor)),
    # saved in checkpoints beside torch's default one.
    rng_streams: dict[str, Any] = field(default_factory=dict)
    # Anything an axis wants to expose to tests, benchmarks and metrics, by axis name.
    extras: dict[str, Any] = field(default_factory=dict)
    # The pipeline's runner: (microbatches, loss_fn, scale, train) -> summed loss; None
    # runs microbatches one after another in this process.
    forward_backward: Callable[..., Any] | None = None
    plugin_manager: Any = None

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for sync in self.grad_syncs:
                stack.enter_context(sync.no_sync())
            yield

    def finish_grad_sync(self) -> float:
        return sum(sync.finish() for sync in self.grad_syncs)


class Strategy:
    """One parallel axis' transformation of a model. Subclasses set ``axis`` and
    ``phase`` and implement :meth:`apply`."""

    axis: ClassVar[str]
    phase: ClassVar[Phase]

    def apply(self, model: nn.Module, ctx: ApplyContext) -> nn.Module:
        raise NotImplementedError


def required_axes(config: ParallelConfig) -> list[str]:
    """The strategy axes a configuration needs, in no particular order."""
    par = config.parallelism
    wanted = [a for a in ("pipeline", "tensor", "expert", "context") if getattr(par, a) > 1]
    # Gradients of dense parameters are averaged over data x expert x context.
    if par.zero > 0:
        wanted.append("zero")
    elif par.data * par.expert * par.context > 1:
        wanted.append("data")
    if config.schedule.activation_checkpointing != "none":
        wanted.append("activation_checkpointing")
    return wanted


def _setting(config: ParallelConfig, axis: str) -> tuple[str, Any]:
    """The config field that asks for ``axis`` (axes are named after their field)."""
    section = "parallelism" if axis in type(config.parallelism).model_fields else "schedule"
    return f"{section}.{axis}", getattr(getattr(config, section), axis)


def missing_axes(config: ParallelConfig, pm: pluggy.PluginManager) -> list[Problem]:
    """A problem for every required axis that no installed plugin provides."""
    from paraxis.plugins import collect_strategies

    available = collect_strategies(pm)
    return [Problem(*_setting(config, axis), f"no installed package provides the {axis} axis",
                    f"pip install {PACKAGE_FOR_AXIS[axis]}")
            for axis in required_axes(config) if axis not in available]


def resolve_strategies(config: ParallelConfig, pm: pluggy.PluginManager) -> list[type[Strategy]]:
    """The strategy classes to apply, in phase order; a missing axis names its package."""
    from paraxis.plugins import collect_strategies

    available = collect_strategies(pm)
    chosen = []
    for axis in required_axes(config):
        if axis not in available:
            raise MissingAxisPackageError(axis, PACKAGE_FOR_AXIS[axis])
        chosen.append(available[axis])
    return sorted(chosen, key=lambda cls: (cls.phase, cls.axis))


def apply_strategies(model: nn.Module, ctx: ApplyContext,
                     strategies: list[type[Strategy]]) -> nn.Module:
    for cls in sorted(strategies, key=lambda c: (c.phase, c.axis)):
        model = cls().apply(model, ctx)
    return model


def apply_parallelism(model: nn.Module, *, grid: Grid, config: ParallelConfig,
                      plugin_manager: pluggy.PluginManager | None = None,
                      plan: object | None = None) -> tuple[nn.Module, ApplyContext]:
    """Record placements, then apply every axis the config asks for, in phase order.

    Returns the (possibly rewritten) model and the context holding its gradient
    synchronizers. Collective: every rank of ``grid`` calls it with the same config.
    """
    from paraxis.placement import record_replicated
    from paraxis.plugins import make_plugin_manager

    pm = plugin_manager or make_plugin_manager()
    strategies = resolve_strategies(config, pm)
    record_replicated(model)
    ctx = ApplyContext(grid=grid, config=config, plan=plan, plugin_manager=pm)
    return apply_strategies(model, ctx, strategies), ctx
