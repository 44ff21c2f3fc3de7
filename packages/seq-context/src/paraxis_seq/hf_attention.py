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
The variants a call carries reach the kernels too (:mod:`paraxis_seq.variant`):
``softcap=`` (Gemma 2, VaultGemma), ``s_aux=`` sinks (gpt-oss, MiMo-V2-Flash, Flint,
Granite-SWA), and a ``chunked_attention`` layer's chunk, which transformers applies
through its mask and the function reads from the module's config
(:func:`paraxis_seq.hf_adapters.chunk_of`, Llama 4); what a family computes around the
call from shard-local positions is corrected by its adapter
(:data:`paraxis_seq.hf_adapters.ADAPTERS`). DeepSeek's sparse attention (the
``indexed_attention`` layers) gets its indexer's selection made over the whole sequence
(:mod:`paraxis_seq.indexed`) and hands it on as ``indices=``, which both kernels mask with.

Families whose attention modules compute attention inline (transformers' own test,
``_can_set_attn_implementation``: bloom, falcon, mpt, gpt_neo, openai-gpt, xglm, ...)
are routed to the same function by a per-family adapter where their arithmetic is
standard (:mod:`paraxis_seq.hf_inline`, one table).

What cannot be intercepted (:func:`interceptable` says which and why): inline attention
without an adapter (cpmant's position bias, reformer's LSH, rwkv's recurrence, ...,
each named in the table); layers that mix the sequence without attention (Mamba,
linear attention, short convolutions, recurrences: jamba, bamba, zamba, nemotron_h,
qwen3_next, falcon_mamba, xlstm, ...), which would see only a rank's shard;
cross-attention (encoder-decoders, blt, mllama); what the kernels do not have: an
additive position bias (T5-style), attention dropout (gpt2, bert: set the dropout to 0
to train context parallel); multimodal models, whose vision or audio towers would get
the same attention on unsharded inputs. The structural checks read
config fields and module class names: they are a conservative heuristic, not a proof.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from paraxis.parallel.anatomy import Anatomy, find_anatomy
from paraxis.parallel.batch import DOC_IDS_KWARG
from paraxis_seq.hf_adapters import adapter_of, chunk_of
from paraxis_seq.hf_inline import inline_reason, install_inline
from paraxis_seq.indexed import NO_MASK, selection, use_gathered_indexers
from paraxis_seq.recurrent import LAYER_KINDS, recurrent_mixers, unpassable
from paraxis_seq.ring import DROPOUT_REFUSED, ring_attention
from paraxis_seq.ulysses import ulysses_attention
from paraxis_seq.zigzag import positions

__all__ = ["MODES", "attention_function", "interceptable", "use_context_attention"]

MODES: tuple[str, ...] = ("ring", "ulysses")

# Keywords an attention call may carry that change the math in ways the kernels here do
# not implement, with the reason (the name transformers uses -> why).
_UNSUPPORTED_KWARGS: dict[str, str] = {
    "sinks": "a sinks= keyword (Inkling 2) is not gpt-oss' s_aux, whose arithmetic the "
             "kernels implement; not checked to be the same",
    "position_bias": "an additive position bias (T5, MPNet) is a (s, s) tensor over the "
                     "whole sequence; not implemented",
    "cu_seq_lens_q": "flash-attention's varlen lengths describe the whole sequence, not "
                     "a rank's shard: pass packed documents as position_ids (paraxis "
                     "turns them into document ids)",
}
# Sparse attention whose keys are pooled inside the attention module, before any
# attention function is called (issue 35, item 4), with why neither mode serves it.
# (DeepSeek's indexed attention is served: paraxis_seq.indexed.)
_SPARSE_LAYERS: dict[str, str] = {
    "compressed_sparse_attention": (
        "DeepSeek-V4's compressors pool keys and values over blocks of the sequence "
        "inside the attention module, from the hidden states it is given (a rank's "
        "shard), before any attention function is called"),
}
_SPARSE_LAYERS["heavily_compressed_attention"] = _SPARSE_LAYERS["compressed_sparse_attention"]
# Layer kinds of config.layer_types that are softmax attention the kernels compute
# (chunked: Llama 4's, the chunk from the config, paraxis_seq.hf_adapters.chunk_of).
_ATTENTION_LAYERS = frozenset({"full_attention", "sliding_attention", "chunked_attention",
                               "indexed_attention"})
