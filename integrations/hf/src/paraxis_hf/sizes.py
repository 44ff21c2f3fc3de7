"""The tiny sizes every family is shrunk to, and the spellings families use for them
(data for :mod:`paraxis_hf.shrink`, which holds the rules).

Where core reads a size (:data:`paraxis.config.SIZE_SPELLINGS`, the one list of the
spellings of the sizes core reads), a role starts from core's spellings and adds the
rarer ones only the shrinker meets: a spelling core learns is shrunk too."""

from __future__ import annotations

from typing import Any

from paraxis.config.shape import SIZE_SPELLINGS

__all__ = [
    "EXPERTS", "FIXED", "FORCED", "HEADS", "HEAD_DIM", "HIDDEN", "KV_HEADS", "LAYERS",
    "LAYER_INDEX_KEYS", "LAYER_MARKS", "PER_LAYER_DICT_KEYS", "ROLES", "SEQ", "TIES",
    "TOP_K", "VOCAB", "WINDOW",
]

HIDDEN, LAYERS, HEADS, KV_HEADS = 64, 4, 4, 2
HEAD_DIM = HIDDEN // HEADS
EXPERTS, TOP_K = 4, 2
VOCAB = 256
SEQ = 16  # the test sequence length: sliding windows of 8 are exercised at it
WINDOW = SEQ // 2


def _spelled(size: str, *more: str) -> tuple[str, ...]:
    """Core's spellings of ``size``, then ``more``, each once."""
    return tuple(dict.fromkeys(SIZE_SPELLINGS[size] + more))


