"""The ``moe`` configuration section and the expert axis' validation rules.

The section is core's :class:`paraxis.config.MoEConfig` (``config.moe``):
``capacity_factor`` None (the default) is dropless: every routed (token, expert) pair
is computed, as the Hugging Face model computes it. A factor caps each expert at
``max(min_capacity, ceil(factor * T * k / E))`` pairs of the ``T`` tokens a rank routes
(Megatron-Core's ``get_capacity``); :mod:`paraxis_moe.capacity` says which pairs drop.
The load-balancing loss is always trained (as with ``output_router_logits=True``) at
the model's ``router_aux_loss_coef`` unless ``aux_loss_coef`` overrides it (0 turns it
off); the router z-loss (ST-MoE, arXiv:2202.08906) defaults to off.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from paraxis.config.errors import Problem
from paraxis.config.parallel import MoEConfig
from paraxis.config.shape import config_size

__all__ = ["MoEConfig", "aux_coef", "experts_per_token", "group_limit_problems", "moe_config",
           "moe_problems"]


def moe_config(config: Any) -> MoEConfig:
    """The ``moe`` section of a run/parallel config (a MoEConfig, a mapping, or absent:
    the defaults). Raises pydantic's ValidationError on bad values."""
    section = getattr(config, "moe", None)
    if section is None and isinstance(config, Mapping):
        section = config.get("moe")
    if section is None:
        return MoEConfig()
    if isinstance(section, MoEConfig):
        return section
    return MoEConfig.model_validate(dict(section))


def aux_coef(moe: MoEConfig, model_config: Any) -> float:
    """The load-balancing loss coefficient: ``moe.aux_loss_coef``, else the model's
    ``router_aux_loss_coef`` (JetMoE's ``aux_loss_coef``; 0 when it has none)."""
    if moe.aux_loss_coef is not None:
        return float(moe.aux_loss_coef)
    for key in ("router_aux_loss_coef", "aux_loss_coef"):
        value = getattr(model_config, key, None)
        if value is not None:
            return float(value)
    return 0.0


def experts_per_token(config: Any) -> int | None:
    """Top-k of a Hugging Face config object or ``config.json`` dict (None if absent),
    in core's one table of spellings (:data:`paraxis.config.shape.SIZE_SPELLINGS`)."""
    value = config_size(config, "experts_per_token")
    return value if isinstance(value, int) and value > 0 else None


def _has(problems: list[Problem], field: str) -> bool:
    return any(p.field == field for p in problems)


def moe_problems(config: Any, model: Any, problems: list[Problem]) -> list[Problem]:
    """The expert axis' rules, as new problems (``problems`` is what was found so far:
    a rule already reported for the same field is not reported twice). ``model`` is a
    :class:`paraxis.config.shape.ModelShape` or None."""
    try:
        moe = moe_config(config)
    except ValidationError as exc:
        return [Problem("moe." + ".".join(str(p) for p in e["loc"]), e.get("input"), e["msg"],
                        "see paraxis.config.MoEConfig for the allowed values")
                for e in exc.errors()]
    found: list[Problem] = []
    par = config.parallelism
    degree = par.expert
    found += _expert_tensor_problems(par, model)
    if model is None:
        return found
    experts = int(getattr(model, "num_experts", 0) or 0)
    if degree > 1 and experts == 0 and not _has(problems, "parallelism.expert"):
        found.append(Problem("parallelism.expert", degree, "the model has no experts",
                             "set expert: 1, or use a mixture-of-experts model"))
    if degree > 1 and experts and experts % degree and not _has(problems, "model.num_experts"):
        found.append(Problem(
            "model.num_experts", experts, f"must be divisible by the expert degree {degree}",
            f"choose expert among {[d for d in range(1, experts + 1) if experts % d == 0]}"))
    top_k = getattr(model, "experts_per_token", None) or experts_per_token(model)
    if experts and top_k and top_k > experts:
        found.append(Problem("model.num_experts_per_tok", top_k,
                             f"routes each token to more experts than the {experts} there are",
                             f"set num_experts_per_tok <= {experts}"))
    if moe.capacity_factor is not None and moe.capacity_factor <= 0:
        found.append(Problem("moe.capacity_factor", moe.capacity_factor,
                             "must be > 0 (or null: dropless)",
                             "use e.g. 1.25, or null to drop no token"))
    return found


def group_limit_problems(model_config: Any) -> list[Problem]:
    """DeepSeek-V3's group-limited routing (``n_group``, ``topk_group``), checked before
    any process group: its router views the scores as ``(tokens, n_group, E / n_group)``,
    sums each group's two best scores and keeps the ``topk_group`` best groups with
    ``torch.topk``, so a ``topk_group`` above ``n_group`` (or ``n_group`` not dividing
    the experts) fails only inside the first forward, as a bare shape or range error."""
    groups = getattr(model_config, "n_group", None)
    keep = getattr(model_config, "topk_group", None)
    if not isinstance(groups, int) or not isinstance(keep, int):
        return []
    experts = int(getattr(model_config, "n_routed_experts", None)
                  or getattr(model_config, "num_local_experts", None) or 0)
    found: list[Problem] = []
    if groups < 1 or keep < 1 or keep > groups:
        found.append(Problem("model.topk_group", keep,
                             f"the router keeps topk_group of n_group={groups} expert groups "
                             "per token, so it must be between 1 and n_group",
                             f"set topk_group <= {max(groups, 1)}"))
    elif experts and experts % groups:
        found.append(Problem("model.n_group", groups,
                             f"must divide the {experts} routed experts (the router views "
                             "them as n_group equal groups)",
                             f"choose n_group among "
                             f"{[d for d in range(1, experts + 1) if experts % d == 0]}"))
    return found


def _expert_tensor_problems(par: Any, model: Any) -> list[Problem]:
    """``expert_tensor`` > 1 (each expert's FFN split over the tensor group) on a dense
    model. Whether it divides the tensor degree is core's rule; whether it divides the
    experts' FFN width is checked on the module (``ExpertParallelStrategy.check_model``).
    Pipeline stages, context ranks and ZeRO (stages 1 and 3) run it at parity
    (tests/test_moe_expert_tensor.py)."""
    etp = par.expert_tensor
    if etp == 1 or model is None or int(getattr(model, "num_experts", 0) or 0):
        return []
    return [Problem("parallelism.expert_tensor", etp, "the model has no experts",
                    "set expert_tensor: 1, or use a mixture-of-experts model")]
