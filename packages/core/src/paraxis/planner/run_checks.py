"""What ``paraxis train`` and ``paraxis validate`` ask of the planner: the workload of a
run config, ``paraxis train --dry-run`` (the run's own layout planned and laid out on the
meta device) and ``validate --device-memory``'s warning when the plan says a layout will
not fit."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

import torch

from paraxis.parallel.optimizers import optimizer_state_bytes
from paraxis.planner.evaluate import evaluate
from paraxis.planner.inputs import Hardware, Workload
from paraxis.planner.model import ModelCounts, build_on_meta, count_model, load_model_source
from paraxis.planner.report import format_plan
from paraxis.planner.units import fmt_bytes, parse_bytes

__all__ = ["HEADROOM", "dry_run_verdict", "fit_warning", "load_counts", "run_workload",
           "train_dry_run"]

# The share of a device's memory left for fragmentation and workspaces.
HEADROOM = 0.1


def load_counts(model: str, seq: int | None = None, *, lora_rank: int | None = None,
                lora_targets: list[str] | None = None) -> tuple[ModelCounts, dict[str, Any]]:
    """The counts of ``model`` (a model dir, config.json or run YAML) built on the meta
    device, wrapped with LoRA adapters of ``lora_rank`` when given
    (:mod:`paraxis.planner.lora`), and the run defaults found beside it."""
    from paraxis.engine.plugins import make_plugin_manager
    from paraxis.planner.lora import adapted, lora_section

    pm = make_plugin_manager()
    source = load_model_source(model)
    with torch.device("meta"):
        built = build_on_meta(source, pm)
        if lora_rank is not None:
            built = adapted(built, lora_section(lora_rank, lora_targets), pm)
    return counts_of(built, source.family, seq, pm), source.defaults


def counts_of(model: Any, family: str, seq: int | None, pm: Any) -> ModelCounts:
    """:func:`count_model`, with a LoRA model's adapters counted trainable and the rest
    frozen (:func:`paraxis.planner.lora.with_adapters`)."""
    from paraxis.parallel.anatomy import find_anatomy
    from paraxis.parallel.model_plan import find_plan
    from paraxis.planner.lora import with_adapters

    plan = find_plan(model, pm, None)
    anatomy = find_anatomy(model, plan)
    return with_adapters(count_model(model, family, seq, anatomy), model, anatomy, plan)


def run_builder(model: str, lora_rank: int | None = None,
                lora_targets: list[str] | None = None) -> Callable[[], Any]:
    """What the run builds, for the dry run (called on the meta device): ``model``, with
    rank-``lora_rank`` adapters on ``lora_targets`` (:mod:`paraxis.planner.lora`)."""
    from paraxis.engine.plugins import make_plugin_manager
    from paraxis.planner.lora import adapted, lora_section

    source, pm = load_model_source(model), make_plugin_manager()
    if lora_rank is None:
        return lambda: build_on_meta(source, pm)
    lora = lora_section(lora_rank, lora_targets)
    return lambda: adapted(build_on_meta(source, pm), lora, pm)


def dry_run_verdict(run: Any, command: str) -> int:
    """0, or 1 with one line on stderr when the dry run disagrees with the plan."""
    if run is None or run.ok:
        return 0
    from paraxis.planner.dryrun import BOUND

    what = [f"{len(run.off)} row(s) beyond {BOUND:.0%}"] if run.off else []
    what += ["the stage cut: " + p for p in run.problems]
    print(f"{command}: the dry run disagrees with the plan: {'; '.join(what)}",
          file=sys.stderr)
    return 1


def run_workload(config: Any) -> Workload:
    """The workload of a run config: its sequence, batch, precision, reduction dtype and
    optimizer, micro-batch from the global batch over replicas and microbatches."""
    m = config.schedule.microbatches
    micro = max(1, config.train.global_batch // (config.sample_shards * m))
    return Workload(seq=config.train.seq_length, global_batch=config.train.global_batch,
                    micro_batch=micro, precision=config.train.precision,
                    reduce_dtype=config.parallelism.reduce_dtype,
                    optimizer_bytes=optimizer_state_bytes(config.train))


def train_dry_run(config: Any, *, build: Callable[[], Any], as_json: bool) -> int:
    """``paraxis train --config F --dry-run``: the run's own layout planned and laid out
    for real on the meta device (:mod:`paraxis.planner.dryrun`); ``build`` makes the
    model as the run does. Prints the plan and the dry run; 1 when they disagree."""
    from paraxis.planner.dryrun import dry_run, format_dry_run

    with torch.device("meta"):
        model = build()
    family = getattr(getattr(model, "config", None), "model_type", None) or \
        config.model.family
    from paraxis.engine.plugins import make_plugin_manager

    counts = counts_of(model, family, config.train.seq_length, make_plugin_manager())
    plan = evaluate(counts, config, run_workload(config), Hardware())
    run = dry_run(plan, build=build, train=config.train)
    if as_json:
        print(json.dumps({**plan.to_json(), "dry_run": run.to_json()}, indent=2))
    else:
        print(format_plan(plan) + "\n\n" + format_dry_run(run, plan.layout))
    return dry_run_verdict(run, "paraxis train --dry-run")


def fit_warning(config: Any, *, device_memory: str, model: str | None = None) -> str | None:
    """For ``paraxis validate --device-memory``: a warning naming the largest term when
    the plan says the run's layout will not fit, else None. Raises PlanInputError on an
    unreadable memory size or a model that cannot be built."""
    cap = parse_bytes(device_memory)
    if model:
        counts, _ = load_counts(model, config.train.seq_length)
    else:
        from paraxis.engine.plugins import make_plugin_manager
        from paraxis.planner.model import ModelSource

        source = ModelSource(config.model.family, dict(config.model.config), "model:", {})
        counts = count_model(build_on_meta(source, make_plugin_manager()), source.family,
                             config.train.seq_length)
    hw = Hardware(device_memory=cap, headroom=HEADROOM)
    plan = evaluate(counts, config, run_workload(config), hw, simulate=False)
    worst = plan.worst
    if plan.fits:
        return None
    term, size = worst.largest
    fixes = {"activations": "recompute (schedule.activation_checkpointing), sequence "
             "parallelism or a smaller micro-batch",
             "optimizer": "parallelism.zero >= 1 or more data-parallel ranks",
             "gradients": "parallelism.zero >= 2, tensor or pipeline parallelism",
             "parameters": "tensor or pipeline parallelism, or parallelism.zero: 3",
             "buffers": "a smaller parallelism.bucket_mb"}
    return (f"the plan says pipeline stage {worst.stage} needs {fmt_bytes(worst.total)} per "
            f"device, more than {fmt_bytes(cap)} less {HEADROOM:.0%} headroom for "
            f"fragmentation and workspaces; the largest term is {term} "
            f"({fmt_bytes(size)}): try {fixes[term]} (paraxis plan --model ... shows "
            "the breakdown)")
