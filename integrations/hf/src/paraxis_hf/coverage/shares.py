"""What share of the model a rank *should* hold, computed from the plan and the degrees
alone (never from the placements the axes wrote), for the shard proof of
:mod:`paraxis_hf.coverage.checks`.

A rank's bytes could equal what its placements claim and still be wrong: an axis that
silently skipped a plan entry writes no placement for it, and the parameter stays
whole (afmoe at tensor=2 held 0.92 of the model and passed). Here each parameter of the
whole model is given the bytes the layout should leave on the rank:

* tensor ``t``: a parameter the tensor plan names (an entry on the parameter itself,
  or its ``nn.Linear`` / ``nn.Embedding`` under a column, row or vocabulary style) holds
  1/t of its split dimension (a row-parallel bias stays whole; logits and gathered
  outputs may be padded up to a multiple of ``t``); the rest is replicated, experts
  among it (each expert whole over tensor, unless ``expert_tensor`` splits it);
* expert ``e``: the tensors of the plan's expert blocks' ``experts`` hold 1/e, and
  1/``expert_tensor`` of that (each expert's FFN split over the tensor group);
* pipeline: a stage holds its layers, the embedding and the modules before the layers
  if it is the first, the head and the modules after them if it is the last, and
  everything else (held by every stage).
"""

from __future__ import annotations

import fnmatch
import math
from typing import Any

from torch import nn

from paraxis_hf.coverage.checks import SHARDING, Check, Outcome

__all__ = ["expected_share", "proven", "whole_layout"]

# transformers' tensor styles that split a parameter, by the dimension they split
# (counted from the end: a column split cuts the output features, a row split the input).
_PARAM_STYLES = {"colwise": 2, "packed_colwise": 2, "rowwise": 1, "packed_rowwise": 1}
_COLUMN = {"colwise", "packed_colwise", "colwise_gather_output"}
_ROW = {"rowwise", "rowwise_split_input"}
_PADDED = {"colwise_gather_output", "embedding_rowwise"}


def whole_layout(model: nn.Module) -> dict[str, Any]:
    """The whole model's parameters (every name of each, tied ones included) and the
    kind of each module that holds one, taken before ``parallelize`` changes it."""
    names: dict[int, list[str]] = {}
    params: dict[int, nn.Parameter] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
        params[id(p)] = p
    kinds = {n: ("linear" if isinstance(m, nn.Linear) else
                 "embedding" if isinstance(m, nn.Embedding) else "")
             for n, m in model.named_modules()}
    return {"params": [(names[k], tuple(p.shape), p.element_size())
                       for k, p in params.items()], "kinds": kinds}


def _style(patterns: dict[str, str], name: str) -> str | None:
    return next((s for p, s in patterns.items() if fnmatch.fnmatchcase(name, p)), None)


