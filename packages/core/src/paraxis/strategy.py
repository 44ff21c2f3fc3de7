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

import torch
from torch import nn

from paraxis.batch import AuxLosses, Batch
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
    "PipelineLayout",
    "Strategy",
    "SyncOrder",
    "apply_parallelism",
    "apply_strategies",
    "deferred",
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
    "offload": "paraxis-deepspeed",
    "activation_checkpointing": "paraxis",  # core's own
}


class SyncOrder(IntEnum):
    """When a gradient synchronizer finishes, relative to the others (the contract of
    Megatron-Core's ``finalize_model_grads``): data-parallel reductions, which may still
    be in flight from backward hooks, complete first; then partial sums over the tensor
    axis (norms under sequence parallelism) rewrite the reduced gradients; then the
    gradient of an embedding tied across pipeline stages is summed over its stages.
    Every reduction is linear, so this order changes no value; it exists so that no
    synchronizer touches a gradient another still has in flight."""

    DATA = 10
    PARTIAL = 20
    TIED = 30


class GradientSync(Protocol):
    """What a strategy hands the engine: gradients are reduced between backward and the
    optimizer step. ``order`` (a :class:`SyncOrder`) places it among the others."""

    order: int

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Within it, backward accumulates locally (non-final microbatches)."""
        ...

    def finish(self) -> float:
        """Complete every reduction of this step; return seconds spent blocked on it."""
        ...


@dataclass(frozen=True)
class PipelineLayout:
    """What a pipeline split declares for the axes applied after it (``ctx.pipeline``).

    ``stages`` are the global stage indices this rank holds (one per model chunk, in
    chunk order); ``ranges`` the layer range ``[a, b)`` of every global stage."""

    stages: tuple[int, ...]
    ranges: tuple[tuple[int, int], ...]

    @property
    def num_stages(self) -> int:
        return len(self.ranges)

    @property
    def holds_first_layer(self) -> bool:
        return 0 in self.stages

    @property
    def holds_last_layer(self) -> bool:
        return self.num_stages - 1 in self.stages

    def layers_of(self, chunk: int) -> range:
        """Indices (in the model's whole layer list) of the layers chunk ``chunk`` runs."""
        return range(*self.ranges[self.stages[chunk]])


@dataclass
class ApplyContext:
    """What strategies read and leave behind while a model is parallelized.

    Every field one axis sets for another is declared here (no axis reads another's
    ``extras``, which exist for tests, benchmarks and metrics only).
    """

    grid: Grid
    config: ParallelConfig
    plan: object | None = None
    plugin_manager: Any = None
    # The strategy instances applied, in phase order.
    strategies: list[Strategy] = field(default_factory=list)
    # Finished by the engine in SyncOrder, stable within one order.
    grad_syncs: list[GradientSync] = field(default_factory=list)
    # (logits, targets) -> (summed loss, token count), targets already shifted; an axis
    # that leaves logits sharded (vocab-parallel cross-entropy) replaces it.
    loss_fn: Callable[..., tuple[Any, int]] | None = None
    # Extra per-rank RNG streams (name -> object with get_state() / set_state(tensor)),
    # saved in checkpoints beside torch's default one.
    rng_streams: dict[str, Any] = field(default_factory=dict)
    # The pipeline split (SPLIT phase) of this rank; None without a pipeline.
    pipeline: PipelineLayout | None = None
    # The pipeline's runner: (microbatches, loss_fn, scale, train) -> summed loss; None
    # runs microbatches one after another in this process.
    forward_backward: Callable[..., Any] | None = None
    # How many ways the activations passed between pipeline stages are split along the
    # sequence after the batch transforms (tensor x sequence parallel sets it).
    activation_sequence_shards: int = 1
    # Per-step transforms of this rank's Batch, applied in order before microbatching
    # (context parallel cuts the sequence here).
    batch_transforms: list[Callable[[Batch], Batch]] = field(default_factory=list)
    # Losses besides next-token cross-entropy (router losses), see paraxis.batch.
    aux_losses: AuxLosses = field(default_factory=AuxLosses)
    # loss -> None, called instead of ``loss.backward()`` by the engine; set by a
    # strategy that owns backward, gradient reduction and the optimizer step (the
    # DeepSpeed bridge: engine.backward with its own accumulation boundary).
    backward: Callable[[Any], None] | None = None
    # Called on every rank after each optimizer step (collective where they need);
    # each returns metrics to merge into the step's (the same on every rank) or None.
    step_hooks: list[Callable[[], dict[str, float] | None]] = field(default_factory=list)
    # Why the parity probe of parallelize (paraxis.verify) cannot apply, if an axis's
    # arithmetic legitimately differs from one process (expert capacity drops tokens).
    skip_verify: str | None = None
    # Anything an axis wants to expose to tests, benchmarks and metrics, by axis name.
    extras: dict[str, Any] = field(default_factory=dict)

    def ordered_syncs(self) -> list[GradientSync]:
        return sorted(self.grad_syncs, key=lambda s: getattr(s, "order", SyncOrder.DATA))

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for sync in self.ordered_syncs():
                stack.enter_context(sync.no_sync())
            yield

    def finish_grad_sync(self) -> float:
        """Finish every synchronizer in :class:`SyncOrder`; seconds blocked."""
        return sum(sync.finish() for sync in self.ordered_syncs())


class Strategy:
    """One parallel axis' transformation of a model. Subclasses set ``axis`` and
    ``phase`` and implement :meth:`apply`; a strategy that shards optimizer state also
    implements :meth:`build_optimizer`."""

    axis: ClassVar[str]
    phase: ClassVar[Phase]

    def apply(self, model: nn.Module, ctx: ApplyContext) -> nn.Module:
        raise NotImplementedError

    def build_optimizer(self, model: nn.Module, ctx: ApplyContext,
                        train: Any) -> torch.optim.Optimizer | None:
        """The optimizer for ``model``, or None to leave it to another strategy or to
        core's AdamW. Called by ``parallelize`` after every axis applied, on the applied
        strategies in reverse phase order (data first); the first answer wins.

        ``train`` is the :class:`paraxis.run_config.TrainSection`. An optimizer that
        owns gradient shards also implements ``clip_grad_norm(max_norm) -> float`` (the
        global norm before clipping), which the engine then calls instead of its own;
        its parameters (the tensors whose state it keeps) carry placement records, so
        checkpoints store that state where it lives."""
        return None

    @classmethod
    def check_model(cls, model: nn.Module, config: ParallelConfig,
                    plan: object | None) -> list[Problem]:
        """What this axis cannot do with ``model`` (a module layout it does not know),
        found by looking at the module tree before any process group exists. Called by
        ``parallelize`` on every resolved strategy; all problems are raised together as
        one :class:`~paraxis.errors.ConfigError`. Default: none."""
        return []


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
    elif par.data * par.expert * par.context > 1:
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
    from paraxis.plugins import collect_strategies

    available = collect_strategies(pm)
    return [Problem(*_setting(config, axis), f"no installed package provides the {axis} axis"
                    + (" (a mixture-of-experts model trains with its router losses)"
                       if axis == "expert" and has_experts else ""),
                    f"pip install {PACKAGE_FOR_AXIS[axis]}")
            for axis in required_axes(config, has_experts=has_experts) if axis not in available]


def resolve_strategies(config: ParallelConfig, pm: pluggy.PluginManager, *,
                       has_experts: bool = False) -> list[type[Strategy]]:
    """The strategy classes to apply, in phase order; a missing axis names its package."""
    from paraxis.plugins import collect_strategies

    available = collect_strategies(pm)
    chosen = []
    for axis in required_axes(config, has_experts=has_experts):
        if axis not in available:
            raise MissingAxisPackageError(axis, PACKAGE_FOR_AXIS[axis])
        chosen.append(available[axis])
    return sorted(chosen, key=lambda cls: (cls.phase, cls.axis))


# A model built on the meta device (paraxis_hf.from_pretrained) carries, under this
# attribute, a callable ``(model) -> None`` that gives every parameter still on the meta
# device its real data: only this rank's slice, read through its placement. Core calls
# it once the layout is known (after the SPLIT and PARTITION phases) and before any
# WRAP or DATA strategy sees a parameter.
MATERIALIZE_ATTR = "paraxis_materialize"


def deferred(model: nn.Module) -> bool:
    """Whether ``model``'s parameters wait on the meta device for their data."""
    return callable(getattr(model, MATERIALIZE_ATTR, None))


def apply_strategies(model: nn.Module, ctx: ApplyContext,
                     strategies: list[type[Strategy]]) -> nn.Module:
    materialize = getattr(model, MATERIALIZE_ATTR, None)
    for cls in sorted(strategies, key=lambda c: (c.phase, c.axis)):
        if materialize is not None and cls.phase >= Phase.WRAP:
            materialize(model)
            materialize = None
        strategy = cls()
        model = strategy.apply(model, ctx)
        ctx.strategies.append(strategy)
    if materialize is not None:
        materialize(model)
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
    strategies = resolve_strategies(config, pm, has_experts=bool(getattr(plan, "experts", ())))
    record_replicated(model)
    ctx = ApplyContext(grid=grid, config=config, plan=plan, plugin_manager=pm)
    return apply_strategies(model, ctx, strategies), ctx
