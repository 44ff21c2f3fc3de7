"""Read a transformers model's own parallel plans into a :class:`paraxis.ModelPlan`.

transformers (>= 4.50) attaches to each model ``_tp_plan`` (module pattern -> style,
fully qualified, ``lm_head`` included) and ``_pp_plan`` (module -> input and output
names); the config holds the base-model versions, ``base_model_tp_plan`` and
``base_model_pp_plan``, relative to ``base_model_prefix``. Mixture-of-experts blocks
are the modules that hold an ``experts`` child (core's
:func:`paraxis.parallel.anatomy.expert_blocks`).

transformers' tensor plans of MoE families also split the fused experts
(``moe_tp_experts``, ``packed_colwise`` on ``experts.gate_up_proj``); paraxis keeps each
expert whole on its expert rank (the expert axis shards experts, tensor parallelism
splits attention and dense MLPs, shared experts included where the plan names them),
so those entries are left out of the tensor plan and listed in
``extra["experts_kept_whole"]``.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from paraxis.parallel.anatomy import expert_blocks
from paraxis.parallel.model_plan import ModelPlan
from paraxis_hf.limits import unsupported_layouts

__all__ = ["hf_plan"]


def _prefixed(plan: dict[str, Any] | None, prefix: str) -> dict[str, Any]:
    return {f"{prefix}.{k}" if prefix else k: v for k, v in (plan or {}).items()}


def _tensor_plan(model: nn.Module) -> dict[str, str]:
    plan = getattr(model, "_tp_plan", None)
    if plan:
        return dict(plan)
    prefix = getattr(model, "base_model_prefix", "")
    base = _prefixed(getattr(model.config, "base_model_tp_plan", None), prefix)
    head = getattr(type(model), "_tp_plan", None) or {}
    return {**base, **head} if base else {}


def _pipeline_plan(model: nn.Module) -> dict[str, tuple[tuple[str, ...], tuple[str, ...]]]:
    if not getattr(model.config, "base_model_pp_plan", None):
        # transformers gives every causal LM its head's entry; without the base model's
        # plan (the layers) there are no stages to cut, so there is no pipeline plan.
        return {}
    plan = getattr(model, "_pp_plan", None)
    if not plan:
        prefix = getattr(model, "base_model_prefix", "")
        base = _prefixed(getattr(model.config, "base_model_pp_plan", None), prefix)
        head = getattr(type(model), "_pp_plan", None) or {}
        plan = {**base, **head} if base else {}
    # transformers merges the head's entry first; a pipeline needs forward order, which
    # for these models is registration order.
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    names = sorted(plan, key=lambda n: order.get(n, len(order)))
    return {n: (tuple(plan[n][0]), tuple(plan[n][1])) for n in names}


def _is_expert_entry(pattern: str) -> bool:
    """A tensor-plan entry for the fused experts module or its tensors (not a shared
    expert, whose module names differ: ``shared_expert(s)``)."""
    return pattern.endswith(".experts") or ".experts." in pattern


def hf_plan(model: nn.Module) -> ModelPlan:
    """The plan of a transformers ``PreTrainedModel``, from the model's own metadata."""
    cls = type(model).__name__
    tensor, pipeline = _tensor_plan(model), _pipeline_plan(model)
    experts = expert_blocks(model)
    whole = sorted(p for p in tensor if experts and _is_expert_entry(p))
    tensor = {p: style for p, style in tensor.items() if p not in whole}
    missing = [axis for axis, part in (("tensor", tensor), ("pipeline", pipeline)) if not part]
    source = "transformers model plan" + (
        f" (the model defines no {' or '.join(missing)} plan)" if missing else "")
    return ModelPlan(
        model_class=cls,
        tensor=tensor,
        pipeline=pipeline,
        experts=experts,
        source=source,
        unsupported=unsupported_layouts(model),
        extra={
            # Training needs no KV cache; building one costs memory every step.
            "forward_kwargs": {"use_cache": False},
            "expert_plan": dict(getattr(model.config, "base_model_ep_plan", None) or {}),
            "experts_kept_whole": whole,
            "base_model_prefix": getattr(model, "base_model_prefix", ""),
            "tie_word_embeddings": bool(getattr(model.config, "tie_word_embeddings", False)),
        },
    )