# The keywords of transformers' attention call that the kernels take: the name -> the
# kernel's keyword (soft-capping, Gemma 2; sinks, gpt-oss' s_aux: paraxis_seq.variant;
# ALiBi's slopes, from the inline adapters of BLOOM and MPT: paraxis_seq.hf_inline).
_VARIANT_KWARGS = {"softcap": "softcap", "s_aux": "sinks", "alibi": "alibi"}
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
        indices = kwargs.pop("indices", None)
        attention_mask = None if attention_mask is NO_MASK else attention_mask
        variant = {ours: kwargs.pop(theirs, None) for theirs, ours in _VARIANT_KWARGS.items()}
        _refuse_call(attention_mask, kwargs)
        if docs is None and documents is not None and documents.expected:
            raise ValueError(
                f"{type(module).__name__} did not pass the batch's document ids "
                f"({DOC_IDS_KWARG}) on to its attention: this family drops extra keywords, "
                "so context parallelism cannot mask its padding or packed documents; "
                "train it without padding and packing, or without the context axis")
        causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
        adapter = adapter_of(module)
        if adapter is not None and adapter.queries is not None:
            here = query.shape[2]
            query = adapter.queries(module, query, torch.arange(here), shard_positions(here))
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))
        common = dict(group=group, causal=bool(causal), scale=scaling,
                      window=sliding_window, layout=layout, dropout=dropout, documents=docs,
                      chunk=chunk_of(module), **variant)
        # DSA's selection: the ring's rows are this rank's queries, Ulysses' all of them.
        selected = None if indices is None else _selected(
            module, indices, q.shape[1] * group.size,
            shard_positions(q.shape[1]) if mode == "ring" else None)
        if mode == "ring":
            out = ring_attention(q, k, v, selected=selected, **common)
        else:
            out = ulysses_attention(q, k, v, attention=kernel, selected=selected, **common)
        return out, None

    def shard_positions(here: int) -> torch.Tensor:
        return positions(here * group.size, group.size, group.rank, layout)

    # For the inline adapters (paraxis_seq.hf_inline): families that number their tokens
    # from the length of the input they see read this rank's true positions, and
    # BigBird (the whole sequence's length) and XLM (its rows' non-pad counts) read
    # the group.
    context_attention.shard_positions = shard_positions  # type: ignore[attr-defined]
    context_attention.group = group  # type: ignore[attr-defined]
    context_attention.__qualname__ = f"context_attention[{mode}, {layout}]"
    return context_attention


def _selected(module: nn.Module, indices: torch.Tensor, whole: int,
              rows: torch.Tensor | None) -> torch.Tensor:
    """DSA's mask of selected keys (:func:`paraxis_seq.indexed.selection`) from the indices
    of every query of the ``whole`` sequence: for the queries at positions ``rows`` (this
    rank's, the ring's), or with ``rows=None`` for all of them in true order."""
    if indices.shape[1] != whole:
        raise ValueError(
            f"{type(module).__name__} passed indices= for {indices.shape[1]} queries, not "
            f"the sequence's {whole}: its indexer ranked only this rank's shard of the "
            "keys (a module paraxis_seq.indexed did not wrap; DeepSeek's sparse attention "
            "needs the selection over the whole sequence)")
    if rows is not None:
        indices = indices.index_select(1, rows.to(indices.device))
    return selection(indices, whole)


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
    wrapped = transformers_model(model)
    if wrapped is None:
        return (f"{type(model).__name__} is not a transformers PreTrainedModel; call "
                "paraxis_seq.ring_attention or ulysses_attention from its attention")
    for m in _inline_models(wrapped):
        reason = inline_reason(m)
        if reason is not None:
            return reason
    cfg = wrapped.config
    others = _sub_models(cfg)
    if others:
        return (f"sub-models {others} would run the context-parallel attention on inputs "
                "that are not sequence-sharded (image patches, audio frames); parallelize "
                "the text model alone")
    if getattr(cfg, "is_encoder_decoder", False):
        return ("encoder-decoder model: cross-attention keys are the encoder's sequence, "
                "which the context axis does not shard alike")
    sparse = sorted(set(getattr(cfg, "layer_types", None) or ()) & set(_SPARSE_LAYERS))
    if sparse:
        return f"layer types {sparse}: " + _SPARSE_LAYERS[sparse[0]]
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
    biased = _biased_attention(model, anatomy)
    if biased:
        return biased
    if not anatomy.has_attention and not recurrent_mixers(anatomy, model):
        return "no attention module found: the model mixes the sequence some other way"
    unchunked = _chunked_layers_unknown(model, anatomy)
    if unchunked:
        return unchunked
    for field in _DROPOUT_FIELDS:
        if getattr(cfg, field, 0) or 0:
            return f"config.{field}={getattr(cfg, field)}: " + DROPOUT_REFUSED
    return None


