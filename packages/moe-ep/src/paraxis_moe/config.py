"""The ``moe`` configuration section and the expert axis' validation rules.

``capacity_factor`` None (the default) is dropless: every routed (token, expert) pair
is computed, as the Hugging Face model computes it. A factor caps each expert at
``max(min_capacity, ceil(factor * T * k / E))`` pairs of the ``T`` tokens a rank routes
(Megatron-Core's ``get_capacity``); :mod:`paraxis_moe.capacity` says which pairs drop.
The loss coefficients default to the model's own (``router_aux_loss_coef``) and to no
z-loss (ST-MoE, arXiv:2202.08906).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, NonNegativeInt, ValidationError

from paraxis.errors import Problem

__all__ = ["TOP_K_KEYS", "MoEConfig", "experts_per_token", "moe_problems"]

# Where Hugging Face configs keep top-k: every family surveyed uses the first.
TOP_K_KEYS = ("num_experts_per_tok", "moe_topk", "num_selected_experts", "top_k")


class MoEConfig(BaseModel):
    """Capacity and router-loss settings of the expert axis (config section ``moe``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    capacity_factor: float | None = None
    drop_policy: Literal["probs", "position"] = "probs"
    # DeepSpeed-MoE's default floor, so tiny local batches do not drop everything.
    min_capacity: NonNegativeInt = 4
    # None: the model's router_aux_loss_coef (0 when it has none).
    aux_loss_coef: float | None = None
    z_loss_coef: float = 0.0

    @classmethod
    def of(cls, config: Any) -> MoEConfig:
        """The ``moe`` section of a run/parallel config (a MoEConfig, a mapping, or
        absent: the defaults). Raises pydantic's ValidationError on bad types."""
        section = getattr(config, "moe", None)
        if section is None and isinstance(config, Mapping):
            section = config.get("moe")
        if section is None:
            return cls()
        if isinstance(section, cls):
            return section
        return cls.model_validate(dict(section))

    def aux_coef_for(self, model_config: Any) -> float:
        if self.aux_loss_coef is not None:
            return float(self.aux_loss_coef)
        return float(getattr(model_config, "router_aux_loss_coef", 0.0) or 0.0)


def experts_per_token(config: Any) -> int | None:
    """Top-k of a Hugging Face config object or ``config.json`` dict (None if absent)."""
    get = config.get if isinstance(config, Mapping) else lambda k: getattr(config, k, None)
    for key in TOP_K_KEYS:
        value = get(key)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _has(problems: list[Problem], field: str) -> bool:
    return any(p.field == field for p in problems)


def moe_problems(config: Any, model: Any, problems: list[Problem]) -> list[Problem]:
    """The expert axis' rules, as new problems (``problems`` is what was found so far:
    a rule core already reported for the same field is not reported twice)."""
    found: list[Problem] = []
    try:
        moe = MoEConfig.of(config)
    except ValidationError as exc:
        return [Problem("moe." + ".".join(str(p) for p in e["loc"]), e.get("input"), e["msg"],
                        "see paraxis_moe.MoEConfig for the allowed values")
                for e in exc.errors()]
    cf = moe.capacity_factor
    if cf is not None and cf <= 0:
        found.append(Problem("moe.capacity_factor", cf, "must be > 0 (or null: dropless)",
                             "use e.g. 1.25, or null to drop no token"))
    if moe.z_loss_coef < 0:
        found.append(Problem("moe.z_loss_coef", moe.z_loss_coef, "must be >= 0",
                             "use 0 (off) or a small positive value such as 1e-3"))
    degree = config.parallelism.expert
    if model is None:
        return found
    experts = int(getattr(model, "num_experts", 0) or 0)
    if degree > 1 and experts == 0 and not _has(problems, "parallelism.expert"):
        found.append(Problem("parallelism.expert", degree, "the model is dense (no experts)",
                             "set expert: 1 or use a mixture-of-experts model"))
    if degree > 1 and experts and experts % degree and not _has(problems, "model.num_experts"):
        found.append(Problem(
            "model.num_experts", experts, f"must be divisible by the expert degree {degree}",
            f"choose expert among {[d for d in range(1, experts + 1) if experts % d == 0]}"))
    # ModelShape has no top-k yet (proposed: ModelShape.experts_per_token, read from
    # the TOP_K_KEYS of the HF config); read it wherever it is.
    top_k = getattr(model, "experts_per_token", None) or experts_per_token(model)
    if experts and top_k and top_k > experts:
        found.append(Problem("model.num_experts_per_tok", top_k,
                             f"routes each token to more experts than the {experts} there are",
                             f"set num_experts_per_tok <= {experts}"))
    return found
