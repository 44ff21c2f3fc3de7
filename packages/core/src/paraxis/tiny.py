"""A tiny Llama-style causal LM in plain torch: the built-in model family ``tiny`` and the
reference model of core's tests and benchmarks (Hugging Face models come through paraxis-hf)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["TinyConfig", "TinyTransformer", "causal_lm_loss", "random_batches"]


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
        self.qkv = nn.Linear(h, 3 * h, bias=False)
        self.out = nn.Linear(h, h, bias=False)
        self.mlp_norm = nn.RMSNorm(h)
        self.up = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, s, 3, self.num_heads, -1).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        x = x + self.out(a.transpose(1, 2).reshape(b, s, h))
        return x + self.down(F.gelu(self.up(self.mlp_norm(x))))


class TinyTransformer(nn.Module):
    def __init__(self, cfg: TinyConfig | None = None):
        super().__init__()
        self.config = cfg = cfg or TinyConfig()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.pos = nn.Parameter(torch.randn(cfg.seq_length, cfg.hidden_size) * 0.02)
        self.layers = nn.ModuleList(_Block(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.RMSNorm(cfg.hidden_size)
        self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids) + self.pos[: input_ids.shape[1]]
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def causal_lm_loss(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy: position i predicts token i + 1."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                           input_ids[:, 1:].reshape(-1))


def random_batches(steps: int, batch: int, cfg: TinyConfig, seed: int = 0) -> torch.Tensor:
    """``steps`` global batches of token ids, shape (steps, batch, seq)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (steps, batch, cfg.seq_length), generator=g)
