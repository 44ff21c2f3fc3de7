"""The hook specifications: the only coupling between paraxis packages (DESIGN section 4).

Every plugin is a module named by an entry point in the ``paraxis`` group; it implements
some of these hooks with :data:`hookimpl`. A test fails when a spec here has no docstring.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from paraxis.config.axes import AxisSpec
    from paraxis.config.errors import Problem
    from paraxis.config.parallel import ParallelConfig
    from paraxis.config.shape import ModelShape
    from paraxis.parallel.sink import MetricSink
    from paraxis.parallel.strategy import ApplyContext, Strategy
    from paraxis.parallel.summary import RunReport

__all__ = ["hookimpl", "hookspec"]

PROJECT = "paraxis"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def paraxis_register_strategies(register: Callable[[type[Strategy]], None]) -> None:
    """Hand this plugin's strategy classes to ``register``.

    Called once by :func:`paraxis.engine.plugins.collect_strategies` when a run resolves its
    axes. ``register`` takes a :class:`paraxis.parallel.strategy.Strategy` subclass; registering
    two classes for the same axis is an error. Plugins must register here, never as a
    side effect of being imported. Not firstresult: every plugin is called.
    """


@hookspec
def paraxis_register_axes(register: Callable[[AxisSpec], None]) -> None:
    """Hand ``register`` each grid axis this plugin adds (a
    :class:`paraxis.config.axes.AxisSpec`: its name, mesh place, role and package).

    Called once by :func:`paraxis.engine.plugins.axis_table` when a run reads its
    configuration, before any process group exists; the built-in axes (pipeline, data,
    expert, context, tensor) are core's and need no plugin. An axis' degree is then read
    from ``parallelism.axes`` and its strategy registered as any other
    (:func:`paraxis_register_strategies`). Two plugins registering one name with
    different specs is an error. Not firstresult: every plugin is called.
    """


@hookspec
def paraxis_validate_config(
    config: ParallelConfig, model: ModelShape | None, problems: list[Problem]
) -> None:
    """Append the plugin's own rules' :class:`paraxis.config.errors.Problem` items to ``problems``.

    Called by :func:`paraxis.config.rules.validate` after core's rules and before any
    process group exists. ``model`` is None when no model shape is known. Append every
    problem found (do not raise), so the user sees all of them at once. Not firstresult.
    """


@hookspec(firstresult=True)
def paraxis_model_plan(model: Any) -> Any:
    """Return the parallel plan for ``model``, or None if this plugin does not know it.

    Called by core when an axis that rewrites modules (tensor, pipeline, expert) needs a
    plan and the user gave none. firstresult: the first non-None answer wins.
    """


@hookspec(firstresult=True)
def paraxis_build_model(family: str, config: dict[str, Any]) -> Any:
    """Build a model of ``family`` from the ``config`` mapping, or return None.

    Called by :func:`paraxis.train.build.build_model` for every family core does not build
    itself (core builds ``tiny``). paraxis-hf answers for transformers model types,
    building from config only (nothing is downloaded). firstresult.
    """


@hookspec(firstresult=True)
def paraxis_build_deferred(family: str, config: dict[str, Any], seed: int) -> Any:
    """Build a model of ``family`` from ``config`` on the meta device, or return None.

    Called by :func:`paraxis.train.build.build_model` before ``paraxis_build_model``
    when no construction context answered (``paraxis_model_context``). The model carries
    a materializer (``paraxis.parallel.strategy.MATERIALIZE_ATTR``) that gives each rank
    only the pieces its placements own, with values that depend on (``seed``, parameter
    name, element) alone, so every layout starts from the same model. paraxis-hf
    answers for transformers model types whose init it can replay piece by piece and
    returns None (with a warning saying why) for the others, which are then built whole.
    firstresult.
    """


@hookspec(firstresult=True)
def paraxis_load_pretrained(directory: str, config: dict[str, Any]) -> Any:
    """A model of the weights saved in ``directory`` (``model.pretrained``), its config
    fields overridden by ``config``, or None. Called by
    :func:`paraxis.train.build.build_model` when ``model.pretrained`` is set. paraxis-hf
    answers for ``save_pretrained`` directories, building on the meta device so that
    ``parallelize`` reads each rank's slices only
    (``paraxis.parallel.strategy.MATERIALIZE_ATTR``). firstresult.
    """


@hookspec(firstresult=True)
def paraxis_model_context(config: Any) -> Any:
    """A context manager to construct the model in, or None (build it whole).

    Called by :func:`paraxis.train.loop.train` with the :class:`paraxis.config.run.RunConfig`
    on every rank, after the default process group exists and before the model is built.
    paraxis-deepspeed answers under ZeRO-3 offload with ``deepspeed.zero.Init``, so a
    model larger than one rank's memory is constructed partitioned. A model built in such
    a context cannot run whole on one rank, so the trainer skips the parity probe of
    ``parallelize`` for it (as ``verify=False``). firstresult.
    """


@hookspec
def paraxis_metric_sinks(config: Any, directory: str) -> list[MetricSink] | None:
    """The sinks this plugin adds to a run (:class:`paraxis.parallel.sink.MetricSink`
    objects: where metrics, figures and the summary go), or None when its section of
    ``config`` leaves it off.

    Called once per run by the trainer (:func:`paraxis.train.sinks.open_sinks`) on the
    logging rank only (the first rank of the last pipeline stage), before the first step,
    with the :class:`paraxis.config.run.RunConfig` and the run's directory (where core
    writes ``metrics.jsonl``: ``logging.dir``, else the checkpoint directory). Core's own
    sinks (console, ``metrics.jsonl``) come first; paraxis-wandb answers with a W&B run,
    paraxis-tensorboard with an event file. A sink must never block training on its
    service; one that raises is switched off with a warning. Not firstresult: every
    plugin's sinks are used.
    """


@hookspec(firstresult=True)
def paraxis_stage_calls(model: Any, plan: Any) -> Any:
    """Return how to run ``model`` as a pipeline stage (a
    :class:`paraxis.parallel.stages.StageCalls`: ``logits(model, **kwargs)`` and
    ``hidden(model, **kwargs)``, taking ``input_ids`` or ``inputs_embeds``), or None if
    this plugin does not know the model.

    Called by the pipeline strategy once per run. Core builds every stage from it: the
    model itself with other stages' layers skipped (:mod:`paraxis.parallel.stages`), so a stage
    runs the model's own forward. Core answers for its ``tiny`` model, paraxis-hf for
    transformers causal LMs. firstresult.
    """


@hookspec
def paraxis_cli_commands(subparsers: Any) -> None:
    """Add subcommands to the ``paraxis`` command line (argparse ``subparsers``); each
    sets ``func`` to a callable taking the parsed arguments and returning an exit code.

    Called by :func:`paraxis.cli.main.build_parser` once. Not firstresult.
    """


@hookspec
def paraxis_checkpoint_commands(verbs: Any) -> None:
    """Add verbs under ``paraxis checkpoint`` (argparse subparsers of that command; each
    sets ``func`` like :func:`paraxis_cli_commands`). paraxis-hf adds ``export-hf``.
    Called by :func:`paraxis.cli.checkpoint.add_checkpoint_commands` once. Not
    firstresult.
    """


@hookspec
def paraxis_summarize_run(ctx: ApplyContext, history: list[dict[str, float]]
                          ) -> RunReport | None:
    """What this plugin adds to the end of a run (a :class:`paraxis.parallel.summary.RunReport`:
    summary values, table rows, figures, lines to print), or None.

    Called by the trainer on every rank after the last step, with the run's context and
    this run's step metrics, in plugin order; an implementation may be collective (the
    pipeline gathers its measured timeline), so it must do the same collectives on every
    rank. paraxis-pp-schedules reports the measured pipeline timeline, paraxis-moe-ep the
    most and least loaded expert. Not firstresult: every answer is shown.
    """


@hookspec(firstresult=True)
def paraxis_pipeline_bubble(schedule: str, stages: int, microbatches: int,
                            virtual_stages: int) -> float | None:
    """The idle share of a pipeline step for ``schedule`` with unit forward, backward
    and weight-gradient costs, from a dry run of the schedule, or None when this plugin
    does not simulate it.

    Called by the planner (:func:`paraxis.planner.schedule.bubble`) for small schedules;
    paraxis-pp-schedules answers from its simulator, so the planner and the executor
    read one definition of each schedule. Without it the planner uses the closed form.
    firstresult.
    """


@hookspec(firstresult=True)
def paraxis_twin_model(model: Any, config: ParallelConfig) -> Any:
    """A shrunk twin of ``model`` for the layout ``config`` (same class and plan, tiny
    sizes that the layout's degrees divide, weights on the CPU), or None if this plugin
    does not know the model; raise ``ValueError`` naming why a model it knows cannot be
    shrunk.

    Called by :func:`paraxis.engine.apply.parallelize` for a model that cannot run whole
    on one rank (its weights wait on the meta device), whose parity probe then runs on
    the twin through the same layout. paraxis-hf answers for transformers models.
    firstresult.
    """


@hookspec(firstresult=True)
def paraxis_apply_lora(model: Any, lora: Any) -> Any:
    """``model`` with the low-rank adapters of ``lora`` (a
    :class:`paraxis.config.lora.LoraSection`), every other weight frozen, or None if this
    plugin does not adapt such models; raise :class:`paraxis.config.errors.ConfigError`
    for a section the model cannot take (a target matching no module, a model already
    wrapped by peft), one problem per line.

    Called by the trainer (:func:`paraxis.train.build.build_model`) once the model is
    built, before ``parallelize``; paraxis-hf answers through peft. firstresult.
    """


@hookspec(firstresult=True)
def paraxis_lora_problems(config: Any) -> list[Problem] | None:
    """What is wrong with ``config.lora`` (a run's config) for ``config.model``, found on
    the model's structure alone (built on the meta device): each target that matches no
    module, a model family the adapters cannot wrap. None if this plugin does not adapt
    models (the caller then names the package to install).

    Called by ``paraxis validate`` and ``paraxis train`` before any process starts, and
    by the trainer before any process group. firstresult.
    """


@hookspec
def paraxis_before_workers(config: Any) -> None:
    """Do once, before the workers exist, what each worker's copy of the plugin would do
    alike: import a heavy module, start a service the workers then share.

    Called by ``paraxis train``'s launcher with the :class:`paraxis.config.run.RunConfig`,
    after the configuration passed every check and only where the workers are forked
    from the launcher (:mod:`paraxis.train.forked`), so they inherit what it did; never
    under plain torchrun. paraxis-wandb imports W&B and starts its service here. Must not
    raise or touch an accelerator. Not firstresult.
    """
