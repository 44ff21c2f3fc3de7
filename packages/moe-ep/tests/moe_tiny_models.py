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
    # Biases, transposed (E, h, 2I) interleaved gate/up, its own clamped SwiGLU; the
    # router has a bias and takes top-k of logits before the softmax.
    "gpt_oss": dict(intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
                    head_dim=8, layer_types=["full_attention"] * 2),
    # Sigmoid gates with e_score_correction_bias, grouped top-k, routed scaling, a
    # shared expert, float32 routing weights.
    "deepseek_v3": dict(intermediate_size=64, moe_intermediate_size=48, n_routed_experts=4,
                        num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=0,
                        n_shared_experts=1, kv_lora_rank=16, q_lora_rank=16,
                        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8),
    "olmoe": dict(intermediate_size=48, num_experts=4, num_experts_per_tok=2),
    # Top-k on bias-corrected probabilities, a shared expert; MoE from layer 0 here.
    "ernie4_5_moe": dict(intermediate_size=64, moe_intermediate_size=48, moe_num_experts=4,
                         moe_k=2, moe_num_shared_experts=1, moe_layer_start_index=0),
}
NUM_EXPERTS, TOP_K, HIDDEN = 4, 2, 32


def build(family, layers=1, seed=0, **overrides):
    """The model, with every parameter redrawn from ``seed`` (routers included, some of
    which transformers initializes to zero)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = {**COMMON, **FAMILIES[family], **overrides}
    if "layer_types" in kwargs:
        kwargs["layer_types"] = kwargs["layer_types"][:1] * layers
    config = AutoConfig.for_model(family, num_hidden_layers=layers, **kwargs)
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


def plan_of(model):
    """The plan paraxis-hf would give: the modules holding an ``experts`` child (the
    package's own tests run without paraxis-hf installed)."""
    from paraxis.parallel.model_plan import ModelPlan

    blocks = tuple(n for n, m in model.named_modules()
                   if isinstance(getattr(m, "experts", None), torch.nn.Module))
    return ModelPlan(type(model).__name__, experts=blocks,
                     extra={"forward_kwargs": {"use_cache": False}})
