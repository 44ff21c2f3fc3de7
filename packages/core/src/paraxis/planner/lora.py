"""``paraxis plan --lora-rank R [--lora-targets ...]``: the counts of a LoRA run (Hu et
al., arXiv:2106.09685; issue 34): every weight of the model frozen, and a rank-R adapter
beside each targeted linear layer of the layers, ``R (in + out)`` trainable parameters
(A: R x in, B: out x R), as peft adds them.

Frozen parameters keep their weights (sharded by ZeRO-3 like any other) but no gradient
and no optimizer state (DESIGN section 10, "Trainable vs frozen"):
:func:`paraxis.planner.memory.model_state_bytes` counts the adapters alone for those.
Adapters are counted as matrices split by the tensor degree; under tensor parallelism
the side the base does not split (A of a column-parallel base, B of a row-parallel one)
is whole, R rows more per rank: a small undercount there.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from paraxis.parallel.anatomy import Anatomy
from paraxis.planner.model import LayerCount, ModelCounts
from paraxis.planner.units import PlanInputError

__all__ = ["with_lora"]


def with_lora(counts: ModelCounts, model: nn.Module, anatomy: Anatomy, rank: int,
              targets: list[str] | None = None) -> ModelCounts:
    """``counts`` with rank-``rank`` adapters beside the linear layers of each layer
    whose name (or last part of it) is in ``targets`` (None: every linear layer of the
    layers, peft's ``all-linear`` but the head); a target matching none is one error."""
    if rank < 1:
        raise PlanInputError(f"--lora-rank {rank} must be at least 1 (e.g. 8)")
    per_layer, matched = [], set()
    for layer in anatomy.layer_list(model):
        added = 0
        for name, module in layer.named_modules():
            short = name.rpartition(".")[2]
            if not isinstance(module, nn.Linear) or (
                    targets is not None and short not in targets and name not in targets):
                continue
            matched.update(t for t in targets or () if t in (short, name))
            added += rank * (module.in_features + module.out_features)
        per_layer.append(added)
    missing = sorted(set(targets or ()) - matched)
    if missing or not any(per_layer):
        linear = sorted({n.rpartition(".")[2] for layer in anatomy.layer_list(model)
                         for n, m in layer.named_modules() if isinstance(m, nn.Linear)})
        raise PlanInputError(f"--lora-targets {', '.join(missing or targets or [])}: no "
                             f"linear layer of the layers is named so (they end in: "
                             f"{', '.join(linear) or 'none'})")
    layers = tuple(LayerCount(c.matrices + a, c.vectors, c.experts, adapters=a)
                   for c, a in zip(counts.layers, per_layer, strict=True))
    return dataclasses.replace(counts, layers=layers, lora_rank=rank)
