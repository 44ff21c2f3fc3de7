"""Build a transformers causal LM from a config mapping; nothing is downloaded."""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["build_causal_lm", "known_family"]


def known_family(family: str) -> bool:
    from transformers import CONFIG_MAPPING

    return family in CONFIG_MAPPING


def build_causal_lm(family: str, config: dict[str, Any]) -> nn.Module:
    """``AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **config))``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(family, **config)
    return AutoModelForCausalLM.from_config(cfg)
