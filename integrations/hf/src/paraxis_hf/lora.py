"""LoRA through peft (issue 34, item 2): a peft LoRA model parallelized like the
transformers model inside it, and ``paraxis train``'s ``lora:`` section.

peft wraps a transformers model in place: ``get_peft_model(model, LoraConfig(...))``
returns a ``PeftModel`` whose ``base_model.model`` is the transformers model, each
targeted ``nn.Linear`` replaced by a ``lora.Linear`` holding ``base_layer`` (the frozen
original), ``lora_A.<adapter>`` (A, rank x in), ``lora_B.<adapter>`` (B, out x rank),
``lora_dropout.<adapter>`` and the scaling alpha / r; each of ``modules_to_save`` becomes
a wrapper holding the frozen ``original_module`` and a trained copy,
``modules_to_save.<adapter>``.

:func:`peft_plan` is the transformers model's own plan (:func:`paraxis_hf.plan.hf_plan`)
with every name under the wrapper's prefix, each LoRA layer named as an
:class:`~paraxis.parallel.model_plan.Adapter` (the anatomy's ``adapters``: tensor
parallelism splits each with its base, :mod:`paraxis_tp.adapters`), and a tensor-plan
entry on a module to save given to its two copies instead. What paraxis cannot place is
refused before any process group, with the reason (:func:`peft_refusals`).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from torch import nn

from paraxis.config.errors import ConfigError, Problem
from paraxis.engine.lora import ADAPTED_ATTR
from paraxis.parallel.anatomy import find_anatomy
from paraxis.parallel.model_plan import Adapter, ModelPlan, PlanError
from paraxis.parallel.strategy import MATERIALIZE_ATTR
from paraxis_hf.plan import hf_plan

__all__ = ["apply_lora", "lora_config", "lora_target_problems", "peft_plan", "peft_root",
           "peft_stage_prefix"]

# A module peft left whole gets this style, so a plan pattern matching it (the head's,
# the embedding's) splits its two copies instead (tensor_style: first match wins).
_WRAPPER_STYLE = "replicate"


def peft_root(model: nn.Module) -> tuple[str, nn.Module] | None:
    """(name, module) of the transformers model inside a peft model; None for a model
    peft did not wrap (or without peft installed)."""
    try:
        from peft import PeftModel
    except ImportError:
        return None
    if not isinstance(model, PeftModel):
        return None
    inner = model.get_base_model()
    name = next((n for n, m in model.named_modules() if m is inner and n), None)
    if name is None:
        raise PlanError(f"{type(model).__name__}: cannot find the model peft wraps")
    return name, inner


def _adapter_name(model: nn.Module) -> str:
    """The one LoRA adapter of ``model``; PlanError for anything else peft can hold."""
    configs = dict(getattr(model, "peft_config", {}))
    other = {name: str(getattr(c.peft_type, "value", c.peft_type))
             for name, c in configs.items()
             if str(getattr(c.peft_type, "value", c.peft_type)) != "LORA"}
    if other:
        name, kind = next(iter(other.items()))
        raise PlanError(
            f"peft adapter {name!r} is {kind}, not LoRA: paraxis places LoRA's adapters "
            "with their base layers on every axis (a low-rank A and B beside a linear "
            f"layer); {kind}'s parameters (soft prompts, scaling vectors, other "
            "factorizations) have no placement rule and their forward was never checked "
            "against one process. Use a LoraConfig, or train this adapter on one process")
    active = list(getattr(model, "active_adapters", []) or [])
    if len(configs) != 1 or active != list(configs):
        raise PlanError(f"the peft model holds adapters {sorted(configs)} (active: "
                        f"{active}); paraxis trains one LoRA adapter at a time: "
                        "delete the others (peft's delete_adapter)")
    return active[0]


def peft_refusals(model: nn.Module, plan: ModelPlan) -> dict[str, str]:
    """The layouts paraxis refuses for this peft model (``ModelPlan.unsupported``), and
    a PlanError for LoRA on routed experts, which no layout runs: the expert axis (at
    every degree, as for any MoE model) runs the experts itself, and peft's wrapper of
    the experts' 3-D weights (``target_parameters``) cannot be part of that."""
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.lora import LoraLayer

    routed = find_anatomy(model, plan).routed
    unsupported: dict[str, str] = {}
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        if any(name == r or name.startswith(f"{r}.") for r in routed):
            raise PlanError(
                f"{name}: LoRA on routed experts (peft's {type(module).__name__}) is not "
                "supported: paraxis's expert axis runs the experts itself, which peft's "
                "wrapper cannot be part of. Put the adapters on attention (target_modules "
                "q_proj, k_proj, v_proj, o_proj) or on shared experts")
        plain = type(module) is LoraLinear and not module.lora_variant
        if not plain and plan.tensor_style(name) is not None and "tensor" not in unsupported:
            kind = "a LoRA variant (DoRA...)" if type(module) is LoraLinear else \
                f"peft's {type(module).__name__}"
            unsupported["tensor"] = (
                f"{name} is {kind}: tensor parallelism splits plain LoRA linear layers "
                "with their base (B or A on the base's split side); this one's weights "
                "have no such rule. Use plain LoRA (use_dora: false) on linear layers, "
                "or tensor: 1")
    return unsupported