def _biased_attention(model: nn.Module, anatomy: Anatomy) -> str | None:
    """An attention module handing the interface a position bias from its own code
    (Inkling's learned relative bias): refused here, before any process group, rather
    than at the first step (a hybrid's layer kinds no longer refuse it first)."""
    held = dict(model.named_modules())
    for name, calls in anatomy.mixer_calls:
        forward = getattr(type(held.get(name)), "forward", None)
        if "eager_attention_forward" in calls and forward is not None and \
                "position_bias=" in inspect.getsource(forward):
            return (f"{type(held[name]).__name__} ({name}) passes position_bias= to the "
                    "attention function: " + _UNSUPPORTED_KWARGS["position_bias"])
    return None


def transformers_model(model: nn.Module) -> nn.Module | None:
    """``model`` if it is a transformers model, else the one a wrapper holds (peft's
    LoRA model: adapters beside its linear layers, the attention still transformers'):
    the outermost transformers model in its tree, when every other lies inside it."""
    from transformers import PreTrainedModel

    found = [m for m in model.modules() if isinstance(m, PreTrainedModel)]
    if not found or any(all(m is not x for x in found[0].modules()) for m in found):
        return None
    return found[0]


def _sub_models(cfg: Any) -> list[str]:
    """The sub-configs of ``cfg`` that configure another model (a vision or audio tower,
    BLT's byte encoders), not the text model: a sub-config of the model's own
    configuration module without a model type of its own (MPT's attention settings)
    configures a part of it."""
    return sorted(k for k, sub in getattr(cfg, "sub_configs", {}).items()
                  if k != "text_config" and not (
                      getattr(sub, "model_type", None) == ""
                      and getattr(sub, "__module__", None) == type(cfg).__module__))


def _inline_models(model: nn.Module) -> list[nn.Module]:
    """The transformers models in ``model`` whose attention is written inline (they
    cannot select an attention implementation: transformers' own test)."""
    from transformers import PreTrainedModel

    return [m for m in model.modules() if isinstance(m, PreTrainedModel)
            and not type(m)._can_set_attn_implementation()]


def _chunked_layers_unknown(model: nn.Module, anatomy: Anatomy) -> str | None:
    """Why a ``chunked_attention`` layer's attention would not learn its chunk (it reads
    the chunk from its own ``config`` and ``layer_idx``); None when every one does."""
    kinds = list(getattr(model.config, "layer_types", None) or ())
    for index in range(min(len(kinds), anatomy.num_layers)):
        if kinds[index] != "chunked_attention":
            continue
        for name in anatomy.sequence_mixers_of(index):
            try:
                module = model.get_submodule(name)
            except AttributeError:  # a pipeline stage's stand-in for another's layer
                continue
            if chunk_of(module) is None:
                return (f"layer {index} is chunked_attention, but its attention "
                        f"{type(module).__name__} does not carry its layer_idx and config, "
                        "from which its chunk is read")
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
    function = attention_function(group, mode=mode, layout=layout, documents=documents)
    AttentionInterface.register(name, function)
    model = transformers_model(model) or model  # under a wrapper (peft), its own model
    if _inline_models(model):  # the adapters call it (paraxis_seq.hf_inline)
        install_inline(model, function)
        return name
    model.set_attn_implementation(name)
    if model.config._attn_implementation != name:  # set_attn_implementation only warns
        raise ValueError(f"{type(model).__name__} did not take attn_implementation={name!r} "
                         f"(it kept {model.config._attn_implementation!r})")
    use_gathered_indexers(model, group, layout=layout)  # DSA: selection over the sequence
    return name
