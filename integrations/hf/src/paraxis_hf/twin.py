"""A shrunk twin of a transformers model, for the parity probe of a model that cannot run
whole on one rank (pretrained weights loaded by slices, a model built on the meta
device).

The twin has the model's class and config, every size shrunk by the coverage matrix's
rules (:mod:`paraxis_hf.shrink`: per-layer structure kept, dropout off), then grown
where the layout needs it: query heads divisible by tensor (x context under Ulysses),
key/value heads by tensor, experts by the expert degree, and at least one layer per
pipeline stage and chunk. It runs the same plan through the same axes as the model;
the probe compares it with itself in one process (paraxis.engine.probe).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from paraxis_hf.shrink import (
    _ROLE_OF,
    LADDER,
    _aliases,
    _Context,
    _is_token_key,
    first_line,
    shrink_values,
)
from paraxis_hf.sizes import EXPERTS, HEADS, KV_HEADS, LAYERS

__all__ = ["twin_config", "twin_model"]


def _sizes(config: Any) -> dict[str, int]:
    """The layout's needs: role -> smallest multiple (heads, kv_heads, experts) or count
    (layers)."""
    par, sched = config.parallelism, config.schedule
    ulysses = par.context if par.context_mode == "ulysses" else 1
    return {"heads": par.tensor * ulysses, "kv_heads": par.tensor, "experts": par.expert,
            "layers": par.pipeline * sched.virtual_stages}


def twin_config(model_config: Any, layout: Any, relax: frozenset[str] = frozenset()) -> Any:
    """``model_config`` shrunk for ``layout`` (a ParallelConfig) with the shrinker's
    relaxations ``relax``; raises with the reason when the config cannot be shrunk."""
    need = _sizes(layout)
    values, cls = model_config.to_dict(), type(model_config)
    keep = max(LAYERS, need["layers"])
    ctx = _Context.of(values, relax, {}, keep)
    overrides = shrink_values(values, ctx, cls)
    if "is_decoder" in values:  # BERT-likes: a causal LM's config is a decoder's
        overrides["is_decoder"] = values["is_decoder"]
    # A size already tiny is not among the changes; the twin keeps it rather than take
    # the class's default (GPT-2's n_head 12 over a shrunk n_embd of 64). So are token
    # ids already inside the vocabulary: ModernBERT-decoder's default pad id, 50283,
    # over a kept vocabulary of 256 fails its embedding's padding_idx check (issue 32).
    aliases = _aliases(cls)
    for key, value in values.items():
        if (key in _ROLE_OF or _is_token_key(key)) and aliases.get(key, key) not in overrides:
            overrides[aliases.get(key, key)] = value
    grown = {"heads": _multiple(HEADS, math.lcm(need["heads"], need["kv_heads"])),
             "kv_heads": _multiple(KV_HEADS, need["kv_heads"]),
             "experts": _multiple(EXPERTS, need["experts"]), "layers": len(ctx.chosen) or keep}
    for key in list(overrides):
        role = _ROLE_OF.get(key)
        if role in grown and isinstance(overrides[key], int) and overrides[key] > 0:
            overrides[key] = grown[role]
    overrides["attn_implementation"] = getattr(model_config, "_attn_implementation", None)
    twin = cls(**{k: v for k, v in overrides.items() if k != "attn_implementation"})
    twin._attn_implementation = overrides["attn_implementation"]
    return twin


def _multiple(tiny: int, divisor: int) -> int:
    """The smallest multiple of ``divisor`` at least ``tiny``."""
    return divisor * math.ceil(tiny / max(divisor, 1))


def twin_model(model: nn.Module, layout: Any) -> nn.Module | None:
    """A twin of ``model`` for ``layout``, built from config in fp32 on the CPU with
    seeded weights; None if ``model`` is not a transformers model."""
    try:
        from transformers import AutoModelForCausalLM, PreTrainedModel
    except ImportError:
        return None
    if not isinstance(model, PreTrainedModel):
        return None
    errors = []
    for relax in LADDER:  # as the matrix finds its tiny configs (GPT-Neo needs explicit)
        try:
            config = twin_config(model.config, layout, relax)
            config.dtype = torch.float32
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)
                return AutoModelForCausalLM.from_config(config).float()
        except Exception as exc:
            errors.append(first_line(exc))
    raise ValueError(f"cannot shrink {type(model).__name__}'s config to a twin: {errors[0]}")
