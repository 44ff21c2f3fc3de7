"""The per-family adapters of :data:`paraxis_seq.hf_inline.INLINE`: each replaces the
one method of an inline attention family that computes ``softmax(q kᵀ · scale + mask) v``
(or, for a few, what the module numbers from the shard it sees) and calls the
context-parallel attention function ``attend`` with q, k and v.

Three kinds of adapter. The attention ones keep the module's projections, head split,
rotary embeddings and output projection, and let ``attend`` apply causality, windows
and ALiBi from true global positions. The position ones (RoFormer's sinusoidal table,
TrOCR's learned one) give the model's own embedding module this rank's global positions
(``attend.shard_positions``), where the model would number its shard from 0. XLM's keeps
the row's non-pad count of the whole row (summed over ``attend.group``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from paraxis.parallel.batch import DOC_IDS_KWARG
from paraxis.runtime.collectives import summed

__all__ = ["Attend", "bert_self_attention", "bloom_forward", "falcon_forward",
           "gpt_neo_attn", "mpt_forward", "neox_japanese_attn", "openai_attn",
           "roformer_positions", "trocr_positions", "xglm_forward", "xlm_attention",
           "xlm_model"]

Attend = Callable[..., tuple[torch.Tensor, None]]


def _refuse(module: nn.Module, what: str, value: Any) -> None:
    if value is not None and value is not False:
        raise ValueError(f"context-parallel {type(module).__name__} got {what}: a rank holds "
                         "a shard of the sequence, so this cannot be computed; do not pass it")


def _refuse_cache(module: nn.Module, cache: Any) -> None:
    # An empty cache (XLM makes one whatever use_cache says) holds nothing to attend to;
    # the module's own update of it is skipped here.
    if cache is not None and cache.get_seq_length() > 0:
        _refuse(module, "a filled cache", cache)


def _as_module_output(out: torch.Tensor) -> torch.Tensor:
    return out.transpose(1, 2)  # the function's (b, s, h, d) -> the module's (b, h, s, d)


def openai_attn(module: nn.Module, attend: Attend, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, attention_mask: Any = None,
                output_attentions: bool = False) -> list[torch.Tensor]:
    # openai-gpt: Attention._attn; k arrives as (b, h, d, s); scale 1/sqrt(d) if scale.
    _refuse(module, "output_attentions", output_attentions)
    scale = 1.0 / math.sqrt(v.size(-1)) if module.scale else 1.0
    out, _ = attend(module, q, k.transpose(-1, -2), v, None, scaling=scale, is_causal=True)
    return [_as_module_output(out)]


def gpt_neo_attn(module: nn.Module, attend: Attend, query: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor, attention_mask: Any = None) -> tuple:
    # GPT-Neo: no 1/sqrt(d) scaling; "local" layers see the window_size latest keys.
    window = module.config.window_size if module.attention_type == "local" else None
    out, _ = attend(module, query, key, value, None, scaling=1.0, is_causal=True,
                    sliding_window=window)
    return _as_module_output(out), None


def neox_japanese_attn(module: nn.Module, attend: Attend, query: torch.Tensor,
                       key: torch.Tensor, value: torch.Tensor,
                       attention_mask: Any = None) -> tuple:
    out, _ = attend(module, query, key, value, None, scaling=1.0 / module.norm_factor,
                    is_causal=True)
    return _as_module_output(out), None


def bert_self_attention(module: nn.Module, attend: Attend, hidden_states: torch.Tensor,
                        attention_mask: Any = None, encoder_hidden_states: Any = None,
                        cache: Any = None, output_attentions: bool = False,
                        encoder_attention_mask: Any = None, sinusoidal_pos: Any = None,
                        **kwargs: Any) -> tuple:
    # BERT-style SelfAttention of MegatronBERT, RemBERT, RoFormer and BigBird's full
    # attention (every caller passes all but the states by keyword; causal when a
    # decoder).
    for what, value in (("encoder_hidden_states (cross-attention)", encoder_hidden_states),
                        ("output_attentions", output_attentions)):
        _refuse(module, what, value)
    _refuse_cache(module, cache)
    shape = (*hidden_states.shape[:-1], -1, module.attention_head_size)
    q, k, v = (proj(hidden_states).view(shape).transpose(1, 2)
               for proj in (module.query, module.key, module.value))
    if sinusoidal_pos is not None:  # RoFormer's rotary, by its own function
        rotated = module.apply_rotary_position_embeddings(
            sinusoidal_pos, q, k, v if module.rotary_value else None)
        q, k, v = rotated if module.rotary_value else (*rotated, v)
    out, _ = attend(module, q, k, v, None, scaling=1.0 / math.sqrt(module.attention_head_size),
                    is_causal=bool(module.is_decoder))
    return out.reshape(*hidden_states.shape[:-1], module.all_head_size), None


def _shard_positions(module: nn.Module, attend: Attend, here: int, cache_length: int,
                     device: torch.device) -> torch.Tensor:
    if cache_length:
        _refuse(module, "a filled cache", cache_length)
    return attend.shard_positions(here).to(device)  # type: ignore[attr-defined]


def roformer_positions(module: nn.Module, attend: Attend, input_ids_shape: torch.Size,
                       cache_length: int = 0, position_ids: Any = None) -> torch.Tensor:
    # RoFormer's sinusoidal table read at this rank's global positions (the model asks
    # for 0..s-1 of the shard it sees; it passes no position_ids).
    pos = _shard_positions(module, attend, input_ids_shape[1], cache_length,
                           module.weight.device)
    return type(module).forward(module, input_ids_shape, 0, position_ids=pos)


def trocr_positions(module: nn.Module, attend: Attend, input_ids: torch.Tensor,
                    cache_length: int = 0, position_ids: Any = None) -> torch.Tensor:
    # TrOCR's learned table at this rank's global positions (its offset of 2 kept).
    pos = _shard_positions(module, attend, input_ids.shape[1], cache_length,
                           module.weight.device)
    return type(module).forward(module, input_ids, 0, position_ids=pos)


def xglm_forward(module: nn.Module, attend: Attend, hidden_states: torch.Tensor,
                 key_value_states: Any = None, cache: Any = None,
                 attention_mask: Any = None, **kwargs: Any) -> tuple:
    # XGLM's and TrOCR's attention (TrOCR's decoder layer asks for output_attentions).
    _refuse(module, "key_value_states (cross-attention)", key_value_states)
    _refuse(module, "output_attentions", kwargs.get("output_attentions"))
    _refuse_cache(module, cache)
    b, s, _ = hidden_states.shape
    q = module.q_proj(hidden_states) * module.scaling  # scaled first, as XGLM does
    q, k, v = (t.view(b, s, -1, module.head_dim).transpose(1, 2) for t in
               (q, module.k_proj(hidden_states), module.v_proj(hidden_states)))
    out, _ = attend(module, q, k, v, None, scaling=1.0, is_causal=True)
    return module.out_proj(out.reshape(b, s, module.embed_dim)), None


def bloom_forward(module: nn.Module, attend: Attend, hidden_states: torch.Tensor,
                  residual: torch.Tensor, alibi: Any, attention_mask: Any,
                  layer_past: Any = None, use_cache: bool = False,
                  output_attentions: bool = False, **kwargs: Any) -> tuple:
    # BLOOM: ALiBi from the true positions (the slopes BLOOM builds its bias from), the
    # dense projection as BLOOM runs it, dropout_add onto the residual.
    from transformers.models.bloom import modeling_bloom as bloom

    _refuse_cache(module, layer_past)
    _refuse(module, "output_attentions", output_attentions)
    b, s, _ = hidden_states.shape
    q, k, v = module._reshape(module.query_key_value(hidden_states))
    slopes = bloom._get_alibi_slopes(module.num_heads, hidden_states.device)
    out, _ = attend(module, q, k, v, None, scaling=module.inv_norm_factor, is_causal=True,
                    alibi=slopes)
    context = out.reshape(b, s, module.num_heads * module.head_dim)
    if module.pretraining_tp > 1 and module.slow_but_exact:
        part = module.hidden_size / module.pretraining_tp
        output = sum(torch.nn.functional.linear(
            context[:, :, int(i * part):int((i + 1) * part)],
            module.dense.weight[:, int(i * part):int((i + 1) * part)])
            for i in range(module.pretraining_tp)) + module.dense.bias
    else:
        output = module.dense(context)
    return bloom.dropout_add(output, residual, module.hidden_dropout, module.training), None


def mpt_forward(module: nn.Module, attend: Attend, hidden_states: torch.Tensor,
                position_bias: torch.Tensor | None, cache: Any = None,
                attention_mask: Any = None, **kwargs: Any) -> tuple:
    # MPT: clip_qkv, softmax_scale, ALiBi; the slopes are read back from the bias MPT
    # built for the shard (slope_h x (k - (L - 1)): the step between its last two keys).
    _refuse_cache(module, cache)
    b, s, _ = hidden_states.shape
    mixed = module.Wqkv(hidden_states)
    if module.clip_qkv:
        mixed = mixed.clamp(min=-module.clip_qkv, max=module.clip_qkv)
    q, k, v = (t.reshape(b, s, module.n_heads, module.head_dim).transpose(1, 2)
               for t in mixed.chunk(3, dim=2))
    slopes = None if position_bias is None else \
        (position_bias[:, 0, -1] - position_bias[:, 0, -2]).float()
    out, _ = attend(module, q, k, v, None, scaling=module.softmax_scale, is_causal=True,
                    alibi=slopes)
    return module.out_proj(out.reshape(b, s, -1)), None


def falcon_forward(module: nn.Module, attend: Attend, hidden_states: torch.Tensor,
                   alibi: Any, attention_mask: Any, position_ids: Any = None,
                   layer_past: Any = None, use_cache: bool = False,
                   output_attentions: bool = False, position_embeddings: Any = None,
                   **kwargs: Any) -> tuple:
    # Falcon with rotary embeddings (its ALiBi variant is refused, see INLINE).
    from transformers.models.falcon.modeling_falcon import apply_rotary_pos_emb

    _refuse(module, "ALiBi", alibi)
    _refuse_cache(module, layer_past)
    _refuse(module, "output_attentions", output_attentions)
    q, k, v = module._split_heads(module.query_key_value(hidden_states))
    b, s, _, _ = q.shape
    kv = module.num_heads if module.new_decoder_architecture else module.num_kv_heads
    q = q.transpose(1, 2).reshape(b, module.num_heads, s, module.head_dim)
    k, v = (t.transpose(1, 2).reshape(b, kv, s, module.head_dim) for t in (k, v))
    q, k = apply_rotary_pos_emb(q, k, *position_embeddings)
    out, _ = attend(module, q, k, v, None, scaling=module.inv_norm_factor, is_causal=True)
    return module.dense(out.reshape(b, s, module.num_heads * module.head_dim)), None


def xlm_model(module: nn.Module, attend: Attend, *args: Any, **kwargs: Any) -> Any:
    # XLMModel keeps the first ``lengths`` tokens of each row (non-pad tokens counted
    # over input_ids unless given) and zeroes the rest. The whole row's count is the sum
    # of the ranks' counts; a rank's tokens are in increasing global position, so those
    # below the count are a prefix of its shard, as long as this rank's ``lengths``.
    names = ("input_ids", "attention_mask", "langs", "token_type_ids", "position_ids",
             "lengths")
    kwargs.update(zip(names[:len(args)], args, strict=True))
    ids = kwargs.get("input_ids")
    _refuse(module, "attention_mask (padding over the whole row)",
            kwargs.get("attention_mask"))
    if ids is None:
        _refuse(module, "inputs_embeds without input_ids (no tokens to count)", True)
    pos = attend.shard_positions(ids.shape[1]).to(ids.device)  # type: ignore[attr-defined]
    whole = kwargs.get("lengths")
    if whole is None:
        whole = summed((ids != module.pad_index).sum(dim=1).long(), attend.group)  # type: ignore[attr-defined]
    kwargs["lengths"] = (pos[None, :] < whole[:, None]).sum(dim=1)
    if kwargs.get("position_ids") is None:  # XLM would number the shard 0..s/C-1
        kwargs["position_ids"] = pos.expand_as(ids)
    return type(module).forward(module, **kwargs)


def xlm_attention(module: nn.Module, attend: Attend, input: torch.Tensor,
                  mask: torch.Tensor, kv: Any = None, cache: Any = None,
                  output_attentions: bool = False, **kwargs: Any) -> tuple:
    # XLM's MultiHeadAttention: a (b, s, s) mask is its causal triangle; a (b, s) mask
    # keeps the row's first tokens as keys, which the kernels take as document ids
    # (kept 0, dropped -1: a dropped token's own output is zeroed by XLM after the
    # layer). Every rank passes them, so every ring step carries the same tensors.
    _refuse(module, "kv (cross-attention)", kv)
    _refuse(module, "output_attentions", output_attentions)
    _refuse_cache(module, cache)
    b, s, _ = input.shape
    q, k, v = (lin(input).view(b, s, module.n_heads, module.head_dim).transpose(1, 2)
               for lin in (module.q_lin, module.k_lin, module.v_lin))
    causal = mask.dim() == 3
    docs = {} if causal else {DOC_IDS_KWARG: torch.where(mask.bool(), 0, -1)}
    out, _ = attend(module, q, k, v, None, scaling=1.0 / math.sqrt(module.head_dim),
                    is_causal=causal, **docs)
    return (module.out_lin(out.reshape(b, s, module.n_heads * module.head_dim)),)
