"""ZeRO-3's units: the groups of parameters gathered together.

A unit is the model's layers, one by one (on a pipeline stage only the layers it runs),
plus the token embedding and the head, in forward order, as torchtitan applies
``fully_shard``; which modules these are is the model's anatomy's
(:mod:`paraxis.parallel.anatomy`). Whatever sharded parameter is left (one that two
units share, such as a word embedding tied to the head, or one outside every unit)
belongs to the *root* unit, gathered for the whole forward and backward (FSDP2 keeps its
root unsharded after forward for the same reason).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from paraxis.parallel.anatomy import Anatomy

__all__ = ["UnitSpec", "find_units"]


@dataclass(eq=False)
class UnitSpec:
    name: str
    module: nn.Module
    params: list[nn.Parameter]


def find_units(model: nn.Module, anatomy: Anatomy,
               sharded: list[nn.Parameter]) -> tuple[list[UnitSpec], list[nn.Parameter]]:
    """The units of ``model`` (one stage, or the whole model) in forward order, each
    with its ``sharded`` parameters, and the sharded parameters left to the root unit."""
    layers = anatomy.owned_layers(model)
    modules = [("embedding", anatomy.embedding_of(model)),
               *((f"layer{i}", m) for i, (_, m) in enumerate(layers)),
               ("head", anatomy.head_of(model))]
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
