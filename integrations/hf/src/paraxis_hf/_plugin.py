"""Entry point of paraxis-hf in the ``paraxis`` plugin group."""

from __future__ import annotations

from typing import Any

from paraxis.parallel.hookspecs import hookimpl


def _peft(model: Any) -> bool:
    """Whether ``model`` is a peft model (peft imported only when it is installed)."""
    import importlib.util

    if importlib.util.find_spec("peft") is None:
        return False
    from paraxis_hf.lora import peft_root

    return peft_root(model) is not None


@hookimpl
def paraxis_model_plan(model: Any) -> Any:
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return None
    if _peft(model):
        from paraxis_hf.lora import peft_plan

        return peft_plan(model)
    if not isinstance(model, PreTrainedModel):
        return None
    from paraxis_hf.plan import hf_plan

    return hf_plan(model)


@hookimpl
def paraxis_build_model(family: str, config: dict[str, Any]) -> Any:
    from paraxis_hf.build import build_causal_lm, known_family

    return build_causal_lm(family, config) if known_family(family) else None


@hookimpl
def paraxis_build_deferred(family: str, config: dict[str, Any], seed: int) -> Any:
    import warnings

    from paraxis_hf.build import deferred_or_reason, known_family

    if not known_family(family):
        return None
    model, reason = deferred_or_reason(family, config, seed)
    if model is None:  # one warning, naming the family and why
        warnings.warn(f"model.family {family!r} is built whole on every rank, not on the "
                      f"meta device: {reason}", stacklevel=2)
    return model


@hookimpl
def paraxis_stage_calls(model: Any, plan: Any) -> Any:
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return None
    from paraxis_hf.stage import HFStageCalls

    if _peft(model):
        from paraxis_hf.lora import peft_stage_prefix

        return HFStageCalls(peft_stage_prefix(model))
    if not isinstance(model, PreTrainedModel):
        return None
    return HFStageCalls(getattr(model, "base_model_prefix", "model"))


@hookimpl
def paraxis_twin_model(model: Any, config: Any) -> Any:
    if _peft(model):
        from paraxis_hf.lora_init import peft_twin

        return peft_twin(model, config)
    from paraxis_hf.twin import twin_model

    return twin_model(model, config)


@hookimpl
def paraxis_apply_lora(model: Any, lora: Any) -> Any:
    from paraxis_hf.lora import apply_lora

    return apply_lora(model, lora)


@hookimpl
def paraxis_lora_problems(config: Any) -> Any:
    from paraxis_hf.lora import problems_for_run

    return problems_for_run(config)


@hookimpl
def paraxis_load_pretrained(directory: str, config: dict[str, Any]) -> Any:
    from paraxis_hf.pretrained import from_pretrained

    return from_pretrained(directory, **config)


@hookimpl
def paraxis_checkpoint_commands(verbs: Any) -> None:
    from paraxis_hf.export import add_export_command

    add_export_command(verbs)
