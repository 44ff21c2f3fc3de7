"""``paraxis.parallelize``: the one call (DESIGN section 5), and how strategies apply.

:func:`preflight` checks everything that needs no process; :func:`apply_parallelism`
records every parameter's placement and applies the resolved strategies in phase order,
materializing a deferred (meta-device) model once the layout is known; :func:`parallelize`
does both around building the grid, then builds the optimizer and the engine and runs
the parity probe (:mod:`paraxis.engine.probe`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from paraxis.config.errors import ConfigError, Problem
from paraxis.config.parallel import ParallelConfig
from paraxis.config.rules import validate
from paraxis.config.run import TrainSection
from paraxis.config.shape import ModelShape
from paraxis.engine.compile import backend_of, compile_layers, graph_breaks
from paraxis.engine.engine import Engine
from paraxis.engine.lora import with_lora
from paraxis.engine.masks import MaskSupport, measure_masks
from paraxis.engine.optim import WarmupCosine
from paraxis.engine.plugins import axis_table, make_plugin_manager
from paraxis.engine.precision import precision_problems
from paraxis.engine.probe import Probe
from paraxis.engine.resolve import resolve
from paraxis.parallel.anatomy import Anatomy, find_anatomy
from paraxis.parallel.model_plan import ModelPlan, find_plan
from paraxis.parallel.optimizers import make_optimizer, optimizer_problems
from paraxis.parallel.placement import record_replicated
from paraxis.parallel.strategy import MATERIALIZE_ATTR, ApplyContext, Phase, Strategy, deferred
from paraxis.runtime.agreement import agreed
from paraxis.runtime.grid import Grid
from paraxis.runtime.world import device_for_rank, init_distributed, launched_world_size

if TYPE_CHECKING:
    import pluggy

__all__ = ["Preflight", "apply_parallelism", "apply_strategies", "build_optimizer",
           "find_twin", "parallelize", "preflight", "probe_twin"]


def build_optimizer(model: nn.Module, ctx: ApplyContext,
                    train: TrainSection) -> torch.optim.Optimizer:
    """The first applied strategy's optimizer, asked in reverse phase order (a data
    strategy that shards state answers first), else ``train.optimizer`` over the model's
    parameters (:mod:`paraxis.parallel.optimizers`)."""
    for strategy in reversed(ctx.strategies):
        optimizer = strategy.build_optimizer(model, ctx, train)
        if optimizer is not None:
            return optimizer
    return make_optimizer(model.parameters(), train)


@dataclass(frozen=True)
class Preflight:
    """What :func:`preflight` found, carried to :func:`apply_parallelism`: the model's
    shape (at the trained length), its plan, its anatomy, and the strategies to apply,
    resolved once, in apply order."""

    shape: ModelShape | None
    plan: ModelPlan
    anatomy: Anatomy
    strategies: tuple[type[Strategy], ...]


def preflight(model: nn.Module, config: ParallelConfig, *, train: TrainSection,
              plan: ModelPlan | None = None, model_shape: ModelShape | None = None,
              plugin_manager: Any = None, world_size: int | None = None,
              optimizer: Any = None) -> Preflight:
    """What :func:`parallelize` checks before any process group exists: the config
    against the world size (``world_size``, else the launched one) and the model's shape,
    every axis resolved to an installed package, the plan found and required for each
    axis that rewrites modules, the model's anatomy read. Raises the error
    ``parallelize`` would."""
    pm = plugin_manager or make_plugin_manager()
    if model_shape is None and hasattr(model, "config"):
        model_shape = ModelShape.from_hf_config(model.config)
    if model_shape is not None:  # what is split and counted is the trained length
        model_shape = dataclasses.replace(model_shape, seq_length=train.seq_length)
    model_plan = find_plan(model, pm, plan)
    anatomy = find_anatomy(model, model_plan)
    resolution = resolve(config, pm, has_experts=bool(model_plan.experts))
    # What only the module shows (a layout an axis does not know, an attention kernel it
    # cannot intercept) is reported with the configuration's problems, all at once.
    module_problems = [p for cls in resolution.strategies
                       for p in cls.check_model(model, config, model_plan, anatomy)]
    module_problems += model_plan.refusals(config)
    if optimizer is None:  # one given is the caller's; train.optimizer is ours to check
        module_problems += optimizer_problems(train, config)
    module_problems += precision_problems(train, optimizer)
    try:
        validate(config, world_size=world_size or launched_world_size(), model=model_shape,
                 plugin_manager=pm, extra=module_problems)
    except ConfigError as err:  # with a missing axis package named first, if there is one
        resolution.require(err.problems)
        raise
    strategies = resolution.require()  # a missing axis package fails here, before any group
    for axis, part in config.axis_table.planned.items():
        if config.degrees[axis] > 1:
            model_plan.require(part)
    return Preflight(model_shape, model_plan, anatomy, strategies)


def parallelize(
    model: nn.Module,
    *,
    data: int = 1,
    tensor: int = 1,
    pipeline: int = 1,
    expert: int = 1,
    context: int = 1,
    zero: int = 0,
    microbatches: int = 1,
    config: ParallelConfig | None = None,
    train: TrainSection | dict[str, Any] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    plan: ModelPlan | None = None,
    model_shape: ModelShape | None = None,
    plugin_manager: Any = None,
    verify: bool = True,
    **options: Any,
) -> Engine:
    """Lay ``model`` out over the grid and return an :class:`Engine` that trains it.

    The degrees (or ``config``, which wins) are validated against the launched world
    size and the model's shape before any process group exists; then the default group
    is joined (torchrun's, or a world of one), the grid built, the model's plan found
    (``plan`` or the first plugin that knows the model), and every axis applied in
    phase order. ``train`` holds the optimizer, schedule and clipping settings
    (:class:`paraxis.config.run.TrainSection`); ``optimizer`` replaces the default AdamW.
    A run config's ``lora`` section wraps ``model`` first (:mod:`paraxis.engine.lora`).
    """
    pm = plugin_manager or make_plugin_manager()
    if config is not None and options:
        raise TypeError(f"parallelize got both config= and options {sorted(options)}; "
                        "put the options in the config")
    if config is None:
        config = ParallelConfig.from_kwargs(data=data, tensor=tensor, pipeline=pipeline,
                                            expert=expert, context=context, zero=zero,
                                            microbatches=microbatches, **options)
    config = config.with_axes(axis_table(pm))
    train_cfg = train if isinstance(train, TrainSection) else TrainSection(**(train or {}))
    model = with_lora(model, config, pm)  # a run config's lora: section (engine.lora)
    checked = preflight(model, config, train=train_cfg, plan=plan, model_shape=model_shape,
                        plugin_manager=pm, optimizer=optimizer)
    model_shape, model_plan = checked.shape, checked.plan

    lazy = deferred(model)  # on the meta device until each rank reads its slices
    # No whole model: its twin's probe (and masks) stand for it; none is refused here.
    twin = find_twin(model, config, pm) if verify and lazy else None
    init_distributed()
    probed, masks = ("none (verify=False)" if not verify else "whole model"), None
    if twin is not None:
        probed, masks = probe_twin(twin, config, train=train_cfg, plan=plan,
                                   plugin_manager=pm)
    grid = Grid.build(config)
    device = device_for_rank()
    if not lazy:
        model.to(device)
    probe = None
    vocab = model_shape.vocab_size if model_shape else getattr(
        getattr(model, "config", None), "vocab_size", None)
    if verify and not lazy:
        masks = measure_masks(model, vocab or 2, model_plan.extra.get("forward_kwargs", {}))
    # The probe runs the whole model before the split.
    if verify and grid.world_size > 1 and not lazy:
        probe = Probe.before(model, config, seq_length=train_cfg.seq_length, vocab=vocab,
                             forward_kwargs=model_plan.extra.get("forward_kwargs", {}),
                             shape=model_shape, router_loss=bool(model_plan.experts))
    model, ctx = apply_parallelism(model, grid=grid, config=config, plugin_manager=pm,
                                   plan=model_plan, anatomy=checked.anatomy,
                                   strategies=checked.strategies)
    backend = backend_of(train_cfg.compile)
    if backend is not None:  # before the probe, which then checks the compiled layers
        layers = compile_layers(model, checked.anatomy, backend)
        ctx.extras["compile"] = f"{backend}, {layers} layers"
        ctx.step_hooks.append(graph_breaks())
    if optimizer is None:
        optimizer = build_optimizer(model, ctx, train_cfg)
    scheduler = WarmupCosine(optimizer, warmup=train_cfg.warmup_steps, total=train_cfg.steps,
                             min_ratio=train_cfg.min_lr_ratio, reschedule=train_cfg.reschedule)
    engine = Engine(model, grid=grid, config=config, ctx=ctx, optimizer=optimizer,
                    scheduler=scheduler, train=train_cfg, plan=model_plan, device=device,
                    model_shape=model_shape)
    if probe is not None and ctx.skip_verify is None:
        axes = " x ".join(f"{a} {d}" for a, d in config.degrees.items() if d > 1)
        router = probe.check(engine, axes)
        probed = f"{probed}; {router}" if router else probed
    ctx.extras["probe"] = probed if ctx.skip_verify is None else f"none: {ctx.skip_verify}"
    if masks is not None:  # an axis keeping documents apart itself overrides the family
        engine.masks = masks if ctx.documents_kept is None else \
            dataclasses.replace(masks, documents=None)
    return engine


def find_twin(model: nn.Module, config: ParallelConfig, plugin_manager: Any) -> nn.Module:
    """A shrunk twin of ``model`` (``paraxis_twin_model``) for the parity probe of a
    model that cannot run whole on a rank (its weights wait on the meta device); a
    ConfigError before any process group when no plugin can build one."""
    reason = "no installed plugin builds one"
    try:
        twin = plugin_manager.hook.paraxis_twin_model(model=model, config=config)
    except ValueError as exc:
        twin, reason = None, str(exc)
    if twin is None:
        raise ConfigError([Problem(
            "verify", True, f"{type(model).__name__} cannot run whole on one rank, so the "
            f"parity probe needs a shrunk twin of it, and there is none: {reason}",
            "pass verify=False to train without the parity probe, knowing that no check "
            "compared this layout with one process")])
    return twin


def probe_twin(twin: nn.Module, config: ParallelConfig, *, train: TrainSection,
               plan: ModelPlan | None, plugin_manager: Any) -> tuple[str, MaskSupport]:
    """The parity probe through ``twin`` (:func:`find_twin`): it goes through
    ``parallelize`` with the model's layout and plan, probed against itself in one
    process; its refusal is the model's. Returns what was probed and the twin's
    :class:`~paraxis.engine.masks.MaskSupport` (the family's). Collective."""
    twin_train = train.model_copy(update={"seq_length": min(train.seq_length, 64)})
    engine = parallelize(twin, config=config, train=twin_train, plan=plan,
                         plugin_manager=plugin_manager, verify=True)
    masks = engine.masks
    engine.close()
    size = sum(p.numel() for p in twin.parameters())
    return (f"twin: {type(twin).__name__} of {size:,} parameters through the same layout",
            masks)


def apply_strategies(model: nn.Module, ctx: ApplyContext,
                     strategies: tuple[type[Strategy], ...]) -> nn.Module:
    """Apply ``strategies`` (in apply order: :func:`paraxis.engine.resolve.apply_order`),
    materializing a deferred model before the first WRAP or DATA strategy that needs its
    storage."""
    materialize = getattr(model, MATERIALIZE_ATTR, None)
    for cls in strategies:
        if materialize is not None and cls.phase >= Phase.WRAP and not cls.takes_meta:
            _materialize(materialize, model, ctx)
            materialize = None
        strategy = cls()
        model = strategy.apply(model, ctx)
        ctx.strategies.append(strategy)
    if materialize is not None:
        _materialize(materialize, model, ctx)
    return model


def _materialize(materialize: Any, model: nn.Module, ctx: ApplyContext) -> None:
    """Each rank reads its own slices (pretrained weights): an error one rank meets is
    raised on every rank with its message (:func:`paraxis.runtime.agreement.agreed`)."""
    with agreed(ctx.grid.world, "materializing the model", known=(ConfigError,)):
        materialize(model)


def apply_parallelism(model: nn.Module, *, grid: Grid, config: ParallelConfig,
                      plugin_manager: pluggy.PluginManager | None = None,
                      plan: ModelPlan | None = None, anatomy: Anatomy | None = None,
                      strategies: tuple[type[Strategy], ...] | None = None,
                      ) -> tuple[nn.Module, ApplyContext]:
    """Record placements, then apply every axis the config asks for, in apply order.

    ``anatomy`` and ``strategies`` are what :func:`preflight` found (found here when not
    given). Returns the (possibly rewritten) model and the context holding its gradient
    synchronizers. Collective: every rank of ``grid`` calls it with the same config.
    """
    pm = plugin_manager or make_plugin_manager()
    if anatomy is None:
        anatomy = find_anatomy(model, plan)
    if strategies is None:
        strategies = resolve(config, pm, has_experts=bool(getattr(plan, "experts", ()))
                             ).require()
    record_replicated(model, grid.axes)
    ctx = ApplyContext(grid=grid, config=config, plan=plan, plugin_manager=pm,
                       anatomy=anatomy)
    return apply_strategies(model, ctx, strategies), ctx
