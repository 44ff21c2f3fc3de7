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
classes adapted, or why it stays refused; the adapters are in
:mod:`paraxis_seq.hf_inline_adapters`.

Some families number or judge their tokens by the input they see, a rank's shard: their
position modules get this rank's global positions (RoFormer's sinusoidal table, TrOCR's
learned one), XLM its rows' whole non-pad counts, and BigBird makes its switch from
block-sparse to full attention by the whole sequence's length (below).

What an adapter refuses at call time: cross-attention states (another sequence),
a cache, attention weights asked for (``output_attentions``). Padding and packed
documents reach no inline module (their models do not pass extra keywords on), so the
attention function refuses a batch carrying them, with the reason.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from paraxis_seq.hf_inline_adapters import (
    Attend,
    bert_self_attention,
    bloom_forward,
    falcon_forward,
    gpt_neo_attn,
    mpt_forward,
    neox_japanese_attn,
    openai_attn,
    roformer_positions,
    trocr_positions,
    xglm_forward,
    xlm_attention,
    xlm_model,
)

__all__ = ["INLINE", "InlineFamily", "inline_reason", "install_inline"]


def _big_bird_model(module: nn.Module, attend: Attend, *args: Any, **kwargs: Any) -> Any:
    # BigBirdModel switches block-sparse attention to full attention for a sequence no
    # longer than (5 + 2 x random blocks) x block_size, judged by the length it sees: a
    # rank's shard is shorter than the sequence one process would judge, so the switch
    # is made here from the whole sequence's length, then the model runs as it would.
    ids = args[0] if args else kwargs.get("input_ids")
    here = (ids if ids is not None else kwargs["inputs_embeds"]).shape[1]
    if module.attention_type == "block_sparse":
        whole = here * attend.group.size  # type: ignore[attr-defined]
        limit = (5 + 2 * module.config.num_random_blocks) * module.config.block_size
        if whole > limit:
            raise ValueError(
                f"context-parallel BigBird got a sequence of {whole} tokens, longer than "
                f"{limit}, at which BigBird runs block-sparse attention (random blocks), "
                "which has no context-parallel kernel; set attention_type='original_full' "
                f"or train sequences of at most {limit} tokens")
        module.set_attention_type("original_full")  # the model's own switch
        install_inline(module, attend)  # the full attention modules it just built
    return type(module).forward(module, *args, **kwargs)


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


def _trocr_sinusoidal(model: nn.Module) -> str | None:
    if not getattr(model.config, "use_learned_position_embeddings", True):
        return ("TrOCR's sinusoidal positions count the non-pad tokens of the input it "
                "sees (a rank's shard), not position_ids; use learned positions")
    return None


INLINE: dict[str, InlineFamily] = {
    "modeling_openai": InlineFamily({"Attention": ("_attn", openai_attn)}),
    "modeling_gpt_neo": InlineFamily({"GPTNeoSelfAttention": ("_attn", gpt_neo_attn)}),
    "modeling_gpt_neox_japanese": InlineFamily(
        {"GPTNeoXJapaneseAttention": ("_attn", neox_japanese_attn)}),
    "modeling_megatron_bert": InlineFamily(
        {"MegatronBertSelfAttention": ("forward", bert_self_attention)}),
    "modeling_rembert": InlineFamily({"RemBertSelfAttention": ("forward", bert_self_attention)}),
    "modeling_xglm": InlineFamily({"XGLMAttention": ("forward", xglm_forward)}),
    "modeling_xlm": InlineFamily({"XLMModel": ("forward", xlm_model),
                                  "MultiHeadAttention": ("forward", xlm_attention)}),
    "modeling_bloom": InlineFamily({"BloomAttention": ("forward", bloom_forward)}),
    "modeling_mpt": InlineFamily({"MptAttention": ("forward", mpt_forward)}),
    "modeling_falcon": InlineFamily({"FalconAttention": ("forward", falcon_forward)},
                                    refuse=_falcon_alibi),
    "modeling_big_bird": InlineFamily({
        "BigBirdSelfAttention": ("forward", bert_self_attention),
        "BigBirdModel": ("forward", _big_bird_model)}),
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
    "modeling_roformer": InlineFamily({
        "RoFormerSelfAttention": ("forward", bert_self_attention),
        "RoFormerSinusoidalPositionalEmbedding": ("forward", roformer_positions)}),
    "modeling_trocr": InlineFamily({
        "TrOCRAttention": ("forward", xglm_forward),
        "TrOCRLearnedPositionalEmbedding": ("forward", trocr_positions)},
        refuse=_trocr_sinusoidal),
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
