"""Recurrent layers under context parallelism (issue 35): which sequence mixers can pass
their state across the context ranks, and the wrapper that makes them do it.

A state-space, linear-attention or short-convolution mixer of a transformers model
hands its sequence work to module-level kernel functions (``mamba2_chunk_scan``,
``torch_chunk_gated_delta_rule``, ``causal_conv1d_fn``...: the names transformers swaps
for ``mamba_ssm``, ``fla`` and ``causal_conv1d`` kernels where they are installed).
The model's anatomy lists what each mixer's class calls (``Anatomy.mixer_calls``);
a mixer calling one of :data:`PASSED` gets its forward wrapped: while it runs, each of
its kernel names resolves to an adapter (:mod:`paraxis_seq.state_kernels`) that calls
the original on this rank's chunks and passes the state across ranks, so the mixer's
projections, gates and norms run unchanged on the shard. Fused whole-mixer kernels
(:data:`FUSED`) answer None there, which sends the mixer down its unfused path; one-token
cache steps (:data:`STEPS`) refuse, since training builds no cache.

A module whose recurrence runs in its own forward, of a class in :data:`OWNED` (MiniMax's
lightning attention, RecurrentGemma's recurrent block, ZAYA's convolutional projection),
is called through that class's adapter (:mod:`paraxis_seq.state_inline`) instead.
Refused before any process group (:func:`unpassable`), with the modules named: any other
module that mixes the sequence in its own code (RWKV, xLSTM, a dynamic convolution),
since no kernel boundary exists to pass a state across.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import types
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from paraxis.parallel.anatomy import Anatomy, is_norm
from paraxis.parallel.batch import DOC_IDS_KWARG
from paraxis.parallel.standins import stands_in
from paraxis_seq.state_exchange import ChunkLayout
from paraxis_seq.state_inline import ConvolutionalProjection, GriffinBlock, LightningAttention
from paraxis_seq.state_kernels import (
    ConvolutionHalo,
    MixerCall,
    SelectiveScan,
    StateScan,
    refuse_step,
)

__all__ = ["FUSED", "LAYER_KINDS", "OWNED", "PASSED", "STEPS", "ModelCall", "recurrent_mixers",
           "unpassable", "use_state_passing"]

_DELTA_RULE = StateScan(inputs=("query", "key", "value", "g", "beta"), zeroed="value",
                        state="initial_state", final="output_final_state",
                        transition="matrix", pair=True)
# Kernel function -> the adapter that passes its state (state_kernels' docstring).
PASSED: dict[str, Any] = {
    "causal_conv1d_fn": ConvolutionHalo(),
    "mamba2_chunk_scan": StateScan(inputs=("hidden_states", "dt", "B", "C", "z"),
                                   zeroed="hidden_states", state="initial_states",
                                   final="return_final_states", transition="diagonal"),
    "torch_chunk_gated_delta_rule": _DELTA_RULE,
    "chunk_kimi_delta_attention": _DELTA_RULE,
    "mamba_selective_scan": SelectiveScan(),
}
# Mixer class -> the adapter that passes the state of a recurrence it runs in its own
# forward (paraxis_seq.state_inline), called with that forward.
OWNED: dict[str, Any] = {
    "MiniMaxLightningAttention": LightningAttention(),
    "RecurrentGemmaRecurrentBlock": GriffinBlock(),
    "ZayaCCAProjection": ConvolutionalProjection(),
}
FUSED = ("mamba2_split_conv1d_scan_combined", "mamba_inner_fn")
STEPS = ("causal_conv1d_update", "mamba2_selective_state_update",
         "mamba_selective_state_update", "torch_recurrent_gated_delta_rule",
         "recurrent_kimi_delta_attention")
# config.layer_types kinds whose sequence mixing is checked module by module here (state
# space, linear attention, convolutions, hybrids of those with attention) or that mix
# nothing along the sequence (Nemotron-H's MLP and MoE layers).
LAYER_KINDS = frozenset({"linear_attention", "conv", "hybrid", "hybrid_sliding", "mlp", "moe"})
# What a module calls when it attends through transformers' attention interface (whose
# fallback this is): softmax attention, which the context attention function replaces.
_INTERFACE = "eager_attention_forward"


def recurrent_mixers(anatomy: Anatomy, model: nn.Module | None = None,
                     ) -> dict[str, tuple[str, ...]]:
    """Mixer name -> the kernel functions of it to replace, for every mixer calling one
    of :data:`PASSED`; none for a module of ``model`` whose class is :data:`OWNED` (a
    mixer, or what holds one: ZAYA's projection holds its convolutions)."""
    swapped = set(PASSED) | set(FUSED) | set(STEPS)
    passing = {name: tuple(sorted(set(calls) & swapped)) for name, calls in anatomy.mixer_calls
               if set(calls) & set(PASSED)}
    held = {} if model is None else dict(model.named_modules())
    return passing | {name: () for name, module in held.items()
                      if type(module).__name__ in OWNED}


def unpassable(model: nn.Module, anatomy: Anatomy) -> str | None:
    """Why some sequence mixer of ``model`` cannot pass its state across context ranks
    (None: every one can, or is attention). Sequence mixers are the anatomy's; a module
    holding a passing mixer, a layer or attention (a block, the model), a norm, or a part
    of a passing mixer is not one itself."""
    held = dict(model.named_modules())
    passing = recurrent_mixers(anatomy, model)
    calls = dict(anatomy.mixer_calls)
    layers = [anatomy.layer_name(i) for i in range(anatomy.num_layers)]
    inline: dict[str, str] = {}
    for name in anatomy.mixers:
        module = held.get(name)
        if module is None or name in passing or is_norm(module) or \
                _INTERFACE in calls.get(name, ()) or name in layers or \
                any(_contains(p, name) or _contains(name, p) for p in passing) or \
                any(_contains(name, p) for p in layers):
            continue
        inline.setdefault(type(module).__name__, name)
    if not inline:
        return None
    named = sorted(f"{cls} ({name})" for cls, name in inline.items())
    return (f"modules {named} mix the sequence in their own code (a recurrence or a "
            "convolution computed inline, or attention to another sequence), not through a "
            f"kernel function paraxis passes a state across ranks around ({sorted(PASSED)}); "
            "they would see only this rank's shard")


def _contains(outer: str, inner: str) -> bool:
    return not outer or inner.startswith(f"{outer}.")


def use_state_passing(model: nn.Module, group: Any, *, anatomy: Anatomy,
                      layout: str = "zigzag", documents: Any = None,
                      pipelined: bool = False) -> tuple[str, ...]:
    """Wrap every passing mixer ``model`` (a whole model or one pipeline chunk) holds;
    returns their names. ``documents`` (paraxis_seq.strategy.DocumentState) says when a
    step's batch carries document ids, so a mixer that gets none is an error, not a
    state leaking across documents. ``pipelined``: a schedule may run other microbatches'
    forwards before a recomputation (see :class:`ModelCall`)."""
    chunks = ChunkLayout(group, layout)
    call = ModelCall(pipelined)
    wrapped = []
    for name, kernels in recurrent_mixers(anatomy, model).items():
        try:
            module = model.get_submodule(name)
        except AttributeError:  # another pipeline stage's
            continue
        if stands_in(module):
            continue
        module.forward = StatePassing(module, kernels, chunks, documents, call)
        owned = type(module).__name__ in OWNED
        for child in () if owned else module.modules():
            if isinstance(child, nn.Conv1d):
                child.register_forward_pre_hook(functools.partial(_conv_called, name))
        module.paraxis_context = "state passed across ranks " + \
            (f"({type(module).__name__}'s own forward)" if owned else f"({', '.join(kernels)})")
        wrapped.append(name)
    if wrapped:
        model.register_forward_pre_hook(call.record, with_kwargs=True)
    return tuple(wrapped)


def _conv_called(mixer: str, module: nn.Module, args: Any) -> None:
    raise ValueError(f"{mixer} ran its convolution as a module, not through the kernel "
                     "function paraxis passes the previous rank's inputs to: it would see "
                     "only this rank's shard")


class ModelCall:
    """The document ids of the latest call of the model (or pipeline chunk) holding the
    mixers: how they reach a mixer its family calls without keywords (Mamba's, Jamba's
    layers call ``mixer(hidden_states, cache, attention_mask)``). A mixer runs inside
    that call, or in backward when its layer is recomputed: one process's step runs each
    microbatch's backward before the next forward, so the ids are still its own; a
    pipeline schedule may run later forwards first, so a recomputation there refuses."""

    def __init__(self, pipelined: bool) -> None:
        self.pipelined, self.ids = pipelined, None

    def record(self, module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        self.ids = kwargs.get(DOC_IDS_KWARG)

    def documents(self, owner: str, hidden: Any) -> Any:
        if self.ids is None:
            raise ValueError(
                f"{owner} got no document ids ({DOC_IDS_KWARG}), nor did the model call "
                "that ran it: context parallelism cannot reset its state at padding or "
                "packed documents; train it without padding and packing, or without the "
                "context axis")
        if self.pipelined and torch._C._current_graph_task_id() != -1:
            raise ValueError(
                f"{owner} is recomputed in backward under a pipeline schedule and its "
                f"family does not hand it the document ids ({DOC_IDS_KWARG}): the latest "
                "stage call may be another microbatch's; turn activation checkpointing "
                "off, or train without padding and packing")
        if tuple(hidden.shape[:2]) != tuple(self.ids.shape):
            raise ValueError(f"{owner}: the model call's document ids {tuple(self.ids.shape)} "
                             f"do not cover its input {tuple(hidden.shape[:2])}")
        return self.ids


class StatePassing:
    """The forward of a mixer whose kernel functions, while it runs, are the adapters of
    :data:`PASSED` (and :data:`FUSED` / :data:`STEPS` stand-ins) bound to this call."""

    def __init__(self, module: nn.Module, kernels: tuple[str, ...], chunks: ChunkLayout,
                 documents: Any = None, model_call: ModelCall | None = None) -> None:
        self.forward, self.chunks, self.documents = module.forward, chunks, documents
        self.module, self.owned = module, OWNED.get(type(module).__name__)
        self.owner, self.model_call = type(module).__name__, model_call or ModelCall(False)
        self.kernels = [(scope, name, scope[name]) for name in kernels
                        for scope in _scopes(type(module), name)]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        documents = kwargs.pop(DOC_IDS_KWARG, None)
        if documents is None and getattr(self.documents, "expected", False):
            hidden = args[0] if args else next(iter(kwargs.values()))
            documents = self.model_call.documents(self.owner, hidden)
        call = MixerCall(self.chunks, documents)
        if self.owned is not None:
            return self.owned(self.module, self.forward, call, *args, **kwargs)
        with _swapped([(scope, name, _adapter(name, original, call))
                       for scope, name, original in self.kernels]):
            return self.forward(*args, **kwargs)


def _adapter(name: str, original: Any, call: MixerCall) -> Any:
    if name in PASSED:
        return functools.partial(PASSED[name], original, call)
    if name in FUSED:
        return lambda *args, **kwargs: None
    return refuse_step(name)


@functools.cache
def _scopes_of(cls: type) -> tuple[types.FunctionType, ...]:
    bases = [b for b in inspect.getmro(cls) if b not in inspect.getmro(nn.Module)]
    return tuple(inspect.unwrap(m) for b in bases for m in vars(b).values()
                 if inspect.isfunction(m))


def _scopes(cls: type, name: str) -> list[dict[str, Any]]:
    """The module namespaces the methods of ``cls`` look ``name`` up in."""
    scopes: dict[int, dict[str, Any]] = {}
    for function in _scopes_of(cls):
        if inspect.isfunction(function.__globals__.get(name)):
            scopes[id(function.__globals__)] = function.__globals__
    return list(scopes.values())


@contextlib.contextmanager
def _swapped(replacements: list[tuple[dict[str, Any], str, Any]]) -> Iterator[None]:
    """Module-level names set for the duration of one call, restored after it (the
    process runs one forward at a time; a recomputation re-enters the wrapper)."""
    saved = [(scope, name, scope[name]) for scope, name, _ in replacements]
    for scope, name, new in replacements:
        scope[name] = new
    try:
        yield
    finally:
        for scope, name, old in saved:
            scope[name] = old
