"""What share of the model a rank *should* hold, computed from the plan and the degrees
alone (never from the placements the axes wrote), for the shard proof of
:mod:`paraxis_coverage.checks`.

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
* pipeline: a stage holds its layers, the modules the pipeline plan names before the
  layer list if it is the first, those after it (final norm, head) if it is the last,
  and everything else (held by every stage). Which layers a stage holds is counted here
  from the whole model's layer list and the degrees (:func:`expected_stage_ranges`),
  never read from the engine's cut (``ctx.pipeline``, ``StageSpec``): a cut that put the
  wrong layers on a stage would otherwise agree with itself (issue 32).

The proof compares each parameter on each rank with its expected bytes, not the rank's
total: a parameter split twice and another kept whole can leave the total as the plan
gives it (issue 32; ``test_coverage_units`` plants exactly that).
"""

from __future__ import annotations

import fnmatch
import itertools
import math
from typing import Any

from torch import nn

from paraxis_coverage.cells import SHARDING, Check, Outcome

__all__ = ["expected_on_rank", "expected_share", "expected_stage_ranges",
           "parameters_off_share", "proven", "whole_layout"]

# transformers' tensor styles that split a parameter, by the dimension they split
# (counted from the end: a column split cuts the output features, a row split the input).
_PARAM_STYLES = {"colwise": 2, "packed_colwise": 2, "rowwise": 1, "packed_rowwise": 1}
_COLUMN = {"colwise", "packed_colwise", "colwise_gather_output"}
_ROW = {"rowwise", "rowwise_split_input"}
_PADDED = {"colwise_gather_output", "embedding_rowwise"}


def whole_layout(model: nn.Module) -> dict[str, Any]:
    """The whole model's parameters (every name of each, tied ones included), the kind
    of each module that holds one, its list of layers and their number (the model's
    anatomy names the list; the cut of it is counted here, :func:`expected_stage_ranges`)
    and the sizes the stage cut weighs the head by, taken before ``parallelize`` changes
    it."""
    from paraxis.config.shape import config_size
    from paraxis.parallel.anatomy import find_anatomy
    from paraxis_hf.plan import hf_plan

    config = getattr(model, "config", None)
    names: dict[int, list[str]] = {}
    params: dict[int, nn.Parameter] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
        params[id(p)] = p
    kinds = {n: ("linear" if isinstance(m, nn.Linear) else
                 "embedding" if isinstance(m, nn.Embedding) else "")
             for n, m in model.named_modules()}
    sizes = {s: config_size(config, s) for s in ("hidden_size", "vocab_size")}
    anatomy = find_anatomy(model, hf_plan(model))
    return {"params": [(names[k], tuple(p.shape), p.element_size())
                       for k, p in params.items()], "kinds": kinds,
            "lists": {anatomy.layers: anatomy.num_layers} if anatomy.layers else {},
            **{s: v if isinstance(v, int) else 0 for s, v in sizes.items()}}


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


def expected_stage_ranges(num_layers: int, stages: int, *, hidden: int, vocab: int,
                          points: list[int] | None = None) -> list[tuple[int, int]]:
    """Each stage's layers ``[a, b)`` as the pipeline axis' contract states them
    (:mod:`paraxis.parallel.split`'s docstring), counted here by trying every cut rather
    than by its dynamic program: explicit ``points`` as given; else consecutive,
    non-empty ranges whose costliest stage is least, a layer costing 1, the head
    ``vocab / (12 x hidden)`` on the last stage (2·h·V against 24·h² FLOPs per token,
    Narayanan et al., arXiv:2104.04473) and a tenth of it for the embedding on the
    first. Among equally costly cuts, each stage is as short as the stages after it
    allow while they too keep their costliest stage least. Every cut is tried: for the
    matrix's tiny models (a few layers), not for a 100-layer model."""
    if points:
        bounds = [0, *points, num_layers]
        return list(itertools.pairwise(bounds))
    if not 1 <= stages <= num_layers:
        raise ValueError(f"{num_layers} layers cannot fill {stages} stages")
    head = vocab / (12 * hidden) if hidden else 0.0
    extra = [0.0] * stages
    extra[0] += 0.1 * head
    extra[-1] += head
    if math.comb(num_layers - 1, stages - 1) > 1_000_000:
        raise ValueError(f"{num_layers} layers over {stages} stages: too many cuts to try "
                         "(this count is for the coverage matrix's tiny models)")

    def order(cuts: tuple[int, ...]) -> tuple[float, ...]:
        bounds = (0, *cuts, num_layers)
        costs = [b - a + extra[s] for s, (a, b) in enumerate(itertools.pairwise(bounds))]
        return tuple(x for s in range(stages) for x in (max(costs[s:]), bounds[s + 1]))

    cuts = min(itertools.combinations(range(1, num_layers), stages - 1), key=order)
    return list(itertools.pairwise((0, *cuts, num_layers)))


def _stage_cut(layout: dict[str, Any], plan: Any, degrees: dict[str, int],
               pipeline_rank: int, points: list[int] | None) -> dict[str, Any]:
    """What a pipeline rank holds, from the whole model and the degrees: the plan's
    first module list is the layer list, its entries before it go to the first stage,
    those after it to the last; rank ``r`` of ``p`` holds global stages ``r, r + p, ...``
    (one per virtual stage: Megatron's interleaving, arXiv:2104.04473 section 2.2)."""
    names = list(plan.pipeline)
    layers = next((n for n in names if n in layout["lists"]), None)
    if layers is None:
        raise ValueError(f"{plan.model_class}: no entry of the pipeline plan {names} is a "
                         "module list of the whole model")
    p = degrees["pipeline"]
    stages = p * degrees.get("virtual_stages", 1)
    ranges = expected_stage_ranges(layout["lists"][layers], stages,
                                   hidden=layout.get("hidden_size", 0),
                                   vocab=layout.get("vocab_size", 0), points=points)
    held = [s for s in range(stages) if s % p == pipeline_rank]
    at = names.index(layers)
    return {"layers": layers, "before": names[:at], "after": names[at + 1:],
            "ranges": [ranges[s] for s in held], "first": 0 in held,
            "last": stages - 1 in held}


