"""``paraxis plan --dry-run``: the layout built for real, at any world size, on one CPU.

For one rank of each pipeline stage (its first data, tensor, expert and context rank)
the model is built on the meta device, joined to a *fake* process group of the whole
world (torch's ``fake`` backend: collectives return at once, nothing moves) and laid
out by :func:`paraxis.parallelize` exactly as a real run lays it out: the pipeline
split, tensor shards, expert shards and ZeRO's partitions are real tensor shapes, only
without storage. Nothing is materialized and no parity probe runs (there is no model
to compare with). The bytes are then read from those tensors:

* weights: every parameter the rank holds, at its dtype's size;
* gradients: one per weight element, except under ZeRO 2 and 3, where the rank keeps
  only the gradients of what its optimizer steps;
* optimizer state: the parameters the rank's optimizer steps (ZeRO's shards) times the
  state ``train.optimizer`` keeps per element (:func:`optimizer_state_bytes`).

Each is compared with what ``paraxis plan`` says for that stage. Activations and
buffers are not compared: a dry run runs no step. What the plan and the dry run share is
the accounting of bytes per element; what the dry run adds is the layout itself (which
layers a stage holds, how a tensor splits, how ZeRO pads its shards), which the plan
derives in closed form.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from paraxis.config.parallel import ParallelConfig
from paraxis.config.run import TrainSection
from paraxis.planner.evaluate import Plan
from paraxis.planner.inputs import Workload
from paraxis.planner.model import ModelSource, build_on_meta

__all__ = ["DryRow", "dry_run", "rank_bytes"]

TERMS = ("parameters", "gradients", "optimizer")


@dataclass(frozen=True)
class DryRow:
    stage: int
    rank: int
    term: str
    planned: float
    measured: float

    @property
    def ratio(self) -> float:
        return self.measured / self.planned if self.planned else float("inf")


def _first_rank_of_stage(layout: ParallelConfig, stage: int) -> int:
    from paraxis.runtime.grid import GridLayout

    grid = GridLayout(layout.degrees)
    return next(r for r in range(grid.size)
                if grid.coords(r) == {**dict.fromkeys(grid.coords(r), 0), "pipeline": stage})


def rank_bytes(engine: Any, train: TrainSection) -> dict[str, float]:
    """Weights, gradients and optimizer state of a laid-out engine, from its tensors."""
    from paraxis.parallel.optimizers import optimizer_params, optimizer_state_bytes

    held = {id(p): p for p in engine.model.parameters()}.values()
    weights = sum(p.numel() * p.element_size() for p in held)
    owned = optimizer_params(engine.optimizer)
    stepped = sum(p.numel() * p.element_size() for p in owned)
    zero = engine.config.parallelism.zero
    return {"parameters": float(weights),
            "gradients": float(stepped if zero >= 2 else weights),
            "optimizer": float(sum(p.numel() for p in owned) * optimizer_state_bytes(train))}


def _one_rank(source: ModelSource, layout: ParallelConfig, train: TrainSection,
              rank: int) -> dict[str, float]:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from paraxis.engine.apply import parallelize
    from paraxis.engine.plugins import make_plugin_manager
    from paraxis.parallel.strategy import MATERIALIZE_ATTR

    pm = make_plugin_manager()
    saved = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(layout.world_size)  # what preflight checks against
    dist.init_process_group("fake", store=FakeStore(), rank=rank,
                            world_size=layout.world_size)
    try:
        model = build_on_meta(source, pm)
        setattr(model, MATERIALIZE_ATTR, lambda m: None)  # shapes only, never storage
        engine = parallelize(model, config=layout, train=train, plugin_manager=pm,
                             verify=False)
        out = rank_bytes(engine, train)
        engine.grid.destroy()
        return out
    finally:
        dist.destroy_process_group()
        if saved is None:
            os.environ.pop("WORLD_SIZE", None)
        else:
            os.environ["WORLD_SIZE"] = saved


def dry_run(source: ModelSource, plan: Plan) -> list[DryRow]:
    """Lay out ``plan``'s layout for one rank of each pipeline stage (see the module
    docstring); a row per stage and term. Must run where no process group exists."""
    if dist.is_initialized():
        raise RuntimeError("a dry run builds its own fake process group; run it outside "
                           "torchrun")
    work: Workload = plan.work
    if work.precision == "mixed":
        raise ValueError("--dry-run measures what paraxis holds: use --precision bf16, fp16 "
                         "or fp32 (mixed is the ZeRO paper's accounting, DeepSpeed's)")
    layout = plan.layout
    micro = work.micro_batch
    train = TrainSection(seq_length=work.seq, precision=work.precision,
                         global_batch=micro * layout.sample_shards *
                         layout.schedule.microbatches)
    rows = []
    for memory in plan.memory:
        rank = _first_rank_of_stage(layout, memory.stage)
        measured = _one_rank(source, layout, train, rank)
        rows += [DryRow(memory.stage, rank, term, getattr(memory, term), measured[term])
                 for term in TERMS]
    return rows


def format_rows(rows: list[DryRow]) -> str:
    lines = ["dry run (the layout built on the meta device in a fake process group): "
             "bytes per rank, measured from its tensors / planned",
             f"{'stage':>5} {'rank':>6} {'term':<11} {'planned':>14} {'measured':>14} "
             f"{'ratio':>7}"]
    lines += [f"{r.stage:>5} {r.rank:>6} {r.term:<11} {r.planned:>14,.0f} "
              f"{r.measured:>14,.0f} {r.ratio:>7.4f}" for r in rows]
    worst = max(rows, key=lambda r: abs(r.ratio - 1))
    lines.append(f"worst: stage {worst.stage} {worst.term}, ratio {worst.ratio:.4f}")
    return "\n".join(lines)
