"""Tiny Hugging Face MoE models built from config (nothing downloaded), the same on
every rank, and every rank's share of a batch."""

import torch

COMMON = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
              max_position_embeddings=64)
# 4 experts, top-2; expert intermediate 48 keeps rows 16-byte aligned for grouped_mm.
FAMILIES = {
    "mixtral": dict(intermediate_size=48, num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(intermediate_size=64, moe_intermediate_size=48, num_experts=4,
                      num_experts_per_tok=2, shared_expert_intermediate_size=64),
    "qwen3_moe": dict(intermediate_size=64, moe_intermediate_size=48, num_experts=4,
                      num_experts_per_tok=2, head_dim=8, norm_topk_prob=True),
}
NUM_EXPERTS, TOP_K, HIDDEN = 4, 2, 32


def build(family, layers=1, seed=0, **overrides):
    """The model, with every parameter redrawn from ``seed`` (routers included, some of
    which transformers initializes to zero)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(family, num_hidden_layers=layers,
                                  **{**COMMON, **FAMILIES[family], **overrides})
    model = AutoModelForCausalLM.from_config(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def shares(world, shape, seed, dtype=torch.float32):
    """Every rank's tensor of ``shape`` (the same list on every rank)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g, dtype=dtype) for _ in range(world)]