def _tensor_numel(names: list[str], shape: tuple[int, ...], plan: Any, kinds: dict[str, str],
                  t: int) -> int:
    """Elements of one parameter on a tensor rank, read from the plan's entries."""
    numel = math.prod(shape)
    for name in names:
        owner, _, attr = name.rpartition(".")
        style = _style(plan.tensor, name)
        if style in _PARAM_STYLES and shape:
            dim = max(len(shape) - _PARAM_STYLES[style], 0)
            return numel // shape[dim] * (shape[dim] // t)
        style = _style(plan.tensor, owner)
        kind = kinds.get(owner, "")
        if kind == "linear" and style in _COLUMN:
            rows = -(-shape[0] // t) if style in _PADDED else shape[0] // t
            return numel // shape[0] * rows
        if kind == "linear" and style in _ROW:
            return numel // t if attr == "weight" else numel
        if kind == "embedding" and style == "embedding_rowwise":
            return numel // shape[0] * -(-shape[0] // t)
    return numel


def _under(name: str, prefixes: list[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _stage_holds(names: list[str], spec: Any, stages: Any) -> bool | None:
    """Whether the stages a rank holds (``ctx.pipeline``, cut by the
    :class:`~paraxis.parallel.stages.StageSpec` ``spec``) hold a parameter, by its names;
    None for one outside the cut, which every stage holds."""
    held, last = stages.stages, len(stages.ranges) - 1
    for name in names:
        if _under(name, [spec.layers]):
            index = int(name[len(spec.layers) + 1:].split(".")[0])
            if any(a <= index < b for a, b in (stages.ranges[s] for s in held)):
                return True
            continue
        if _under(name, [n for n in [spec.embedding, *spec.before] if n]):
            if 0 in held:
                return True
            continue
        if _under(name, [n for n in [spec.head, *spec.after] if n]):
            if last in held:
                return True
            continue
        return None  # outside the stages' cut: every stage keeps it
    return False


def expected_share(layout: dict[str, Any], plan: Any, degrees: dict[str, int],
                   stages: Any = None, spec: Any = None) -> dict[str, Any]:
    """The bytes this rank should hold, split into what the layout divides (``split``),
    what it leaves whole on the rank (``replicated``, experts apart) and the bytes the
    stage does not hold (``elsewhere``)."""
    t, e = degrees.get("tensor", 1), degrees.get("expert", 1)
    etp = degrees.get("expert_tensor", 1)
    experts = [f"{block}.experts" for block in plan.experts]
    out = {"bytes": 0, "split": 0, "split_experts": 0, "replicated": 0, "replicated_experts": 0,
           "elsewhere": 0, "every_stage": 0, "per_name": {}}
    for names, shape, size in layout["params"]:
        whole = math.prod(shape) * size
        if stages is not None:
            holds = _stage_holds(names, spec, stages)
            if holds is False:
                out["elsewhere"] += whole
                continue
            if holds is None:
                out["every_stage"] += whole
        numel = _tensor_numel(names, shape, plan, layout["kinds"], t) if t > 1 \
            else math.prod(shape)
        is_expert = any(_under(n, experts) for n in names)
        if is_expert:
            numel //= e * etp
        held = numel * size
        out["bytes"] += held
        out["per_name"][names[0]] = held
        if held < whole:
            out["split"] += whole
            out["split_experts"] += whole if is_expert else 0
        elif is_expert:
            out["replicated_experts"] += whole
        else:
            out["replicated"] += whole
    return out


def proven(check: Check | None, results: list[dict[str, Any]]) -> Outcome:
    """A pass once the shard proof holds (for an axis that shards), saying what it saw."""
    proofs = [r["proof"] for r in results if "proof" in r]
    if check is None or check.axis not in SHARDING or len(proofs) != len(results):
        return Outcome("pass")
    axis = SHARDING[check.axis]
    worst = max(p["bytes"] / p["whole"] for p in proofs)
    for rank, p in enumerate(proofs):
        moved = p["sharded"][axis] + (p["handed_over"] if axis == "pipeline" else 0)
        if not moved or p["bytes"] >= p["whole"]:
            return Outcome("fail", f"rank {rank} sharded nothing over {axis}: it holds "
                           f"{p['bytes']:,} parameter bytes of the whole model's "
                           f"{p['whole']:,}")
        if p["bytes"] != p["claimed"]:
            return Outcome("fail", f"rank {rank} holds {p['bytes']:,} parameter bytes, its "
                           f"placements claim {p['claimed']:,}")
        want = p.get("expected")
        if want is not None and p["bytes"] != want["bytes"]:
            return Outcome("fail", _unexpected(rank, p, want, axis))
    p = proofs[0]
    moved = (f"{p['sharded'][axis]} parameters sharded" if axis != "pipeline" else
             f"{p['handed_over']} modules handed to the other stage")
    kept, split = p["experts_replicated_over_tensor"], p.get("experts_sharded_over_tensor", 0)
    note = (f"; {split} expert tensors sharded over tensor" if split else
            f"; experts of {kept} block(s) replicated over tensor" if kept else "")
    if p.get("expected") is None:
        return Outcome("pass", f"{moved}, ranks hold at most {worst:.2f} of the model{note}")
    return Outcome("pass", f"{moved}; ranks hold at most {worst:.2f} of the model, as "
                   f"{_share_words(p['expected'], p['whole'], axis, check)}{note}")


def _share_words(want: dict[str, Any], whole: int, axis: str, check: Check) -> str:
    """The expected share in words: what the layout divides and what stays whole."""
    if axis == "pipeline":
        return (f"the stage cut gives ({want['every_stage'] / whole:.2f} of the model on "
                "every stage)")
    degree = int(check.kwargs.get(axis, 1))
    what = "experts" if axis == "expert" else "named by the tensor plan"
    if axis == "tensor" and want.get("split_experts"):
        what += f", experts {want['split_experts'] / whole:.2f} of it"
    words = (f"the plan gives ({want['split'] / whole:.2f} of the model {what}, split "
             f"1/{degree}; {(want['replicated'] + want['replicated_experts']) / whole:.2f}"
             " replicated")
    if want["replicated_experts"] and axis == "tensor":
        words += f", experts {want['replicated_experts'] / whole:.2f} of it"
    return words + ")"


def _unexpected(rank: int, p: dict[str, Any], want: dict[str, Any], axis: str) -> str:
    """A rank holding other bytes than the plan and degree give, naming the parameters."""
    wrong = [f"{n} {p['held'][n]:,} (expected {b:,})" for n, b in want["per_name"].items()
             if n in p["held"] and p["held"][n] != b][:3]
    return (f"rank {rank} holds {p['bytes']:,} parameter bytes over {axis}, the plan and "
            f"degree give {want['bytes']:,} ({p['bytes'] / p['whole']:.2f} of the model "
            f"against {want['bytes'] / p['whole']:.2f})"
            + (f": {'; '.join(wrong)}" if wrong else ""))
