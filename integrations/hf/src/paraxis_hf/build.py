"""Build a transformers causal LM from a config mapping; nothing is downloaded.

``build_causal_lm(family, config)`` builds it whole, with transformers' own init from
torch's global RNG. ``deferred=True`` is the one way to build a model bigger than a rank
(``paraxis train`` builds every Hugging Face family so): the model arrives on the meta
device with no parameter storage, carrying a materializer
(``paraxis.parallel.strategy.MATERIALIZE_ATTR``) that :func:`paraxis.parallelize` calls
once the layout is known. Each rank then draws only the pieces it owns, with the
family's own init rule (:mod:`paraxis_hf.init_rules`) and values that depend on
(seed, parameter name, element) alone (:mod:`paraxis_hf.invariant_init`), so one
process, tensor 4 or pipeline 2 x tensor 2 start from the same model, element for
element. The deferred model is a different draw from the whole one (same distribution,
other numbers).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from paraxis.parallel.strategy import MATERIALIZE_ATTR

__all__ = ["build_causal_lm", "deferred_or_reason", "known_family"]


def known_family(family: str) -> bool:
    from transformers import CONFIG_MAPPING

    return family in CONFIG_MAPPING


def build_causal_lm(family: str, config: dict[str, Any], *, deferred: bool = False,
                    seed: int | None = None, dtype: torch.dtype | None = None) -> nn.Module:
    """``AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **config))``.

    With ``deferred=True`` the model is on the meta device until ``paraxis.parallelize``
    gives each rank its own pieces, drawn from ``seed`` (default: the seed torch's
    global generator was last given, ``torch.initial_seed()``). Built whole or deferred,
    the parameters are in ``dtype`` (default: torch's default dtype), whatever the
    config's ``torch_dtype`` says. Raises ValueError, before any process group, for a
    family whose init cannot be replayed piece by piece (an init function paraxis has no
    rule for, a copy from another parameter), naming the parameters and the calls.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(family, **config)
    # A config.json's torch_dtype is the dtype its checkpoint was saved in; from_config
    # would build the parameters in it. paraxis's parameters are the master weights,
    # fp32 under every train.precision (paraxis.engine.precision), as from_pretrained
    # builds them: a bf16 torch_dtype once gave bf16 masters, and the dry run 0.5 of
    # the plan for every parameter and gradient (issue 32).
    cfg.dtype = dtype or torch.get_default_dtype()
    if not deferred:
        return AutoModelForCausalLM.from_config(cfg)
    from paraxis_hf.init_rules import record_init_rules
    from paraxis_hf.materialize import InvariantInit, meta_model

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype or previous)
    try:
        model = meta_model(cfg, untied=True)  # tied after the init, as eager does
    finally:
        torch.set_default_dtype(previous)
    seed = torch.initial_seed() if seed is None else seed
    rules = record_init_rules(model, seed=seed)
    setattr(model, MATERIALIZE_ATTR, InvariantInit(rules, seed))
    return model


def deferred_or_reason(family: str, config: dict[str, Any],
                       seed: int) -> tuple[nn.Module | None, str]:
    """What ``paraxis train`` builds for ``family`` (``paraxis_build_deferred``): the
    model on the meta device, or None and the reason it is built whole instead: any
    error of the deferred build (an init that cannot be replayed, a constructor that
    fails on meta), or a parity-probe twin that cannot be built (the probe of a deferred
    model runs on a twin; a whole model is its own)."""
    from paraxis.config.parallel import ParallelConfig
    from paraxis_hf.twin import twin_model

    try:
        model = build_causal_lm(family, config, deferred=True, seed=seed)
        twin_model(model, ParallelConfig.from_kwargs())
    except Exception as exc:  # issue 32: any failure falls back to the whole build
        return None, str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
    return model, ""
