"""``paraxis plan --dry-run`` and ``paraxis train --dry-run``: the layout built for
real, at any world size, on one CPU, and compared with the plan.

For two ranks of each pipeline stage, its first (every other coordinate 0) and its last
(every other axis at its last coordinate: the last shards of data, expert, context and
tensor at once, where padding lands, a vocabulary's or ZeRO's), the model is built the
way the run builds it, on the meta device, joined to a *fake* process group of the whole
world (torch's ``fake`` backend: collectives return at once, nothing moves) and laid out
by :func:`paraxis.parallelize` exactly as a real run lays it out: the pipeline split,
tensor shards, expert shards and ZeRO's partitions are real tensor shapes, only without
storage. Nothing is materialized and no parity probe runs. The model is held in the
dtype the run holds: fp32 master weights under every ``train.precision``, whatever a
config.json's ``torch_dtype`` says (paraxis-hf builds it so; a dry run that read
``torch_dtype`` once measured every parameter and gradient at 0.5 of the plan).

The rest of a step then runs without its forward
(:func:`~paraxis.planner.measure.end_step_without_forward`): the gradient synchronizers
finish, creating every gradient buffer the engine keeps where it keeps it (data-parallel
buckets, ZeRO-1's padded whole gradients and its reduce-scatter staging, ZeRO-2 and 3's
gradient shards), autograd gives the rest theirs, and the optimizer's first step creates
its state. The bytes are read from the storages (:func:`~paraxis.planner.measure.
held_model_state`) and compared with the plan's parameters, gradients and optimizer
state for that stage, within :data:`BOUND`. Activations and transient buffers are not
compared: no forward runs.

The stage cut is checked apart from the function the planner and the pipeline axis
share (:mod:`paraxis.planner.stage_cut`): the layers each stage holds are counted from
its built modules.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from paraxis.config.parallel import AXES, ParallelConfig
from paraxis.config.run import TrainSection
from paraxis.engine.plugins import make_plugin_manager
from paraxis.parallel.anatomy import find_anatomy
from paraxis.parallel.model_plan import find_plan
from paraxis.planner.evaluate import Plan
from paraxis.planner.schedule import layout_chunks
from paraxis.planner.stage_cut import Chunks, cut_problems, held_layers

__all__ = ["BOUND", "DryRow", "DryRun", "dry_run", "format_dry_run", "measured_ranks"]

TERMS = ("parameters", "gradients", "optimizer")
# Issue 24's target, kept by issue 32: every stage's parameters, gradients and optimizer
# state, on its first and its last rank, within 2% of the plan.
BOUND = 0.02


@dataclass(frozen=True)
class DryRow:
    stage: int
    rank: int
    which: str  # "first" or "last" rank of the stage
    term: str
    planned: float
    measured: float

    @property
    def ratio(self) -> float:
        return self.measured / self.planned if self.planned else float("inf")


@dataclass(frozen=True)
class DryRun:
    rows: list[DryRow]
    layers: dict[int, list[Chunks]]  # per pipeline rank, per measured rank, per chunk
    planned_layers: dict[int, list[tuple[int, int]]]  # per pipeline rank: (first, count)
    problems: list[str] = field(default_factory=list)  # the stage cut's

    @property
    def off(self) -> list[DryRow]:
        return [r for r in self.rows if abs(r.ratio - 1) > BOUND]

    @property
    def ok(self) -> bool:
        return not self.off and not self.problems

    def to_json(self) -> dict[str, Any]:
        return {"bound": BOUND, "ok": self.ok,
                "rows": [{**vars(r), "ratio": r.ratio} for r in self.rows],
                "stages": [{"stage": s, "planned": self.planned_layers[s],
                            "measured": [[list(c) for c in chunks] for chunks in per]}
                           for s, per in sorted(self.layers.items())],
                "problems": self.problems}


def measured_ranks(layout: ParallelConfig, stage: int) -> list[tuple[str, int]]:
    """The ranks measured for pipeline rank ``stage``: its first and its last."""
    from paraxis.runtime.grid import GridLayout

    grid = GridLayout(layout.degrees)
    last = {a: d - 1 for a, d in layout.degrees.items()}
    first = grid.rank(pipeline=stage)
    final = grid.rank(**{**last, "pipeline": stage})
    return [("first", first)] + ([("last", final)] if final != first else [])


def _laid_out(build: Callable[[], nn.Module], layout: ParallelConfig, train: TrainSection,
              rank: int, list_name: str) -> tuple[dict[str, float], Chunks]:
    """One rank in a fake world: its model state in bytes and the layers it holds."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from paraxis.engine.apply import parallelize
    from paraxis.parallel.stages import chunks_of
    from paraxis.parallel.strategy import MATERIALIZE_ATTR
    from paraxis.planner.measure import end_step_without_forward, held_model_state

    saved = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(layout.world_size)  # what preflight checks against
    dist.init_process_group("fake", store=FakeStore(), rank=rank,
                            world_size=layout.world_size)
    try:
        with torch.device("meta"):
            model = build()
        setattr(model, MATERIALIZE_ATTR, lambda m: None)  # shapes only, never storage
        engine = parallelize(model, config=layout, train=train, verify=False)
        layers = held_layers(chunks_of(engine.model), list_name)
        end_step_without_forward(engine)
        held = held_model_state(engine)
        engine.grid.destroy()
        return {t: getattr(held, t) for t in TERMS}, layers
    finally:
        dist.destroy_process_group()
        if saved is None:
            os.environ.pop("WORLD_SIZE", None)
        else:
            os.environ["WORLD_SIZE"] = saved


