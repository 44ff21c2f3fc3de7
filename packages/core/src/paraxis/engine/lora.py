"""A run config's ``lora:`` section at :func:`paraxis.parallelize`: the model given is
wrapped with the section's adapters (``paraxis_apply_lora``: paraxis-hf, through peft)
before anything else reads it, as ``paraxis train`` does; a model that already carries
peft adapters it was not built with from this very section is refused, one line before
any process group (issue 34: a second wrap would stack adapters on adapters)."""

from __future__ import annotations

from typing import Any

from torch import nn

from paraxis.config.errors import ConfigError, Problem

__all__ = ["ADAPTED_ATTR", "with_lora"]

# Set by the plugin that wrapped a model, to the section it applied: ``paraxis train``
# builds the adapted model, then parallelizes it with the same config.
ADAPTED_ATTR = "paraxis_lora"


def with_lora(model: nn.Module, config: Any, plugin_manager: Any) -> nn.Module:
    """``model`` with ``config.lora``'s adapters, or ``model`` when the config has none
    or ``model`` was built from this section; ConfigError when they cannot apply."""
    lora = getattr(config, "lora", None)
    if lora is None or getattr(model, ADAPTED_ATTR, None) == lora:
        return model
    adapted = plugin_manager.hook.paraxis_apply_lora(model=model, lora=lora)
    if adapted is None:
        raise ConfigError([Problem("lora", lora.model_dump(), "no installed plugin adapts "
                                   f"{type(model).__name__}", "for transformers models: "
                                   "pip install 'paraxis-hf[peft]'")])
    return adapted
