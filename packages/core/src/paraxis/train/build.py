"""Building the model ``paraxis train`` trains: core's ``tiny``, or any family or
pretrained directory a plugin knows, with the ``lora:`` section's adapters when it has
one (:func:`lora_problems`, :func:`adapt`)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from paraxis.config.errors import Problem
from paraxis.config.lora import LoraSection
from paraxis.config.run import ModelSection, RunConfig
from paraxis.engine.lora import with_lora
from paraxis.models.tiny import TinyConfig, TinyTransformer

__all__ = ["adapt", "build_model", "lora_problems", "model_spec"]


def model_spec(cfg: RunConfig, vocab_size: int) -> ModelSection:
    """The model section to build: ``tiny`` takes the tokenizer's vocabulary and the
    trained length unless the config sets them."""
    if (cfg.model.family == "tiny" and not cfg.model.pretrained
            and "vocab_size" not in cfg.model.config):
        return cfg.model.model_copy(update={"config": {
            **cfg.model.config, "vocab_size": vocab_size, "seq_length": cfg.train.seq_length}})
    return cfg.model


def build_model(spec: ModelSection, plugin_manager: Any, *, seed: int = 0,
                deferred: bool = False, lora: LoraSection | None = None) -> nn.Module:
    """The model of ``spec`` (see :func:`_build`), adapted by ``lora`` when given."""
    model = _build(spec, plugin_manager, seed=seed, deferred=deferred)
    return model if lora is None else adapt(model, lora, plugin_manager)


def adapt(model: nn.Module, lora: LoraSection, plugin_manager: Any) -> nn.Module:
    """``model`` with ``lora``'s adapters (``paraxis_apply_lora``: paraxis-hf, through
    peft); ConfigError when the section cannot apply."""
    return with_lora(model, SimpleNamespace(lora=lora), plugin_manager)


def lora_problems(cfg: RunConfig, plugin_manager: Any) -> list[Problem]:
    """What is wrong with ``cfg.lora`` for ``cfg.model``, found on the model's structure
    before any process (``paraxis_lora_problems``); none without a ``lora`` section."""
    if cfg.lora is None:
        return []
    found = plugin_manager.hook.paraxis_lora_problems(config=cfg)
    if found is None:
        return [Problem("lora", cfg.lora.model_dump(), "no installed plugin adapts models "
                        f"of family {cfg.model.family!r}", "pip install 'paraxis-hf[peft]' "
                        "and use a transformers model (model.family or model.pretrained)")]
    return list(found)


def _build(spec: ModelSection, plugin_manager: Any, *, seed: int = 0,
           deferred: bool = False) -> nn.Module:
    """``tiny`` is built here; any other family, or ``pretrained`` weights, by the first
    plugin that knows it. With ``deferred``, a family is first asked of
    ``paraxis_build_deferred``: built on the meta device, each rank materializing only
    what it owns once ``parallelize`` knows the layout (issue 24)."""
    torch.manual_seed(seed)  # every rank starts from the same weights
    if spec.pretrained:
        model = plugin_manager.hook.paraxis_load_pretrained(directory=spec.pretrained,
                                                            config=spec.config)
        if model is None:
            raise ValueError(f"model.pretrained {spec.pretrained!r}: no installed plugin "
                             "loads it; for save_pretrained directories: pip install "
                             "paraxis-hf")
        return model
    if spec.family == "tiny":
        return TinyTransformer(TinyConfig(**spec.config))
    model = None
    if deferred:
        model = plugin_manager.hook.paraxis_build_deferred(family=spec.family,
                                                           config=spec.config, seed=seed)
    if model is None:
        model = plugin_manager.hook.paraxis_build_model(family=spec.family,
                                                        config=spec.config)
    if model is None:
        raise ValueError(f"model.family {spec.family!r}: no installed plugin builds it; "
                         "for Hugging Face model types: pip install paraxis-hf")
    return model
