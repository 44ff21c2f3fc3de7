"""Debug-sized configs of the families paraxis-hf is tested with (like torchtitan's
"debugmodel"): small enough for CPU tests, same module structure as the real models."""

from __future__ import annotations

import torch
from torch import nn

from paraxis_hf.build import build_causal_lm

__all__ = ["DEBUG_CONFIGS", "build_debug_model", "load_on_one_rank"]

_DECODER = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
            "max_position_embeddings": 64}
_TOKENS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
DEBUG_CONFIGS: dict[str, dict[str, object]] = {
    "llama": _DECODER,
    "mistral": {**_DECODER, "sliding_window": None},
    "qwen2": _DECODER,  # q/k/v carry biases
    "gpt2": {"n_embd": 32, "n_layer": 2, "n_head": 4, "vocab_size": 128, "n_positions": 64,
             "bos_token_id": 0, "eos_token_id": 0, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
             "attn_pdrop": 0.0},
    # Mixture-of-experts families: 4 experts, top-2 (paraxis-moe-ep's parity runs). Mixtral
    # (softmax, top-k, renormalized); Qwen2-MoE (no renormalization, a gated shared
    # expert); Qwen3-MoE (renormalized, q/k norms); ERNIE-4.5-MoE (top-k on
    # bias-corrected probabilities, shared experts, a dense first layer, tied embeddings).
    "mixtral": {**_DECODER, "num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2_moe": {**_DECODER, "num_experts": 4, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64},
    "qwen3_moe": {**_DECODER, "num_experts": 4, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 32, "head_dim": 8, "norm_topk_prob": True},
    "ernie4_5_moe": {**_DECODER, **_TOKENS, "moe_num_experts": 4, "moe_k": 2,
                     "moe_intermediate_size": 32, "moe_num_shared_experts": 1,
                     "moe_layer_start_index": 1},
    # DeepSeek-V3: sigmoid scores with e_score_correction_bias, group-limited top-k (8
    # experts in 4 groups, the best 2 groups, top-2 of their 4), a shared expert, a dense
    # first layer (first_k_dense_replace), multi-head latent attention (q and kv LoRA).
    "deepseek_v3": {**_DECODER, "num_key_value_heads": 4, "n_routed_experts": 8,
                    "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2,
                    "moe_intermediate_size": 32, "n_shared_experts": 1,
                    "first_k_dense_replace": 1, "kv_lora_rank": 16, "q_lora_rank": 16,
                    "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8},
    # Fused qkv_proj and gate_up_proj (tensor plan: colwise_gather_output).
    "phi3": {**_DECODER, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
    # Families with a quirk a pipeline stage or a tensor shard must keep: q/k norms;
    # tied embeddings with NoPE layers; tied embeddings with biases; parallel attention
    # and MLP with other module names; scaled embeddings, logit softcapping, sliding
    # windows and eager attention.
    "qwen3": {**_DECODER, "head_dim": 8},
    "smollm3": {**_DECODER, **_TOKENS, "no_rope_layer_interval": 2},
    "starcoder2": {**_DECODER, **_TOKENS},
    "gpt_neox": {k: v for k, v in _DECODER.items() if k != "num_key_value_heads"},
    "gemma2": {**_DECODER, **_TOKENS, "head_dim": 8, "sliding_window": 8,
               "query_pre_attn_scalar": 8},
    # Attention variants under context parallelism (issue 35): sinks with a sliding
    # window (gpt-oss: yarn rope as shipped, its original length shrunk with the model);
    # chunked attention and a NoPE layer with temperature tuning (Llama 4).
    "gpt_oss": {**_DECODER, "head_dim": 8, "num_local_experts": 4, "num_experts_per_tok": 2,
                "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"],
                "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                                    "beta_slow": 1.0, "truncate": False, "rope_theta": 1.5e5,
                                    "original_max_position_embeddings": 16}},
    "llama4_text": {**_DECODER, "head_dim": 8, "intermediate_size_mlp": 64,
                    "num_local_experts": 4, "num_experts_per_tok": 2, "moe_layers": [0, 1],
                    "no_rope_layers": [1, 0], "attention_chunk_size": 8,
                    "layer_types": ["chunked_attention", "full_attention"]},
    # Recurrent layers (issue 35, context parallelism passing their state): Bamba, a
    # Mamba-2 layer then attention; Nemotron-H, Mamba-2, MoE, attention and MLP layers;
    # Qwen3-Next, the gated delta rule then attention, MoE; Mamba, a pure Mamba-1 SSM.
    "bamba": {**_DECODER, "attn_layer_indices": [1], "mamba_n_heads": 4, "mamba_d_head": 8,
              "mamba_d_state": 8, "mamba_expand": 1, "mamba_chunk_size": 16},
    "nemotron_h": {**{k: v for k, v in _DECODER.items() if k != "num_hidden_layers"},
                   "head_dim": 8, "ssm_state_size": 8, "mamba_num_heads": 4,
                   "mamba_head_dim": 8, "n_groups": 1, "expand": 1, "chunk_size": 16,
                   "n_routed_experts": 4, "num_experts_per_tok": 2,
                   "moe_intermediate_size": 16, "moe_shared_expert_intermediate_size": 16},
    "qwen3_next": {**_DECODER, "head_dim": 8, "linear_key_head_dim": 8,
                   "linear_value_head_dim": 8, "linear_num_key_heads": 2,
                   "linear_num_value_heads": 4, "num_experts": 4, "num_experts_per_tok": 2,
                   "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16,
                   "layer_types": ["linear_attention", "full_attention"]},
    "mamba": {"hidden_size": 32, "num_hidden_layers": 2, "vocab_size": 128, "expand": 1,
              "state_size": 8, "time_step_rank": 8},
    # Recurrences a module runs in its own forward: MiniMax's lightning attention (blocks
    # of 12 tokens, which no chunk of a 128-token probe is a multiple of; layer 0 decays
    # by 0.25..0.004 per token, layer 2 by ~1e-5), attention between, MoE; RecurrentGemma,
    # two Griffin blocks (a 4-tap convolution, the RG-LRU) then local attention.
    "minimax": {**_DECODER, "num_hidden_layers": 3, "head_dim": 8, "num_local_experts": 4,
                "num_experts_per_tok": 2, "block_size": 12,
                "layer_types": ["linear_attention", "full_attention", "linear_attention"]},
    "recurrent_gemma": {**_DECODER, "num_hidden_layers": 3, "attention_window_size": 8},
    # ZAYA: q/k through two causal convolutions and half of each value from the previous
    # token inside the attention's projection (a halo of 2 tokens), MoE.
    "zaya": {**_DECODER, "head_dim": 8, "num_experts": 4, "moe_intermediate_size": 16,
             "router_hidden_size": 16, "layer_types": ["hybrid", "hybrid"]},
}


def build_debug_model(family: str, seed: int = 0, **overrides: object) -> nn.Module:
    """The debug-sized ``family`` model (config fields overridable), with weights drawn
    from ``seed``."""
    torch.manual_seed(seed)
    return build_causal_lm(family, {**DEBUG_CONFIGS[family], **overrides})


def load_on_one_rank(ckpt: str, overrides: dict[str, object]) -> dict[str, object]:
    """Build a fresh debug Llama (different weights), load ``ckpt`` into it on a world of
    one and return its parameters with placements: how tests show that a checkpoint
    saved on a sharded grid restores whole."""
    import paraxis
    from paraxis.testing.parity import local_shards

    engine = paraxis.parallelize(build_debug_model("llama", **overrides),
                                 train={"seq_length": 16})
    engine.load(ckpt)
    shards = local_shards(engine.model)
    engine.close()
    return shards
