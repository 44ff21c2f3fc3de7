"""paraxis plan: memory per rank, communication per axis, bubble and step time for any
model and grid, before any process starts (issue 15).

One concern per module: :mod:`~paraxis.planner.model` (exact parameter counts on the
meta device), :mod:`~paraxis.planner.memory` (ZeRO model states, Korthikanti
activations, buffers), :mod:`~paraxis.planner.comm` (bytes per axis and the link),
:mod:`~paraxis.planner.schedule` (stages, alive microbatches, bubble),
:mod:`~paraxis.planner.step` (step time, MFU), :mod:`~paraxis.planner.evaluate` (one
layout), :mod:`~paraxis.planner.search` (every layout, ranked),
:mod:`~paraxis.planner.explain`, :mod:`~paraxis.planner.svg`,
:mod:`~paraxis.planner.report` and :mod:`~paraxis.planner.cli`;
:mod:`~paraxis.planner.measure` measures activation bytes to check the plan against.
"""

from paraxis.planner.evaluate import Plan, evaluate, make_layout, problems
from paraxis.planner.inputs import Hardware, Workload
from paraxis.planner.memory import layer_activation_bytes, model_state_bytes
from paraxis.planner.model import ModelCounts, build_on_meta, count_model, load_model_source
from paraxis.planner.search import Ranking, search
from paraxis.planner.units import PlanInputError

__all__ = [
    "Hardware",
    "ModelCounts",
    "Plan",
    "PlanInputError",
    "Ranking",
    "Workload",
    "build_on_meta",
    "count_model",
    "evaluate",
    "layer_activation_bytes",
    "load_model_source",
    "make_layout",
    "model_state_bytes",
    "problems",
    "search",
]