def dry_run(plan: Plan, *, build: Callable[[], nn.Module],
            train: TrainSection | None = None) -> DryRun:
    """Lay ``plan``'s layout out for the first and last rank of each pipeline stage (see
    the module docstring); ``build`` makes the model as the run does (it is called under
    ``torch.device("meta")``), ``train`` is the run's (default: the plan's workload
    with AdamW). Must run where no process group exists."""
    if dist.is_initialized():
        raise RuntimeError("a dry run builds its own fake process group; run it outside "
                           "torchrun")
    work, layout = plan.work, plan.layout
    if work.precision == "mixed":
        raise ValueError("--dry-run measures what paraxis holds: use --precision bf16, fp16 "
                         "or fp32 (mixed is the ZeRO paper's accounting, DeepSpeed's)")
    if train is None:
        train = TrainSection(seq_length=work.seq, precision=work.precision,
                             global_batch=work.micro_batch * layout.sample_shards *
                             layout.schedule.microbatches)
    with torch.device("meta"):
        model = build()
    list_name = find_anatomy(model, find_plan(model, make_plugin_manager(), None)).layers
    if list_name is None:
        raise ValueError(f"{type(model).__name__} has no list of layers to lay out")
    rows: list[DryRow] = []
    layers: dict[int, list[Chunks]] = {}
    for memory in plan.memory:
        layers[memory.stage] = []
        for which, rank in measured_ranks(layout, memory.stage):
            measured, held = _laid_out(build, layout, train, rank, list_name)
            layers[memory.stage].append(held)
            rows += [DryRow(memory.stage, rank, which, term, getattr(memory, term),
                            measured[term]) for term in TERMS]
    planned = {r: chunks for r, chunks in enumerate(layout_chunks(plan.counts, layout))}
    problems = cut_problems(layers, planned, num_layers=plan.counts.num_layers,
                            hidden=plan.counts.hidden_size, vocab=plan.counts.vocab_size,
                            points=layout.schedule.pipeline_split)
    return DryRun(rows, layers, planned, problems)


def _coords(layout: ParallelConfig, rank: int) -> str:
    from paraxis.runtime.grid import GridLayout

    coords = GridLayout(layout.degrees).coords(rank)
    return " ".join(f"{a[0]}{coords[a]}" for a in AXES
                    if a != "pipeline" and layout.degrees[a] > 1) or "-"


def format_dry_run(run: DryRun, layout: ParallelConfig) -> str:
    """The dry run as text: the stage cut, every row, the verdict."""
    lines = ["dry run (the layout built on the meta device in a fake process group): "
             "layers per stage counted from its modules, then bytes per rank measured "
             "from its tensors / planned"]
    for stage, per in sorted(run.layers.items()):
        held = ", ".join(f"{c[0]}-{c[-1]}" if c else "none" for c in per[0])
        lines.append(f"  stage {stage}: layers {held} ({sum(len(c) for c in per[0])}), "
                     f"plan {sum(n for _, n in run.planned_layers[stage])}")
    lines.append(f"{'stage':>5} {'rank':>6} {'coords':<12} {'term':<11} {'planned':>14} "
                 f"{'measured':>14} {'ratio':>7}")
    lines += [f"{r.stage:>5} {r.rank:>6} {_coords(layout, r.rank):<12} {r.term:<11} "
              f"{r.planned:>14,.0f} {r.measured:>14,.0f} {r.ratio:>7.4f}" for r in run.rows]
    worst = max(run.rows, key=lambda r: abs(r.ratio - 1))
    lines.append(f"worst: stage {worst.stage} rank {worst.rank} {worst.term}, ratio "
                 f"{worst.ratio:.4f} (bound {BOUND:.0%})")
    lines += [f"stage cut: {p}" for p in run.problems] or [
        "stage cut: every check passed (paraxis.planner.stage_cut)"]
    return "\n".join(lines)
