"""Which causal LMs transformers has, which are text-only, and their tiny models.

Every model type of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` is a row. A type is *not a
text-only causal LM* (left out of the matrix's denominators, and listed) when its
causal-LM class takes another modality's input, or its config is another modality's or
an encoder-decoder's (:func:`not_text_only`). Every other type gets a tiny model from
:func:`paraxis_hf.shrink.tiny_config`, tried with the shrinker's relaxations in
turn (:func:`build_family`) until one builds, runs a forward and backward on token ids
alone and stays small; otherwise the first reason is recorded.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from typing import Any

import torch
from torch import nn

from paraxis_hf.shrink import LADDER, SEQ, VOCAB, first_line, tiny_config

__all__ = ["MAX_PARAMS", "Family", "build_family", "build_model", "causal_lm_types",
           "not_text_only", "shipped_plans"]

# A tiny model has well under a million parameters; one far larger kept a default size
# the shrinker did not reach, so the next relaxation is tried.
MAX_PARAMS = 2_000_000
# Forward inputs of another modality (or of another model): images, video, audio,
# encoder outputs, a target model's key/value states (draft models).
OTHER_INPUTS = re.compile(r"pixel|image|video|audio|input_features|encoder_outputs|"
                          r"mm_encoder|shared_kv_states")
# Sub-configs of another modality: the type's config is a multimodal model's.
OTHER_CONFIGS = re.compile(r"vision|audio|vq_|speech|image|video|depth_decoder|text_encoder")


@dataclasses.dataclass(frozen=True)
class Family:
    """One model type: how to build its tiny model, or why it is not in the matrix."""

    model_type: str
    model_class: str
    not_text: str | None = None  # why it is not a text-only causal LM
    error: str | None = None  # why no tiny model could be built
    overrides: dict[str, Any] | None = None  # the tiny config, as config kwargs
    relax: tuple[str, ...] = ()
    plans: tuple[str, ...] = ()  # "tensor", "pipeline", "expert": plans paraxis reads
    shipped: tuple[str, ...] = ()  # the plans its config class ships (the denominators)
    params: int = 0
    tied: bool = False

    @property
    def built(self) -> bool:
        return self.not_text is None and self.error is None


def causal_lm_types() -> dict[str, str]:
    """Model type -> causal-LM class name, as transformers maps them."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def not_text_only(model_type: str, class_name: str) -> str | None:
    """Why ``model_type`` is not a text-only causal LM, or None if it is."""
    import transformers
    from transformers import CONFIG_MAPPING

    cls = getattr(transformers, class_name, None)
    if cls is not None:
        params = [p for p in inspect.signature(cls.forward).parameters if OTHER_INPUTS.search(p)]
        if params:
            return f"its forward takes {', '.join(params[:3])}"
    config_cls = CONFIG_MAPPING[model_type]
    subs = [k for k in getattr(config_cls, "sub_configs", {}) if OTHER_CONFIGS.search(k)]
    if subs:
        return f"its config holds {', '.join(subs)} (a multimodal model's)"
    try:
        encoder_decoder = bool(getattr(config_cls(), "is_encoder_decoder", False))
    except Exception:
        encoder_decoder = False
    if encoder_decoder:
        return "the decoder of an encoder-decoder (it cross-attends to encoder states)"
    return None


def build_model(model_type: str, overrides: dict[str, Any], seed: int = 0) -> nn.Module:
    """The tiny model of ``model_type`` from its overrides, weights drawn from ``seed``."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    config = CONFIG_MAPPING[model_type](**overrides)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config)


def _runs(model: nn.Module) -> None:
    """A forward with token ids and ``labels=`` alone, and its backward."""
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    if loss is None or not torch.isfinite(loss):
        raise ValueError(f"its labels= loss is {loss}")
    loss.backward()


def _plans(model: nn.Module) -> tuple[str, ...]:
    from paraxis_hf.plan import hf_plan

    plan = hf_plan(model)
    return tuple(axis for axis, part in (("tensor", plan.tensor), ("pipeline", plan.pipeline),
                                         ("expert", plan.experts)) if part)


def shipped_plans(model_type: str) -> tuple[str, ...]:
    """The plans ``model_type``'s config class ships (``base_model_tp_plan``...)."""
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    return tuple(axis for axis, attr in (("tensor", "base_model_tp_plan"),
                                         ("pipeline", "base_model_pp_plan"),
                                         ("expert", "base_model_ep_plan"))
                 if getattr(cls, attr, None))


def build_family(model_type: str, class_name: str) -> Family:
    """Classify ``model_type`` and find its tiny model (see the module docstring)."""
    shipped = shipped_plans(model_type)
    why = not_text_only(model_type, class_name)
    if why:
        return Family(model_type, class_name, not_text=why, shipped=shipped)
    errors: list[str] = []
    large: Family | None = None
    for relax in LADDER:
        tiny = tiny_config(model_type, relax)
        if tiny.error:
            errors.append(tiny.error)
            continue
        try:
            model = build_model(model_type, tiny.overrides)
            _runs(model)
        except Exception as exc:
            errors.append(first_line(exc))
            continue
        family = Family(model_type, class_name, overrides=tiny.overrides, shipped=shipped,
                        relax=tuple(sorted(relax)), plans=_plans(model),
                        params=sum(p.numel() for p in model.parameters()),
                        tied=bool(getattr(model.config, "tie_word_embeddings", False)))
        if family.params <= MAX_PARAMS:
            return family
        large = large or family
    if large is not None:
        return large
    return Family(model_type, class_name, error=errors[0] if errors else "no attempt ran",
                  shipped=shipped)