# role -> (tiny value, the spellings families use). A value is an int, or a function of
# the family's own value for roles that keep something of it.
ROLES: dict[str, tuple[Any, tuple[str, ...]]] = {
    "hidden": (HIDDEN, _spelled(
        "hidden_size", "emb_dim", "embedding_dim", "dim_model",
        "word_embed_proj_dim", "embedding_size", "input_embedding_size",
        "output_embedding_size", "backbone_hidden_size", "lru_width", "attention_hidden_size",
        "mamba_d_ssm", "hidden_size_global")),
    "intermediate": (2 * HIDDEN, _spelled(
        "intermediate_size", "ffn_dim", "d_inner", "dff", "dim_ff",
        "decoder_ffn_dim", "encoder_ffn_dim", "ffn_hidden_size", "feed_forward_size",
        "intermediate_size_mlp", "dense_intermediate_size")),
    "expert_intermediate": (HIDDEN // 2, (
        "moe_intermediate_size", "expert_ffn_hidden_size", "shared_expert_intermediate_size",
        "shared_experts_intermediate_size", "moe_shared_expert_intermediate_size",
        "shared_intermediate_size")),
    "layers": (LAYERS, _spelled(
        "num_layers", "n_layers", "decoder_layers",
        "encoder_layers", "num_decoder_layers", "num_encoder_layers", "num_blocks",
        "num_layers_per_stack")),
    "heads": (HEADS, _spelled(
        "num_attention_heads", "n_heads", "attention_heads",
        "decoder_attention_heads", "encoder_attention_heads", "num_decoder_attention_heads",
        "num_encoder_attention_heads", "swa_num_attention_heads", "linear_num_heads",
        "index_n_heads", "mamba_n_heads", "mamba_num_heads", "n_mamba_heads",
        "num_attention_heads_per_layer", "linear_num_value_heads", "heads_per_ngram")),
    "kv_heads": (KV_HEADS, _spelled(
        "num_key_value_heads", "num_kv_heads", "swa_num_key_value_heads", "num_query_groups",
        "linear_num_key_heads")),
    "head_dim": (HEAD_DIM, (
        "head_dim", "d_head", "dim_head", "attention_head_dim", "kv_channels",
        "attention_head_size", "swa_head_dim", "linear_head_dim", "linear_key_head_dim",
        "linear_value_head_dim", "index_head_dim", "v_head_dim", "qk_head_dim",
        "mamba_d_head", "mamba_head_dim", "mamba_headdim")),
    # Latent attention splits a query/key head into a rotary and a position-free part:
    # head_dim = qk_nope_head_dim + qk_rope_head_dim, as some families require.
    "half_head_dim": (HEAD_DIM // 2, ("qk_rope_head_dim", "qk_nope_head_dim", "rotary_dim")),
    "low_rank": (HIDDEN // 2, ("kv_lora_rank", "q_lora_rank", "o_lora_rank")),
    "small_rank": (8, (
        "laurel_rank", "gated_norm_rank", "loop_gate_rank", "adapter_rank", "time_step_rank",
        "mamba_dt_rank", "hc_lowrank", "d_rel")),
    "small_width": (HIDDEN // 4, (
        "hidden_size_per_layer_input", "ple_embed_dim", "router_hidden_size",
        "ssm_state_size", "state_size", "mamba_d_state", "pronunciation_embed_dim",
        "shape_embed_dim")),
    "experts": (EXPERTS, _spelled("num_experts", "moe_num_experts")),
    "top_k": (TOP_K, _spelled("experts_per_token", "moe_k")),
    "groups": (1, ("n_group", "topk_group", "num_expert_group", "n_groups", "mamba_n_groups",
                   "mamba_ngroups", "o_groups")),
    "shared_experts": (lambda v: min(v, 1), (
        "n_shared_experts", "num_shared_experts", "moe_num_shared_experts")),
    "at_most_one": (lambda v: min(v, 1), (
        "attn_layer_offset", "expert_layer_offset", "zero_expert_num",
        "n_layers_per_attn_res_block")),
    "expand": (1, ("expand", "mamba_expand")),
    "period": (lambda v: min(v, 2), (
        "global_attn_every_n_layers", "sliding_window_pattern", "_sliding_window_pattern",
        "no_rope_layer_interval", "attn_layer_period", "expert_layer_period",
        "layer_group_size", "interleave_moe_layer_step",
        "moe_layer_interval", "prefix_dense_sliding_window_pattern", "decoder_sparse_step")),
    "vocab": (VOCAB, _spelled(
        "vocab_size", "decoder_vocab_size", "vocab_size_per_layer_input",
        "unpadded_vocab_size", "ngram_vocab_size_base", "encoder_hash_byte_group_vocab",
        "pronunciation_vocab_size", "shape_vocab_size")),
    "positions": (8 * SEQ, _spelled(
        "seq_length", "n_ctx", "max_seq_len", "context_length",
        "max_target_positions", "max_source_positions", "position_bias_max_distance",
        "model_max_length")),
    "window": (WINDOW, (
        "sliding_window", "window_size", "local_attention", "attention_window_size",
        "sliding_window_size", "attention_chunk_size", "keep_window_size",
        "local_attention_window_len", "local_attn_chunk_length", "lsh_attn_chunk_length",
        "chunk_size", "mamba_chunk_size", "block_size", "index_topk", "index_block_size",
        "index_topk_blocks", "rel_extent", "split_ngram_parts")),
}
# Fields whose tiny value is a list (Reformer's axial positions: their dimensions sum to
# the hidden size, their shape multiplies to the sequence length).
FIXED: dict[str, Any] = {"axial_pos_embds_dim": [HIDDEN // 2, HIDDEN // 2],
                         "axial_pos_shape": [4, SEQ // 4]}
# Sizes a family may tie: where its defaults are equal, the tiny values are too
# (LongCat's head_dim is its rotary part, DeepSeek's is computed as such).
TIES = (("head_dim", "qk_rope_head_dim"),)
# Roles set even where the config would derive the field (rule 1).
FORCED = frozenset({"kv_heads", "head_dim"})
# Lists of layer indices (rule 2); other per-layer lists are recognized by their length.
LAYER_INDEX_KEYS = frozenset({"full_attn_idxs", "moe_layers", "hybrid_layer_ids",
                              "mlp_only_layers", "ple_layer_ids"})
PER_LAYER_DICT_KEYS = frozenset({"per_layer_config"})
# Scalars that mark layers (rule 2): the first ``v`` layers (dense before MoE, sliding
# windows up to a depth), the last ``v`` (layers reusing another's KV cache), or a layer
# index. Each is a per-layer feature when layers are chosen; its tiny value counts the
# chosen layers it marks.
LAYER_MARKS = {
    "first_k_dense_replace": "prefix", "num_dense_layers": "prefix",
    "max_window_layers": "prefix", "moe_layer_start_index": "prefix",
    "num_kv_shared_layers": "suffix",
    "loop_layer_index_start": "index", "loop_layer_index_end": "index",
    "moe_layer_end_index": "index",
}