def _stage_holds(names: list[str], cut: dict[str, Any]) -> bool | None:
    """Whether a rank's stages (``cut``, from :func:`_stage_cut`) hold a parameter, by
    its names; None for one outside the cut, which every stage holds."""
    for name in names:
        if _under(name, [cut["layers"]]):
            index = int(name[len(cut["layers"]) + 1:].split(".")[0])
            if any(a <= index < b for a, b in cut["ranges"]):
                return True
            continue
        if _under(name, cut["before"]):
            if cut["first"]:
                return True
            continue
        if _under(name, cut["after"]):
            if cut["last"]:
                return True
            continue
        return None  # outside the stages' cut: every stage keeps it
    return False


def expected_on_rank(engine: Any, layout: dict[str, Any] | None) -> dict[str, Any] | None:
    """:func:`expected_share` for this rank of ``engine``: the degrees and the rank's
    pipeline coordinate from its grid and config, nothing from what the axes built."""
    if layout is None:
        return None
    degrees = {a: engine.grid.size(a) for a in ("tensor", "expert", "pipeline")}
    degrees["expert_tensor"] = engine.config.parallelism.expert_tensor
    schedule = engine.config.schedule
    degrees["virtual_stages"] = schedule.virtual_stages
    return expected_share(layout, engine.plan, degrees,
                          pipeline_rank=engine.grid.coords.get("pipeline", 0),
                          points=schedule.pipeline_split)


def expected_share(layout: dict[str, Any], plan: Any, degrees: dict[str, int], *,
                   pipeline_rank: int = 0, points: list[int] | None = None
                   ) -> dict[str, Any]:
    """The bytes this rank should hold: in all (``bytes``) and per parameter
    (``per_param``: every name of a parameter with its bytes here, for each parameter
    the rank holds; ``elsewhere_names``: the names of those another stage holds), split
    into what the layout divides (``split``), what it leaves whole on the rank
    (``replicated``, experts apart) and the bytes the stage does not hold
    (``elsewhere``). With ``degrees["pipeline"]`` above 1, ``pipeline_rank`` is the
    rank's pipeline coordinate and ``points`` the config's explicit split."""
    t, e = degrees.get("tensor", 1), degrees.get("expert", 1)
    etp = degrees.get("expert_tensor", 1)
    experts = [f"{block}.experts" for block in plan.experts]
    cut = (_stage_cut(layout, plan, degrees, pipeline_rank, points)
           if degrees.get("pipeline", 1) > 1 else None)
    out: dict[str, Any] = {"bytes": 0, "split": 0, "split_experts": 0, "replicated": 0,
                           "replicated_experts": 0, "elsewhere": 0, "every_stage": 0,
                           "per_param": [], "elsewhere_names": []}
    for names, shape, size in layout["params"]:
        whole = math.prod(shape) * size
        if cut is not None:
            holds = _stage_holds(names, cut)
            if holds is False:
                out["elsewhere"] += whole
                out["elsewhere_names"] += names
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
        out["per_param"].append((list(names), held))
        if held < whole:
            out["split"] += whole
            out["split_experts"] += whole if is_expert else 0
        elif is_expert:
            out["replicated_experts"] += whole
        else:
            out["replicated"] += whole
    return out


def parameters_off_share(held: dict[str, int], want: dict[str, Any]) -> list[str]:
    """Each parameter a rank holds other than ``want`` (:func:`expected_share`) gives
    it, in words: other bytes than expected, missing, or held where another stage (or
    no parameter of the whole model) should be. ``held``: bytes by the names the
    parallel model's ``named_parameters()`` gives (a tied parameter under one of its
    names)."""
    wrong, matched = [], set()
    for names, expected in want["per_param"]:
        name = next((n for n in names if n in held), None)
        if name is None:
            wrong.append(f"{names[0]} missing (expected {expected:,})")
            continue
        matched.add(name)
        if held[name] != expected:
            wrong.append(f"{name} {held[name]:,} (expected {expected:,})")
    elsewhere = set(want.get("elsewhere_names", ()))
    for name in held.keys() - matched:
        where = "another stage holds it" if name in elsewhere else "not a parameter of " \
            "the whole model"
        wrong.append(f"{name} {held[name]:,} (expected none: {where})")
    return wrong


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
        wrong = [] if want is None else parameters_off_share(p["held"], want)
        if wrong:
            return Outcome("fail", _unexpected(rank, p, want, axis, wrong))
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


def _unexpected(rank: int, p: dict[str, Any], want: dict[str, Any], axis: str,
                wrong: list[str]) -> str:
    """A rank holding parameters other than the plan and degree give, naming them; the
    totals too, which may agree (per-parameter errors can cancel)."""
    totals = ("the same total" if p["bytes"] == want["bytes"] else
              f"{p['bytes'] / p['whole']:.2f} of the model against "
              f"{want['bytes'] / p['whole']:.2f}")
    return (f"rank {rank}: {len(wrong)} parameter(s) held other than the plan and degree "
            f"give over {axis} (the rank holds {p['bytes']:,} parameter bytes, the plan "
            f"gives {want['bytes']:,}: {totals}): {'; '.join(wrong[:3])}"
            + (f" (and {len(wrong) - 3} more)" if len(wrong) > 3 else ""))
