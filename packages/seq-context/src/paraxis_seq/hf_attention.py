"""Context parallelism for Hugging Face models through transformers' attention interface.

Since transformers 4.48 (and throughout 5.x) a model's attention module does not call a
kernel itself: it asks ``ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation,
eager_attention_forward)`` and calls what it gets as
``fn(module, query, key, value, attention_mask, dropout=, scaling=, sliding_window=, ...)``
with ``(b, heads, s, d)`` tensors after rotary embeddings, expecting
``((b, s, heads, d) output, weights or None)``. Registering a function under a new name
(``transformers.AttentionInterface.register``) and selecting it with
``model.set_attn_implementation(name)`` (the same as ``config._attn_implementation``, or
``attn_implementation=`` at construction) therefore reaches every layer of every family
that uses the interface, without per-model code. transformers builds no mask for a name
its mask registry (``ALL_MASK_ATTENTION_FUNCTIONS``) does not know, so the function gets
``attention_mask=None`` and takes causality from ``module.is_causal`` (or an
``is_causal=`` keyword) and the window from ``sliding_window=``; both are applied from
true global positions by the kernels here. Rotary embeddings are right as long as the
model is called with each rank's true ``position_ids`` (the batch transform passes them).
Padding and packed documents reach the kernels as per-token document ids (the
``paraxis_doc_ids`` keyword, which transformers passes on to the attention function
like any extra keyword): a query attends a key only in its own document, never a pad.

What cannot be intercepted (:func:`interceptable` says which and why): families whose
attention modules compute attention inline (transformers' own test,
``_can_set_attn_implementation``: bloom, falcon, mpt, gpt_neo, openai-gpt, xglm, rwkv,
...); layers that mix the sequence without attention (Mamba, linear attention, short
convolutions, recurrences: jamba, bamba, zamba, nemotron_h, qwen3_next, falcon_mamba,
xlstm, ...), which would see only a rank's shard; cross-attention (encoder-decoders,
blt, mllama); and attention variants the kernel does not have: logit soft-capping
(gemma2), attention sinks (gpt_oss), chunked attention (llama4), attention dropout
(gpt2, bert: set the dropout to 0 to train context parallel); multimodal models, whose
vision or audio towers would get the same attention on unsharded inputs. The structural checks read
config fields and module class names: they are a conservative heuristic, not a proof.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from paraxis.parallel.anatomy import Anatomy, find_anatomy
from paraxis.parallel.batch import DOC_IDS_KWARG
from paraxis_seq.recurrent import LAYER_KINDS, recurrent_mixers, unpassable
from paraxis_seq.ring import DROPOUT_REFUSED, ring_attention
from paraxis_seq.ulysses import ulysses_attention

__all__ = ["MODES", "attention_function", "interceptable", "use_context_attention"]

MODES: tuple[str, ...] = ("ring", "ulysses")

# Keywords an attention call may carry that change the math in ways the kernels here do
# not implement, with the reason (the name transformers uses -> why).
_UNSUPPORTED_KWARGS: dict[str, str] = {
    "softcap": "attention logit soft-capping (Gemma 2) is not implemented in the ring "
               "kernel's per-block softmax",
    "s_aux": "attention sinks (gpt-oss) add a per-head logit to every row's normalizer; "
             "not implemented",
    "sinks": "attention sinks add a per-head logit to every row's normalizer; not "
             "implemented",
    "position_bias": "an additive position bias (T5, MPNet) is a (s, s) tensor over the "
                     "whole sequence; not implemented",
    "cu_seq_lens_q": "flash-attention's varlen lengths describe the whole sequence, not "
                     "a rank's shard: pass packed documents as position_ids (paraxis "
                     "turns them into document ids)",
}
# Layer kinds of config.layer_types that are plain attention.
_ATTENTION_LAYERS = frozenset({"full_attention", "sliding_attention"})
_DROPOUT_FIELDS = ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob")


def attention_function(group: Any, *, mode: str = "ring", layout: str = "zigzag",
                       kernel: Callable[..., torch.Tensor] | None = None,
                       documents: Any = None) -> Callable:
    """The function to register in ``transformers.AttentionInterface``: attention of
    this rank's sequence shard over the whole sequence, by ring or Ulysses over
    ``group`` (the grid's ``context`` group; ``kernel`` is Ulysses' per-rank attention).
    ``documents`` (``paraxis_seq.strategy.DocumentState``) says when the step's batch
    carries document ids, so their absence is an error, not a silent causal mask.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, not {mode!r}")

    def context_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                          value: torch.Tensor, attention_mask: torch.Tensor | None,
                          scaling: float | None = None, dropout: float = 0.0,
                          sliding_window: int | None = None, is_causal: bool | None = None,
                          **kwargs: Any) -> tuple[torch.Tensor, None]:
        docs = kwargs.pop(DOC_IDS_KWARG, None)
        _refuse_call(attention_mask, kwargs)
        if docs is None and documents is not None and documents.expected:
            raise ValueError(
                f"{type(module).__name__} did not pass the batch's document ids "
                f"({DOC_IDS_KWARG}) on to its attention: this family drops extra keywords, "
                "so context parallelism cannot mask its padding or packed documents; "
                "train it without padding and packing, or without the context axis")
        causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))
        common = dict(group=group, causal=bool(causal), scale=scaling,
                      window=sliding_window, layout=layout, dropout=dropout, documents=docs)
        if mode == "ring":
            out = ring_attention(q, k, v, **common)
        else:
            out = ulysses_attention(q, k, v, attention=kernel, **common)
        return out, None

    context_attention.__qualname__ = f"context_attention[{mode}, {layout}]"
    return context_attention


