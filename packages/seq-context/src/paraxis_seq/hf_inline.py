"""Attention that older transformers families write inline, routed through paraxis'
context-parallel attention function by a per-family adapter (issue 35, item 3).

These families compute ``softmax(q kᵀ · scale + mask) v`` inside their attention
module instead of asking transformers' attention interface, so no registered function
reaches them (transformers' own test, ``_can_set_attn_implementation``, says False).
Where the module's arithmetic is standard (a scale, causality, a sliding window, ALiBi)
an adapter replaces the one method that computes it, on the module instance: it keeps
the module's own projections, head split, rotary embeddings, output projection and
dropout, and calls the registered function (``attend``, the one
:func:`paraxis_seq.hf_attention.attention_function` returns) with q, k and v, which
applies causality and windows from true global positions; the mask the model built for
its shard is not used. :data:`INLINE` names every family by its modeling file: the
classes adapted, or why it stays refused.

What an adapter refuses at call time: cross-attention states (another sequence),
a cache, attention weights asked for (``output_attentions``). Padding and packed
documents reach no inline module (their models do not pass extra keywords on), so the
attention function refuses a batch carrying them, with the reason.
"""

from __future__ import annotations

import functools
import math
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["INLINE", "InlineFamily", "inline_reason", "install_inline"]

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


def _openai_attn(module: nn.Module, attend: Attend, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor, attention_mask: Any = None,
                 output_attentions: bool = False) -> list[torch.Tensor]:
    # openai-gpt: Attention._attn; k arrives as (b, h, d, s); scale 1/sqrt(d) if scale.
    _refuse(module, "output_attentions", output_attentions)
    scale = 1.0 / math.sqrt(v.size(-1)) if module.scale else 1.0
    out, _ = attend(module, q, k.transpose(-1, -2), v, None, scaling=scale, is_causal=True)
    return [_as_module_output(out)]


def _gpt_neo_attn(module: nn.Module, attend: Attend, query: torch.Tensor, key: torch.Tensor,
                  value: torch.Tensor, attention_mask: Any = None) -> tuple:
    # GPT-Neo: no 1/sqrt(d) scaling; "local" layers see the window_size latest keys.
    window = module.config.window_size if module.attention_type == "local" else None
    out, _ = attend(module, query, key, value, None, scaling=1.0, is_causal=True,
                    sliding_window=window)
    return _as_module_output(out), None


def _neox_japanese_attn(module: nn.Module, attend: Attend, query: torch.Tensor,
                        key: torch.Tensor, value: torch.Tensor,
                        attention_mask: Any = None) -> tuple:
    out, _ = attend(module, query, key, value, None, scaling=1.0 / module.norm_factor,
                    is_causal=True)
    return _as_module_output(out), None


def _bert_self_attention(module: nn.Module, attend: Attend, hidden_states: torch.Tensor,
                         attention_mask: Any = None, encoder_hidden_states: Any = None,
                         cache: Any = None, output_attentions: bool = False,
                         encoder_attention_mask: Any = None, **kwargs: Any) -> tuple:
    # BERT-style SelfAttention of MegatronBERT, RemBERT and BigBird's full attention
    # (every caller passes all but the states by keyword; causal when a decoder).
    for what, value in (("encoder_hidden_states (cross-attention)", encoder_hidden_states),
                        ("output_attentions", output_attentions)):
        _refuse(module, what, value)
    _refuse_cache(module, cache)
    shape = (*hidden_states.shape[:-1], -1, module.attention_head_size)
    q, k, v = (proj(hidden_states).view(shape).transpose(1, 2)
               for proj in (module.query, module.key, module.value))
    out, _ = attend(module, q, k, v, None, scaling=1.0 / math.sqrt(module.attention_head_size),
                    is_causal=bool(module.is_decoder))
    return out.reshape(*hidden_states.shape[:-1], module.all_head_size), None


def _xglm_forward(module: nn.Module, attend: Attend, hidden_states: torch.Tensor,
                  key_value_states: Any = None, cache: Any = None,
                  attention_mask: Any = None, **kwargs: Any) -> tuple:
    _refuse(module, "key_value_states (cross-attention)", key_value_states)
    _refuse_cache(module, cache)
    b, s, _ = hidden_states.shape
    q = module.q_proj(hidden_states) * module.scaling  # scaled first, as XGLM does
    q, k, v = (t.view(b, s, -1, module.head_dim).transpose(1, 2) for t in
               (q, module.k_proj(hidden_states), module.v_proj(hidden_states)))
    out, _ = attend(module, q, k, v, None, scaling=1.0, is_causal=True)
    return module.out_proj(out.reshape(b, s, module.embed_dim)), None


