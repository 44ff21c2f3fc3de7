"""The contract an axis implements: a :class:`Strategy`, the phase it applies in, the
:class:`ApplyContext` it reads and leaves things in, and the gradient synchronizers it
hands the engine. Which strategies a run needs and how they are found and applied is
the engine's (:mod:`paraxis.engine.resolve`, :mod:`paraxis.engine.apply`).

Core, not plugin load order, decides the order (DESIGN section 4), as torchtitan's
``parallelize_llama`` applies TP, then CP, then activation checkpointing, then FSDP/DDP:

1. SPLIT      pipeline stages: a stage must exist before its layers are partitioned;
2. PARTITION  tensor/sequence, expert, context: rewrite modules on one stage;
3. WRAP       activation checkpointing: wraps the partitioned blocks;
4. DATA       replicate (dp) or shard (zero) over data: sees final parameter shapes.

Within a phase each strategy declares its place (:attr:`Strategy.order`, lower first;
docs/architecture.md lists them and why).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch
from torch import nn

from paraxis.config.errors import Problem
from paraxis.parallel.anatomy import Anatomy
from paraxis.parallel.aux_losses import AuxLosses
from paraxis.parallel.batch import Batch

if TYPE_CHECKING:
    from paraxis.config.parallel import ParallelConfig
    from paraxis.runtime.grid import Grid

__all__ = [
    "MATERIALIZE_ATTR",
    "ApplyContext",
    "GradientSync",
    "Phase",
    "PipelineLayout",
    "Strategy",
    "SyncOrder",
    "deferred",
]


class Phase(IntEnum):
    SPLIT = 1
    PARTITION = 2
    WRAP = 3
    DATA = 4


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
    # What the model is made of (paraxis.parallel.anatomy), found once before any group
    # exists; the one answer to "which module is the head, which are the layers".
    anatomy: Anatomy = field(default_factory=lambda: Anatomy.unknown("no model"))
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
    # The engine's precision region (autocast under bf16/fp16, nothing in fp32 or in the
    # probe), for a forward a strategy runs itself (the pipeline's); set by the engine.
    forward_context: Callable[[], contextlib.AbstractContextManager[Any]] = \
        contextlib.nullcontext
    # How many ways the activations passed between pipeline stages are split along the
    # sequence after the batch transforms (tensor x sequence parallel sets it).
    activation_sequence_shards: int = 1
    # Per-step transforms of this rank's Batch, applied in order before microbatching
    # (context parallel cuts the sequence here).
    batch_transforms: list[Callable[[Batch], Batch]] = field(default_factory=list)
    # Losses besides next-token cross-entropy (router losses), see paraxis.parallel.batch.
    aux_losses: AuxLosses = field(default_factory=AuxLosses)
    # loss -> None, called instead of ``loss.backward()`` by the engine; set by a
    # strategy that owns backward, gradient reduction and the optimizer step (the
    # DeepSpeed bridge: engine.backward with its own accumulation boundary).
    backward: Callable[[Any], None] | None = None
    # Called on every rank after each optimizer step (collective where they need);
    # each returns metrics to merge into the step's (the same on every rank) or None.
    step_hooks: list[Callable[[], dict[str, float] | None]] = field(default_factory=list)
    # Why the parity probe of parallelize (paraxis.engine.probe) cannot apply, if an axis's
    # arithmetic legitimately differs from one process (expert capacity drops tokens).
    skip_verify: str | None = None
    # How an axis keeps packed documents apart in every sequence mixer itself (context
    # parallel: attention by document ids, recurrent states reset), where it does: the
    # engine then takes packed rows the family's own one-process masks would mix.
    documents_kept: str | None = None
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
    # The strategy's place within its phase, lower first (engine.resolve.apply_order
    # refuses two of one phase with the same order).
    order: ClassVar[int] = 0
    # A WRAP or DATA strategy that may see a deferred model's parameters still on the
    # meta device (see MATERIALIZE_ATTR): it needs no storage (activation checkpointing)
    # or materializes what it keeps itself (ZeRO-3). Core materializes after it.
    takes_meta: ClassVar[bool] = False

    def apply(self, model: nn.Module, ctx: ApplyContext) -> nn.Module:
        raise NotImplementedError

    def build_optimizer(self, model: nn.Module, ctx: ApplyContext,
                        train: Any) -> torch.optim.Optimizer | None:
        """The optimizer for ``model``, or None to leave it to another strategy or to
        core's AdamW. Called by ``parallelize`` after every axis applied, on the applied
        strategies in reverse phase order (data first); the first answer wins.

        ``train`` is the :class:`paraxis.config.run.TrainSection`. An optimizer that
        owns gradient shards also implements ``clip_grad_norm(max_norm) -> float`` (the
        global norm before clipping), which the engine then calls instead of its own;
        its parameters (the tensors whose state it keeps) carry placement records, so
        checkpoints store that state where it lives."""
        return None

    @classmethod
    def check_model(cls, model: nn.Module, config: ParallelConfig, plan: object | None,
                    anatomy: Anatomy) -> list[Problem]:
        """What this axis cannot do with ``model`` (a module layout it does not know),
        found by looking at the module tree (and its ``anatomy``) before any process
        group exists. Called by ``parallelize`` on every resolved strategy; all problems
        are raised together as one :class:`~paraxis.config.errors.ConfigError`.
        Default: none."""
        return []


# A model built on the meta device (paraxis_hf.from_pretrained) carries, under this
# attribute, a callable ``(model) -> None`` that gives every parameter still on the meta
# device its real data: only this rank's slice, read through its placement. Core calls
# it once the layout is known (after the SPLIT and PARTITION phases) and before any
# WRAP or DATA strategy sees a parameter, unless the strategy ``takes_meta``; then after
# it, for what is still on the meta device. The callable may also offer ``fill(record,
# out)``: write the real blocks of the tensor ``record`` (a Placement) describes into
# ``out`` (of its local shape), so that a strategy which shards further (ZeRO-3) draws
# its own shard alone; and ``device``, where the tensors go (None: the rank's device).
MATERIALIZE_ATTR = "paraxis_materialize"


def deferred(model: nn.Module) -> bool:
    """Whether ``model``'s parameters wait on the meta device for their data."""
    return callable(getattr(model, MATERIALIZE_ATTR, None))