def _refuse_call(attention_mask: torch.Tensor | None, kwargs: dict[str, Any]) -> None:
    if attention_mask is not None:
        raise ValueError(
            "context-parallel attention got an attention mask: a mask spans the whole "
            "sequence, but each rank holds a shard. transformers passes none to a custom "
            "implementation unless the model or caller built a 4-D mask itself; do not "
            "pass one (causality and sliding windows come from true positions)")
    for name, why in _UNSUPPORTED_KWARGS.items():
        if kwargs.get(name) is not None:
            raise ValueError(f"context-parallel attention got {name}=: {why}")


def interceptable(model: nn.Module, anatomy: Anatomy | None = None) -> str | None:
    """None if every attention of ``model`` goes through transformers' attention
    interface and nothing else mixes the sequence (its ``anatomy`` says which modules
    do; found here if not given); else the reason it cannot be made context parallel by
    :func:`use_context_attention`."""
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        return (f"{type(model).__name__} is not a transformers PreTrainedModel; call "
                "paraxis_seq.ring_attention or ulysses_attention from its attention")
    for m in model.modules():
        if isinstance(m, PreTrainedModel) and not type(m)._can_set_attn_implementation():
            return (f"{type(m).__name__} computes attention inline instead of calling "
                    "transformers' attention interface (ALL_ATTENTION_FUNCTIONS), so no "
                    "registered function can reach it")
    cfg = model.config
    others = sorted(k for k in getattr(cfg, "sub_configs", {}) if k != "text_config")
    if others:
        return (f"sub-models {others} would run the context-parallel attention on inputs "
                "that are not sequence-sharded (image patches, audio frames); parallelize "
                "the text model alone")
    if getattr(cfg, "is_encoder_decoder", False):
        return ("encoder-decoder model: cross-attention keys are the encoder's sequence, "
                "which the context axis does not shard alike")
    # Recurrent kinds (paraxis_seq.recurrent.LAYER_KINDS) are checked module by module.
    kinds = set(getattr(cfg, "layer_types", None) or ()) - _ATTENTION_LAYERS - LAYER_KINDS
    if kinds:
        return (f"layer types {sorted(kinds)} are not plain attention (state-space, linear "
                "attention, convolution or chunked attention): they would see only this "
                "rank's shard of the sequence")
    anatomy = anatomy or find_anatomy(model)
    reason = unpassable(model, anatomy)  # a recurrence whose state cannot be passed
    if reason is not None:
        return reason
    if not anatomy.has_attention and not recurrent_mixers(anatomy):
        return "no attention module found: the model mixes the sequence some other way"
    if getattr(cfg, "attn_logit_softcapping", None) is not None:
        return "context-parallel attention: " + _UNSUPPORTED_KWARGS["softcap"]
    if any(name.rsplit(".", 1)[-1] == "sinks" for name, _ in model.named_parameters()):
        return "context-parallel attention: " + _UNSUPPORTED_KWARGS["s_aux"]
    for field in _DROPOUT_FIELDS:
        if getattr(cfg, field, 0) or 0:
            return f"config.{field}={getattr(cfg, field)}: " + DROPOUT_REFUSED
    return None


def use_context_attention(model: nn.Module, group: Any, *, anatomy: Anatomy | None = None,
                          mode: str = "ring", layout: str = "zigzag",
                          documents: Any = None) -> str:
    """Register the context-parallel attention (name ``paraxis_<mode>``) and select it
    for ``model`` and its sub-models; returns the name. Raises ValueError with the
    reason when the model cannot be intercepted.

    transformers' registry is process-wide: registering again under the same name (a
    new grid, in tests) replaces the function for every model that selected it.
    """
    reason = interceptable(model, anatomy)
    if reason is not None:
        raise ValueError(f"cannot make {type(model).__name__} context parallel: {reason}")
    from transformers import AttentionInterface

    name = f"paraxis_{mode}"
    AttentionInterface.register(name, attention_function(group, mode=mode, layout=layout,
                                                         documents=documents))
    model.set_attn_implementation(name)
    if model.config._attn_implementation != name:  # set_attn_implementation only warns
        raise ValueError(f"{type(model).__name__} did not take attn_implementation={name!r} "
                         f"(it kept {model.config._attn_implementation!r})")
    return name