def _bloom_forward(module: nn.Module, attend: Attend, hidden_states: torch.Tensor,
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


def _mpt_forward(module: nn.Module, attend: Attend, hidden_states: torch.Tensor,
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


def _falcon_forward(module: nn.Module, attend: Attend, hidden_states: torch.Tensor,
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


@dataclass(frozen=True)
class InlineFamily:
    """One modeling file's inline attention: the classes adapted (class -> (method it
    replaces, adapter)), or why it stays refused; ``refuse(model)`` for a variant of an
    adapted family that is not standard."""

    adapters: dict[str, tuple[str, Callable]] = field(default_factory=dict)
    refused: str | None = None
    refuse: Callable[[nn.Module], str | None] | None = None


def _falcon_alibi(model: nn.Module) -> str | None:
    if getattr(model.config, "alibi", False):
        return ("Falcon's ALiBi bias is slopes x absolute positions rounded to bfloat16, "
                "not a function of k - q, so no rank can reproduce it from its shard")
    return None


def _big_bird(model: nn.Module) -> str | None:
    if getattr(model.config, "attention_type", None) != "original_full":
        return ("BigBird's block-sparse attention (random blocks) has no context-parallel "
                "kernel, and the model switches to full attention by the length of the "
                "sequence it sees, which a rank's shard is not; set attention_type="
                "'original_full' to train it context parallel")
    return None


INLINE: dict[str, InlineFamily] = {
    "modeling_openai": InlineFamily({"Attention": ("_attn", _openai_attn)}),
    "modeling_gpt_neo": InlineFamily({"GPTNeoSelfAttention": ("_attn", _gpt_neo_attn)}),
    "modeling_gpt_neox_japanese": InlineFamily(
        {"GPTNeoXJapaneseAttention": ("_attn", _neox_japanese_attn)}),
    "modeling_megatron_bert": InlineFamily(
        {"MegatronBertSelfAttention": ("forward", _bert_self_attention)}),
    "modeling_rembert": InlineFamily({"RemBertSelfAttention": ("forward", _bert_self_attention)}),
    "modeling_xglm": InlineFamily({"XGLMAttention": ("forward", _xglm_forward)}),
    "modeling_xlm": InlineFamily(refused=(
        "XLM masks every position past the row's count of non-pad tokens (its lengths, "
        "counted over input_ids), a count over the whole row that a rank's shard does "
        "not have")),
    "modeling_bloom": InlineFamily({"BloomAttention": ("forward", _bloom_forward)}),
    "modeling_mpt": InlineFamily({"MptAttention": ("forward", _mpt_forward)}),
    "modeling_falcon": InlineFamily({"FalconAttention": ("forward", _falcon_forward)},
                                    refuse=_falcon_alibi),
    "modeling_big_bird": InlineFamily(
        {"BigBirdSelfAttention": ("forward", _bert_self_attention)}, refuse=_big_bird),
    "modeling_cpmant": InlineFamily(refused=(
        "CPM-Ant adds a learned relative-position bias over (query, key) buckets, a "
        "(s, s) tensor the kernels do not take")),
    "modeling_reformer": InlineFamily(refused=(
        "Reformer's LSH and chunked local attention hash or chunk the whole sequence")),
    "modeling_rwkv": InlineFamily(refused=(
        "RWKV's time mixing is a recurrence, not softmax attention (state passing, issue "
        "35 item 2, does not cover it)")),
    "modeling_xlnet": InlineFamily(refused=(
        "XLNet's two-stream relative attention uses permutation masks and relative "
        "positions over the whole sequence")),
    "modeling_roformer": InlineFamily(refused=(
        "RoFormer builds its rotary positions from the length of the input it sees (a "
        "rank's shard), not from position_ids")),
    "modeling_trocr": InlineFamily(refused=(
        "TrOCR's learned positions count from the input it sees (a rank's shard), not "
        "from position_ids")),
}


def _family(model: nn.Module) -> tuple[str, InlineFamily | None]:
    key = type(model).__module__.rsplit(".", 1)[-1]
    return key, INLINE.get(key)


def _adapted(key: str, family: InlineFamily, module: nn.Module) -> bool:
    """An instance of a class the adapter was written for (defined in that modeling
    file: a subclass, such as a flash-attention variant, is not)."""
    cls = type(module)
    return cls.__name__ in family.adapters and cls.__module__.rsplit(".", 1)[-1] == key


def inline_reason(model: nn.Module) -> str | None:
    """None when every inline attention of ``model`` has an adapter; else why not."""
    key, family = _family(model)
    base = (f"{type(model).__name__} computes attention inline instead of calling "
            "transformers' attention interface (ALL_ATTENTION_FUNCTIONS), so no registered "
            "function can reach it")
    if family is None:
        return base + ", and paraxis has no adapter for it (paraxis_seq.hf_inline.INLINE)"
    why = (family.refuse(model) if family.refuse else None) or family.refused
    if why is not None:
        return f"{base}: {why}"
    modules = list(model.modules())
    others = sorted({type(m).__name__ for m in modules if not _adapted(key, family, m)
                     and any(c.__name__ in family.adapters for c in type(m).__mro__)})
    if others or not any(_adapted(key, family, m) for m in modules):
        return (f"{base}: its modules {others or '(none adapted)'} are not the classes "
                f"the adapter was written for ({sorted(family.adapters)}); build it with "
                "attn_implementation='eager'")
    return None


def install_inline(model: nn.Module, attend: Attend) -> int:
    """Route every adapted module of ``model`` through ``attend``; returns how many."""
    key, family = _family(model)
    count = 0
    for module in model.modules():
        if family is not None and _adapted(key, family, module):
            method, adapter = family.adapters[type(module).__name__]
            setattr(module, method,
                    types.MethodType(functools.partial(_call, adapter, attend), module))
            count += 1
    return count


def _call(adapter: Callable, attend: Attend, module: nn.Module, *args: Any,
          **kwargs: Any) -> Any:
    return adapter(module, attend, *args, **kwargs)