def _adapters(model: nn.Module, adapter: str) -> tuple[Adapter, ...]:
    from peft.tuners.lora import Linear as LoraLinear

    return tuple(
        Adapter(module=n, base=f"{n}.base_layer", down=f"{n}.lora_A.{adapter}",
                up=f"{n}.lora_B.{adapter}", dropout=f"{n}.lora_dropout.{adapter}")
        for n, m in model.named_modules()
        if type(m) is LoraLinear and adapter in m.lora_A and not m.lora_variant)


def _saved_copies(model: nn.Module, tensor: dict[str, str], adapter: str) -> dict[str, str]:
    """Plan entries for the modules to save: the wrapper kept as it is, its copies split
    by the style the plan gives the module (a head, an embedding)."""
    from peft.utils import ModulesToSaveWrapper

    probe = ModelPlan("probe", tensor=tensor)
    entries: dict[str, str] = {}
    for name, module in model.named_modules():
        style = probe.tensor_style(name) if isinstance(module, ModulesToSaveWrapper) else None
        if style is not None:
            entries[name] = _WRAPPER_STYLE
            entries[f"{name}.original_module"] = style
            entries[f"{name}.modules_to_save.{adapter}"] = style
    return entries


def peft_plan(model: nn.Module) -> ModelPlan:
    """The plan of a peft LoRA model: see the module docstring."""
    found = peft_root(model)
    assert found is not None, "peft_plan takes a peft model"
    prefix, inner = found
    adapter = _adapter_name(model)
    plan = hf_plan(inner)

    def under(name: str) -> str:
        return f"{prefix}.{name}"

    tensor = {under(k): v for k, v in plan.tensor.items()}
    saved = _saved_copies(model, tensor, adapter)  # first: before the patterns they match
    tensor = {**saved, **{k: v for k, v in tensor.items() if k not in saved}}
    moved = dataclasses.replace(
        plan, model_class=f"{plan.model_class} (peft LoRA)", tensor=tensor,
        pipeline={under(k): v for k, v in plan.pipeline.items()},
        experts=tuple(under(e) for e in plan.experts),
        extra={**plan.extra, "peft_prefix": prefix,
               "experts_kept_whole": [under(e) for e in plan.extra.get(
                   "experts_kept_whole", ())]})
    refused = peft_refusals(model, moved)
    return dataclasses.replace(moved, unsupported={**plan.unsupported, **refused},
                               adapters=_adapters(model, adapter),
                               source=f"{plan.source}, under peft's {prefix}")


def peft_stage_prefix(model: nn.Module) -> str | None:
    """The dotted path of a peft model's transformers base model (its decoder, which a
    pipeline stage before the last runs for hidden states), or None."""
    found = peft_root(model)
    if found is None:
        return None
    prefix, inner = found
    return f"{prefix}.{getattr(inner, 'base_model_prefix', 'model')}"


def lora_config(lora: Any) -> Any:
    """peft's ``LoraConfig`` for a :class:`paraxis.config.lora.LoraSection`."""
    from peft import LoraConfig

    return LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                      target_modules=lora.target_modules,
                      modules_to_save=list(lora.modules_to_save) or None,
                      task_type="CAUSAL_LM")


