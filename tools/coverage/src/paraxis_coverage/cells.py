"""The matrix's columns and what a cell says: the checks (a layout over two ranks), the
four statuses, the series every step reports, and a cell's outcome. Plain data, read by
the runs (:mod:`paraxis_coverage.checks`), the shard proof, the drift judge and the
report.
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["AUX_LOSS", "BATCH", "CHECKS", "HISTORY", "IGNORED", "LR", "SHARDING", "STATUSES",
           "STEPS", "Check", "Outcome", "available_checks"]

STEPS, BATCH, LR = 3, 4, 1e-3
IGNORED = 5  # the first labels of sample 0 are -100: data ranks hold uneven token counts
STATUSES = ("pass", "explained", "refused", "fail")
# What each step reports that must equal one process's: the key of a run's result, and
# the words a mismatch is said with. A router loss (a model with experts) is its own
# series: it holds a small share of the gradient norm, so a norm cannot speak for it.
HISTORY = (("losses", "loss"), ("norms", "gradient norm"),
           ("aux", "router load-balancing loss"))
AUX_LOSS = "moe/aux_loss"  # paraxis_moe.router.AUX_LOSS, as the engine reports it
# Checks whose axis shards the model (the shard proof applies), by the grid axis.
SHARDING = {"tensor": "tensor", "pipeline": "pipeline", "expert": "expert"}


@dataclasses.dataclass(frozen=True)
class Check:
    """A column: ``parallelize`` keywords on 2 ranks; ``axis`` is the package it needs
    (the column appears when that axis' strategy is registered)."""

    name: str
    kwargs: dict[str, Any]
    axis: str

    @property
    def world(self) -> int:
        from paraxis import ParallelConfig

        return ParallelConfig.from_kwargs(**self.kwargs).world_size

    @property
    def microbatches(self) -> int:
        return int(self.kwargs.get("microbatches", 1))


CHECKS = (
    Check("data=2", {"data": 2}, "data"),
    Check("tensor=2", {"tensor": 2}, "tensor"),
    Check("tensor=2 SP", {"tensor": 2, "sequence_parallel": True}, "tensor"),
    Check("pipeline=2", {"pipeline": 2, "microbatches": 2, "pipeline_schedule": "1f1b"},
          "pipeline"),
    Check("expert=2", {"expert": 2}, "expert"),
    Check("context=2", {"context": 2}, "context"),
)


def available_checks() -> list[Check]:
    """The checks whose axis has a registered strategy (expert and context appear when
    paraxis-moe-ep and paraxis-seq-context are installed and register theirs)."""
    from paraxis.engine.plugins import collect_strategies, make_plugin_manager

    axes = set(collect_strategies(make_plugin_manager()))
    return [c for c in CHECKS if c.axis in axes]


@dataclasses.dataclass(frozen=True)
class Outcome:
    """A cell: ``pass``, ``explained``, ``refused`` or ``fail``, with the reason (and, for
    a pass, the shard proof)."""

    status: str
    detail: str = ""
    seconds: float = 0.0

    def cell(self) -> str:
        return self.status if not self.detail else f"{self.status}: {self.detail}"
