"""ZeRO-3's units: the groups of parameters gathered together.

A unit is the model's layers, one by one (the plan's layer list; on a pipeline stage
only the layers it runs, :func:`paraxis.parallel.recompute.layer_list`), plus the token
embedding and the head (the plan's pipeline entries that take ``input_ids`` and give
``logits``; transformers' ``get_input_embeddings`` / ``get_output_embeddings`` without
a pipeline plan), in forward order, as torchtitan applies ``fully_shard``. Whatever
sharded parameter is left (one that two units share, such as a word embedding tied to
the head, or one outside every unit) belongs to the *root* unit, gathered for the whole
forward and backward (FSDP2 keeps its root unsharded after forward for the same reason).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from paraxis.parallel.model_plan import ModelPlan, PlanError
from paraxis.parallel.recompute import layer_list
from paraxis.parallel.stages import Absent, StageSpec

__all__ = ["UnitSpec", "find_units"]


@dataclass(eq=False)
class UnitSpec:
    name: str
    module: nn.Module
    params: list[nn.Parameter]


def _named(model: nn.Module, name: str | None) -> nn.Module | None:
    if not name:
        return None
    try:
        module = model.get_submodule(name)
    except AttributeError:
        return None
    return None if isinstance(module, Absent | nn.Identity) else module


def _ends(model: nn.Module, plan: ModelPlan | None) -> tuple[nn.Module | None, nn.Module | None]:
    """The token embedding and the head of ``model`` (either may be absent)."""
    if plan is not None and plan.pipeline:
        try:
            spec = StageSpec.from_plan(model, plan)
        except PlanError:
            spec = None
        if spec is not None:
            return _named(model, spec.embedding), _named(model, spec.head)
    embedding = head = None
    if hasattr(model, "get_input_embeddings"):
        embedding = model.get_input_embeddings()
    if hasattr(model, "get_output_embeddings"):
        head = model.get_output_embeddings()
    return embedding, head


def find_units(model: nn.Module, plan: ModelPlan | None,
               sharded: list[nn.Parameter]) -> tuple[list[UnitSpec], list[nn.Parameter]]:
    """The units of ``model`` in forward order, each with its ``sharded`` parameters,
    and the sharded parameters left to the root unit."""
    embedding, head = _ends(model, plan)
    modules = [("embedding", embedding),
               *((f"layer{i}", m) for i, m in enumerate(layer_list(model, plan))),
               ("head", head)]
    wanted = {id(p) for p in sharded}
    owners: dict[int, list[str]] = {}
    for name, module in modules:
        if module is None:
            continue
        for p in module.parameters():
            if id(p) in wanted:
                owners.setdefault(id(p), []).append(name)
    units = []
    for name, module in modules:
        if module is None:
            continue
        mine = [p for p in module.parameters() if owners.get(id(p)) == [name]]
        if mine:
            units.append(UnitSpec(name, module, mine))
    claimed = {id(p) for u in units for p in u.params}
    return units, [p for p in sharded if id(p) not in claimed]
