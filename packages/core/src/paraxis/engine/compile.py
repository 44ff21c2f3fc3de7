"""``train.compile``: torch.compile on each transformer layer of the parallelized model.

Regional compilation, as torchtitan does it: every layer of the plan's layer list (the
layers this rank or pipeline stage runs) is compiled on its own, after every axis has
applied, so what is compiled is the layer with its axes' hooks: tensor parallelism's
gathers and reductions, ZeRO-3's parameter gathers, recomputation. Identical layers
share one compiled graph; the embedding, the head and the loss stay eager. The
collectives paraxis issues from hooks (they count bytes and time, and name a dead rank)
are not traceable, so dynamo breaks the graph around them and runs them eagerly: the
count of such breaks is reported as ``compile/graph_breaks`` after every step.

``parallelize`` compiles before the parity probe, so the compiled layers are what the
probe checks against the model's own eager forward. ``true`` is TorchInductor (on CPU it
generates C++, a compiler must be installed; the first step compiles);
``aot_eager`` traces through dynamo and AOTAutograd without generating code (what the
test suite uses: the tracing of paraxis's hooks is what can break; inductor's code
generation is torch's).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from paraxis.parallel.anatomy import Anatomy
from paraxis.parallel.stages import chunks_of

__all__ = ["backend_of", "compile_layers", "graph_breaks"]


def compile_layers(model: nn.Module, anatomy: Anatomy, backend: str) -> int:
    """Compile every layer this rank runs with ``backend``; return how many."""
    count = 0
    for chunk in chunks_of(model):
        for _, layer in anatomy.owned_layers(chunk):
            layer.compile(backend=backend)
            count += 1
    return count


def graph_breaks() -> Callable[[], dict[str, float]]:
    """A step hook: the graphs dynamo compiled and the graph breaks it counted in this
    process so far."""
    from torch._dynamo.utils import counters

    def hook() -> dict[str, float]:
        return {"compile/graphs": float(counters["stats"]["unique_graphs"]),
                "compile/graph_breaks": float(sum(counters["graph_break"].values()))}

    return hook


def backend_of(setting: bool | str) -> str | None:
    """``train.compile`` -> a torch.compile backend name, or None (eager)."""
    if setting is False:
        return None
    return "inductor" if setting is True else str(setting)

