"""One pipeline stage of a transformers decoder, cut along the model's own pp plan.

The stage keeps the model's module names (``model.embed_tokens``, ``model.layers.N``,
``model.norm``, ``lm_head``) so the tensor-parallel plan still matches, and replays what
the base model's forward does around the layers: rotary position embeddings over the
whole sequence, and causal attention. The causal mask is left to SDPA (``is_causal``
when no mask is given), so stages need ``attn_implementation="sdpa"``; no padding mask
is supported, as packed pretraining has none.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from paraxis.plan import ModelPlan, PlanError

__all__ = ["DecoderStage"]


class _Base(nn.Module):
    """Stands where the base model (``model.model``) stood."""

    def __init__(self, embed: nn.Module | None, layers: list[nn.Module], norm: nn.Module | None,
                 rotary: nn.Module):
        super().__init__()
        self.embed_tokens = embed
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        self.rotary_emb = rotary


class DecoderStage(nn.Module):
    def __init__(self, model: nn.Module, plan: ModelPlan, layers: tuple[int, int], *,
                 first: bool, last: bool):
        super().__init__()
        prefix = plan.extra.get("base_model_prefix", "model")
        base = getattr(model, prefix)
        if getattr(model.config, "_attn_implementation", "sdpa") not in ("sdpa",):
            raise PlanError(f"{type(model).__name__}: pipeline stages need "
                            "attn_implementation='sdpa' (causal attention without a mask)")
        rotary = getattr(base, "rotary_emb", None)
        if rotary is None:
            raise PlanError(f"{type(model).__name__}: no rotary_emb on the base model; "
                            "pipeline stages support rotary decoders (Llama, Mistral, Qwen2)")
        a, b = layers
        self.config = model.config
        self.layer_range = layers
        self.sequence_shards = 1
        setattr(self, prefix, _Base(base.embed_tokens if first else None,
                                    list(base.layers[a:b]), base.norm if last else None,
                                    rotary))
        self._prefix = prefix
        self.lm_head = model.lm_head if last else None

    def get_output_embeddings(self) -> nn.Module | None:
        return self.lm_head

    def forward(self, x: torch.Tensor, **_: Any) -> torch.Tensor:
        base = getattr(self, self._prefix)
        if base.embed_tokens is not None:  # token ids: the whole sequence
            h, seq = base.embed_tokens(x), x.shape[1]
        else:  # hidden states, split along the sequence under sequence parallelism
            h, seq = x, x.shape[1] * self.sequence_shards
        positions = torch.arange(seq, device=h.device).unsqueeze(0)
        rotary = base.rotary_emb(h, position_ids=positions)
        for layer in base.layers:
            h = layer(h, attention_mask=None, position_ids=positions,
                      position_embeddings=rotary)
        if base.norm is not None:
            h = base.norm(h)
        return self.lm_head(h) if self.lm_head is not None else h