def lora_target_problems(model: nn.Module, lora: Any) -> list[Problem]:
    """What stops ``lora`` from wrapping ``model``, found on its module names alone (it
    may be on the meta device): a model peft already wrapped, one that is not a
    transformers model, each target or module to save that matches no module."""
    from peft.tuners.tuners_utils import check_target_module_exists

    found = peft_root(model)
    if found is not None:
        return [Problem("lora", lora.model_dump(), f"the model is already a peft model "
                        f"({type(model).__name__}, adapters {sorted(model.peft_config)}): "
                        "wrapping it again would stack adapters", "drop the lora section, "
                        "or give the transformers model unwrapped")]
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        return [Problem("lora", lora.model_dump(), f"{type(model).__name__} is not a "
                        "transformers model, and paraxis adapts those through peft",
                        "use a transformers model (model.family a model type, or "
                        "model.pretrained)")]
    names = [n for n, _ in model.named_modules() if n]
    problems = []
    targets = lora.target_modules
    if targets is None:
        from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING

        model_type = getattr(model.config, "model_type", "?")
        if model_type not in TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING:
            problems.append(Problem("lora.target_modules", None, f"peft has no default "
                                    f"targets for model type {model_type!r}",
                                    "list the module names to adapt (or all-linear)"))
    for target in [targets] if isinstance(targets, str) and targets != "all-linear" \
            else targets if isinstance(targets, list) else []:
        probe = lora_config(lora.model_copy(update={"target_modules": [target]}))
        if isinstance(targets, str):
            probe.target_modules = target  # a regular expression over whole names
        if not any(check_target_module_exists(probe, n) for n in names):
            problems.append(Problem("lora.target_modules", target, f"matches no module of "
                                    f"{type(model).__name__} (its linear layers end in: "
                                    f"{', '.join(_linear_suffixes(model))})",
                                    "name modules the model has"))
    for kept in lora.modules_to_save:
        if not any(n == kept or n.endswith(f".{kept}") for n in names):
            problems.append(Problem("lora.modules_to_save", kept, f"matches no module of "
                                    f"{type(model).__name__}", "name modules the model has"))
    return problems


def _linear_suffixes(model: nn.Module) -> list[str]:
    return sorted({n.rpartition(".")[2] for n, m in model.named_modules()
                   if isinstance(m, nn.Linear)})


def apply_lora(model: nn.Module, lora: Any) -> nn.Module:
    """``model`` wrapped by ``peft.get_peft_model`` with ``lora``'s adapters (a
    :class:`paraxis.config.lora.LoraSection` or its dict): every weight frozen but the
    adapters and the modules to save. ConfigError, one problem per line, before anything
    is wrapped. A model on the meta device keeps a materializer that gives the base
    weights their values as the unwrapped model would and the adapters peft's init
    (:class:`paraxis_hf.lora_init.PeftMaterializer`)."""
    from paraxis.config.lora import LoraSection

    lora = lora if isinstance(lora, LoraSection) else LoraSection(**lora)
    problems = lora_target_problems(model, lora)
    if problems:
        raise ConfigError(problems)
    from peft import get_peft_model

    inner = getattr(model, MATERIALIZE_ATTR, None)
    try:
        wrapped = get_peft_model(model, lora_config(lora))
    except ValueError as exc:  # peft's own refusal (a target of a kind it cannot wrap)
        why = re.sub(r"\s+", " ", str(exc)).strip()
        raise ConfigError([Problem("lora.target_modules", lora.target_modules, why,
                                   "target linear layers")]) from None
    setattr(wrapped, ADAPTED_ATTR, lora)  # parallelize(config with this lora) keeps it
    if inner is not None:
        from paraxis_hf.lora_init import PeftMaterializer

        prefix = peft_root(wrapped)[0]  # type: ignore[index]
        setattr(wrapped, MATERIALIZE_ATTR, PeftMaterializer(inner, prefix))
    return wrapped


def problems_for_run(cfg: Any) -> list[Problem]:
    """``paraxis_lora_problems``: what stops ``cfg.lora`` from wrapping ``cfg.model``,
    found on its structure built on the meta device (no weights read or drawn)."""
    import importlib.util

    lora = cfg.lora
    if importlib.util.find_spec("peft") is None:
        return [Problem("lora", lora.model_dump(), "needs peft, which is not installed",
                        "pip install 'paraxis-hf[peft]'")]
    import torch
    from transformers import CONFIG_MAPPING, AutoConfig, AutoModelForCausalLM

    spec = cfg.model
    if spec.pretrained:
        config = AutoConfig.from_pretrained(spec.pretrained, **spec.config)
    elif spec.family in CONFIG_MAPPING:
        config = AutoConfig.for_model(spec.family, **spec.config)
    else:
        return [Problem("lora", lora.model_dump(), f"model.family {spec.family!r} is not a "
                        "transformers model type, and paraxis adapts those through peft",
                        "use a transformers family (llama, qwen2...) or model.pretrained")]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return lora_target_problems(model, lora)
