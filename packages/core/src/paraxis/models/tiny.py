"""A tiny Llama-style causal LM in plain torch: the built-in model family ``tiny`` and the
reference model of core's tests and benchmarks (Hugging Face models come through paraxis-hf).

It takes ``input_ids`` or ``inputs_embeds`` and optional ``position_ids``, as a
transformers model does, so that pipeline stages run its own forward; :data:`TINY_PLAN`
is its parallel plan, in the vocabulary of transformers' plans.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from paraxis.parallel.model_plan import ModelPlan

__all__ = ["TINY_PLAN", "TinyCalls", "TinyConfig", "TinyTransformer", "causal_lm_loss",
           "random_batches"]


@dataclass(frozen=True)
class TinyConfig:
    vocab_size: int = 128
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    intermediate_size: int = 128
    seq_length: int = 32


class _Block(nn.Module):
    def __init__(self, cfg: TinyConfig):
        super().__init__()
        h = cfg.hidden_size
        self.num_heads = cfg.num_heads
        self.attn_norm = nn.RMSNorm(h)
        self.attn = _Attention(cfg)
        self.mlp_norm = nn.RMSNorm(h)
        self.mlp = _MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class _Attention(nn.Module):
    def __init__(self, cfg: TinyConfig):
        super().__init__()
        h = cfg.hidden_size
        self.num_heads = cfg.num_heads
        self.qkv = nn.Linear(h, 3 * h, bias=False)
        self.out = nn.Linear(h, h, bias=False)
        # Set by TinyTransformer for each forward: (b, 1, s, s) bool, or None (causal).
        # An attribute, not an argument, so plans and hooks see the block's one input.
        self.mask: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        qkv = self.qkv(x)
        q, k, v = qkv.view(b, s, 3, self.num_heads, -1).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), attn_mask=self.mask,
                                           is_causal=self.mask is None)
        return self.out(a.transpose(1, 2).reshape(b, s, -1))


class _MLP(nn.Module):
    def __init__(self, cfg: TinyConfig):
        super().__init__()
        self.up = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class _Embedding(nn.Module):
    """Token embedding plus a learned position embedding."""

    def __init__(self, cfg: TinyConfig):
        super().__init__()
        self.tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.positions = nn.Parameter(torch.randn(cfg.seq_length, cfg.hidden_size) * 0.02)

    def forward(self, ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return self.tokens(ids) + self.positions[position_ids]


class TinyTransformer(nn.Module):
    def __init__(self, cfg: TinyConfig | None = None):
        super().__init__()
        self.config = cfg = cfg or TinyConfig()
        self.embed = _Embedding(cfg)
        self.layers = nn.ModuleList(_Block(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.RMSNorm(cfg.hidden_size)
        self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def hidden_states(self, input_ids: torch.Tensor | None = None,
                      inputs_embeds: torch.Tensor | None = None,
                      position_ids: torch.Tensor | None = None,
                      attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The final norm's output (the head's input). ``attention_mask`` (b, s) masks
        padded keys; ``position_ids`` that restart at 0 start a new document, which no
        token attends across (as transformers does for packed rows)."""
        if inputs_embeds is None:
            assert input_ids is not None
            if position_ids is None:
                position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)
            inputs_embeds = self.embed(input_ids, position_ids)
        x = inputs_embeds
        mask = _attention_mask(x.shape[1], position_ids, attention_mask, x.device)
        for layer in self.layers:
            attn = getattr(layer, "attn", None)
            if attn is not None:
                attn.mask = mask
            x = layer(x)
        return self.norm(x)

    def forward(self, input_ids: torch.Tensor | None = None,
                inputs_embeds: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.head(self.hidden_states(input_ids, inputs_embeds, position_ids,
                                            attention_mask))


def _attention_mask(s: int, position_ids: torch.Tensor | None,
                    attention_mask: torch.Tensor | None,
                    device: torch.device) -> torch.Tensor | None:
    """(b, 1, s, s) bool: causal, within a document, to real keys (a row with no real
    key sees itself, so a pad's output stays finite); None when plain causal will do."""
    restarts = position_ids is not None and bool((position_ids.reshape(-1, s)[:, 1:] == 0).any())
    if not restarts and attention_mask is None:
        return None
    causal = torch.ones(s, s, dtype=torch.bool, device=device).tril()[None]
    if restarts:
        starts = position_ids.reshape(-1, s) == 0
        starts[:, 0] = True
        docs = starts.long().cumsum(-1)
        causal = causal & (docs[:, :, None] == docs[:, None, :])
    if attention_mask is not None:
        causal = causal & attention_mask.bool()[:, None, :]
    return (causal | torch.eye(s, dtype=torch.bool, device=device)[None])[:, None]


class TinyCalls:
    """How a pipeline stage runs the tiny model (:class:`paraxis.parallel.stages.StageCalls`)."""

    def logits(self, model: nn.Module, **kwargs: Any) -> torch.Tensor:
        return TinyTransformer.forward(model, **kwargs)

    def hidden(self, model: nn.Module, **kwargs: Any) -> torch.Tensor:
        return TinyTransformer.hidden_states(model, **kwargs)


# The fused qkv is gathered (the block slices it with global sizes), as transformers
# does for Phi-3's fused projections; the output projection then splits its input.
TINY_PLAN = ModelPlan(
    "TinyTransformer",
    tensor={
        "embed.tokens": "embedding_rowwise",
        "layers.*.attn.qkv": "colwise_gather_output",
        "layers.*.attn.out": "rowwise_split_input",
        "layers.*.mlp.up": "colwise",
        "layers.*.mlp.down": "rowwise",
        "head": "colwise_gather_output",
    },
    pipeline={
        "embed": (("input_ids",), ("inputs_embeds",)),
        "layers": (("hidden_states",), ("hidden_states",)),
        "norm": (("hidden_states",), ("hidden_states",)),
        "head": (("hidden_states",), ("logits",)),
    },
    source="paraxis's own plan for its tiny model",
)


def causal_lm_loss(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy: position i predicts token i + 1."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                           input_ids[:, 1:].reshape(-1))


def random_batches(steps: int, batch: int, cfg: TinyConfig, seed: int = 0) -> torch.Tensor:
    """``steps`` global batches of token ids, shape (steps, batch, seq)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (steps, batch, cfg.seq_length), generator=g)
