"""What a model is made of, read once: the one answer every axis and the planner use.

Which module is the head, which list holds the layers, which child of a layer attends,
which mixes the sequence some other way, which routes tokens to experts: every axis
needs some of these answers, and answered in several places they drifted apart (four
rules for the head, four for the layers; the sequence-parallel head and Nemotron-H's
``mixer`` blocks were bugs of exactly that kind, issue 33). :func:`find_anatomy` answers
them once, before any process group, from the model's plan (paraxis-hf reads
transformers' own) or the model's own declaration, with the fallbacks for a model that
has neither written here and nowhere else. The :class:`Anatomy` it returns is frozen
data (module names, never modules), so it holds for the whole model and for every
pipeline stage cut from it: a stage keeps the model's names, and what another stage owns
is a stand-in (:mod:`paraxis.parallel.standins`) that the anatomy's lookups skip.

A module that is not a transformers model can declare its anatomy itself: a method
``paraxis_anatomy(plan) -> Anatomy`` wins over everything below.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from typing import Any

from torch import nn

from paraxis.parallel.code_reading import class_calls
from paraxis.parallel.model_plan import Adapter, ModelPlan, PlanError
from paraxis.parallel.standins import SkipLayer, stands_in

__all__ = ["Anatomy", "LayerParts", "class_calls", "expert_blocks", "find_anatomy", "is_norm",
           "is_sequence_mixer"]

# How a layer's child is classified, by its name in the layer (the rule sequence
# parallelism was validated with over the coverage matrix: class names carry a family's
# prefix, ``MambaRMSNorm``, ``RecurrentGemmaMlp``, so a class rule would call norms and
# MLPs mixers) and, to tell attention from other mixers, by its class: a child named
# like attention whose class is a linear, lightning or cross attention (Qwen3-Next's
# ``linear_attn``, MiniMax's ``self_attn``) mixes the sequence some other way.
_SEQUENCE_CHILD = re.compile(r"(attn|attention|mixer|mamba|ssm|conv|recurrent|rnn|lstm|"
                             r"time_mix|token_mix|temporal_block)$")
_ATTENTION_CHILD = re.compile(r"(attn|attention)$")
_MLP_CHILD = re.compile(r"(mlp|feed_forward|ffn|ff|moe)$")
_GATES = frozenset({"gate_proj", "gate_up_proj", "w1"})
# Classes that mix the sequence outside softmax self-attention, anywhere in the model.
# Broad on purpose: context parallelism refuses a model holding one (a refusal too many
# is safe; a mixer missed would see one rank's shard of the sequence).
_MIXER_CLASS = re.compile(r"Mamba|Mixer|GatedDeltaNet|LinearAttention|ShortConv|Recurrent|"
                          r"Rwkv|RWKV|LSTM|Lightning|CrossAttention")
# ... but not a family's per-token classes the family prefix alone matched
# (RecurrentGemmaMlp, xLSTMFeedForward, a rotary embedding: a function of positions).
_PER_TOKEN_CLASS = re.compile(r"(Mlp|MLP|FeedForward|RotaryEmbedding)$")
_ATTENTION_CLASS = re.compile(r"Attention|Attn|MLA")
_NORM_CLASS = re.compile(r"Norm")
# The method a module defines to declare its own anatomy.
DECLARATION = "paraxis_anatomy"


# The child a mixture-of-experts block keeps its routed experts in (transformers 5.x's
# fused experts, and the lists of experts before them).
EXPERTS_CHILD = "experts"


def expert_blocks(model: nn.Module) -> tuple[str, ...]:
    """The mixture-of-experts blocks of ``model``: the modules holding a child named
    :data:`EXPERTS_CHILD` (a block's shared experts are named otherwise). paraxis-hf's
    plan names these; a model without a plan gets them from here too."""
    return tuple(name for name, module in model.named_modules()
                 if isinstance(getattr(module, EXPERTS_CHILD, None), nn.Module))


def is_sequence_mixer(module: nn.Module) -> bool:
    """A module that mixes the sequence outside softmax self-attention, by its class (a
    state-space scan, linear or lightning attention, a recurrence, a convolution over
    positions, or attention to another sequence)."""
    name = type(module).__name__
    return isinstance(module, nn.Conv1d) or (
        bool(_MIXER_CLASS.search(name)) and not _PER_TOKEN_CLASS.search(name))


def is_norm(module: nn.Module) -> bool:
    """A normalization (mixes features, never positions), by its class as layers' are."""
    return bool(_NORM_CLASS.search(type(module).__name__)) or \
        isinstance(module, nn.LayerNorm | nn.GroupNorm)


@dataclass(frozen=True)
class LayerParts:
    """The children of one layer, by role (names relative to the layer)."""

    attention: tuple[str, ...] = ()  # softmax self-attention blocks
    mixers: tuple[str, ...] = ()  # other sequence mixers (state-space, linear attention)
    mlp: tuple[str, ...] = ()  # dense feed-forward blocks
    experts: tuple[str, ...] = ()  # mixture-of-experts blocks (the plan's)
    norms: tuple[str, ...] = ()
    gated_mlp: bool = False  # its MLP has a gate projection (SwiGLU-style)
    rms_norms: int = 0  # RMSNorm modules anywhere in the layer (q/k norms included)

    @property
    def sequence_mixers(self) -> tuple[str, ...]:
        """Every child that mixes information along the sequence, attention first."""
        return self.attention + self.mixers


@dataclass(frozen=True)
class Anatomy:
    """The parts of a model, by module name (the same on every pipeline stage)."""

    model_class: str
    layers: str | None  # the list of layers; None when none was found (see ``origin``)
    num_layers: int
    embedding: str | None = None  # the token embedding (takes ``input_ids``)
    before: tuple[str, ...] = ()  # other modules run before the layers
    after: tuple[str, ...] = ()  # modules run after the layers, before the head
    head: str | None = None  # the output head (gives the logits)
    tied: bool = False  # the head's weight is the token embedding's
    parts: tuple[LayerParts, ...] = ()  # per layer
    expert_blocks: tuple[str, ...] = ()  # full names of the mixture-of-experts blocks
    routed: tuple[str, ...] = ()  # full names of those blocks' routed experts
    mixers: tuple[str, ...] = ()  # full names of every sequence mixer outside attention
    has_attention: bool = False  # some module computes softmax attention
    # (name, functions its class calls) of ``mixers`` and layers' attention children: a
    # scan, linear-attention recurrence or causal convolution runs through such functions
    # (``mamba2_chunk_scan``), which an axis cutting the sequence wraps (issue 35).
    mixer_calls: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # Low-rank adapters beside base linear layers (the plan's: a peft LoRA model's)
    adapters: tuple[Adapter, ...] = ()
    # Where the layers and the modules around them were read: "declared" (the model's
    # own paraxis_anatomy), "plan" (the pipeline plan), "search" (the fallbacks), or
    # "none: <why>" when no list of layers was found.
    origin: str = "plan"

    @classmethod
    def unknown(cls, why: str) -> Anatomy:
        """An anatomy that knows nothing (no layers, no head), saying ``why``."""
        return cls(model_class="?", layers=None, num_layers=0, origin=f"none: {why}")

    def layer_name(self, index: int) -> str:
        return f"{self.layers}.{index}"

    def layer_list(self, model: nn.Module) -> nn.ModuleList:
        """The list of layers of ``model`` (a whole model or one of its stages); a
        :class:`PlanError` saying why when the model has none."""
        layers = _maybe(model, self.layers)
        if not isinstance(layers, nn.ModuleList):
            why = self.origin.removeprefix("none: ") if self.layers is None else \
                f"{self.layers!r} is not a list of layers in {type(model).__name__}"
            raise PlanError(f"{self.model_class}: {why}")
        return layers

    def owned_layers(self, model: nn.Module) -> list[tuple[int, nn.Module]]:
        """(index, layer) of each layer ``model`` runs itself (a stage's stand-ins for
        other stages' layers left out), in order."""
        return [(i, layer) for i, layer in enumerate(self.layer_list(model))
                if not isinstance(layer, SkipLayer)]

    def head_of(self, model: nn.Module) -> nn.Module | None:
        """The output head, or None where ``model`` (a stage) does not hold it."""
        return _held(model, self.head)

    def embedding_of(self, model: nn.Module) -> nn.Module | None:
        """The token embedding, or None where ``model`` (a stage) does not hold it."""
        return _held(model, self.embedding)

    def adapter_of(self, module: str) -> Adapter | None:
        """The adapter that ``module`` (a full name) computes beside its base, if any."""
        return next((a for a in self.adapters if a.module == module), None)

    def sequence_mixers_of(self, index: int) -> tuple[str, ...]:
        """Full names of layer ``index``'s children that mix the sequence."""
        return tuple(f"{self.layer_name(index)}.{c}" for c in self.parts[index].sequence_mixers)

    def describe(self) -> str:
        tied = " (tied to the embedding)" if self.tied else ""
        return (f"{self.model_class}: embedding {self.embedding}, {self.num_layers} layers "
                f"at {self.layers}, head {self.head}{tied}; {len(self.expert_blocks)} "
                f"expert blocks, {len(self.mixers)} other sequence mixers (from: "
                f"{self.origin})")


def _maybe(model: nn.Module, name: str | None) -> nn.Module | None:
    if not name:
        return None
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


def _held(model: nn.Module, name: str | None) -> nn.Module | None:
    module = _maybe(model, name)
    return None if stands_in(module) else module


def _name_of(model: nn.Module, target: Any) -> str | None:
    if not isinstance(target, nn.Module):
        return None
    return next((n for n, m in model.named_modules() if m is target and n), None)


def _ends_from_plan(model: nn.Module, plan: ModelPlan) -> dict[str, Any] | None:
    """Layers, embedding, head and the modules around them from the pipeline plan (in
    forward order; the entry that is a list of layers holds them)."""
    names = list(plan.pipeline)
    lists = [n for n in names if isinstance(_maybe(model, n), nn.ModuleList)]
    if not lists:
        return None
    at = names.index(lists[0])
    embedding = next((n for n in names[:at] if "input_ids" in plan.pipeline[n][0]), None)
    head = next((n for n in names[at + 1:] if "logits" in plan.pipeline[n][1]), None)
    return {"layers": lists[0], "embedding": embedding, "head": head,
            "before": tuple(n for n in names[:at] if n != embedding),
            "after": tuple(n for n in names[at + 1:] if n != head), "origin": "plan"}


def _ends_by_search(model: nn.Module) -> dict[str, Any]:
    """The fallbacks for a model without a pipeline plan: the outermost list of modules
    (the longest among equals: the decoder layers, not a layer's list of experts, which
    may be longer), the model's input and output embeddings as transformers declares
    them, else a child named ``lm_head`` or ``head``."""
    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and n]
    layers = min(lists, key=lambda item: (item[0].count("."), -len(item[1])))[0] \
        if lists else None
    get_in = getattr(model, "get_input_embeddings", None)
    get_out = getattr(model, "get_output_embeddings", None)
    embedding = _name_of(model, get_in() if callable(get_in) else None)
    head = _name_of(model, get_out() if callable(get_out) else None)
    if head is None:
        head = next((n for n in ("lm_head", "head") if _maybe(model, n) is not None), None)
    origin = "search" if lists else (
        f"none: {type(model).__name__} has no list of layers (nn.ModuleList) and no "
        "pipeline plan naming one; pass a plan or define paraxis_anatomy(plan)")
    return {"layers": layers, "embedding": embedding, "head": head, "before": (),
            "after": (), "origin": origin}


def _classify(layer: nn.Module, prefix: str, experts: set[str]) -> LayerParts:
    roles: dict[str, list[str]] = {"attention": [], "mixers": [], "mlp": [], "experts": [],
                                   "norms": []}
    for child, module in layer.named_children():
        if f"{prefix}.{child}" in experts:
            role = "experts"
        elif _SEQUENCE_CHILD.search(child):
            role = "attention" if _ATTENTION_CHILD.search(child) and \
                not is_sequence_mixer(module) else "mixers"
        elif _NORM_CLASS.search(type(module).__name__) or \
                isinstance(module, nn.LayerNorm | nn.GroupNorm):
            role = "norms"
        elif _MLP_CHILD.search(child):
            role = "mlp"
        else:
            continue
        roles[role].append(child)
    names = [n for n, _ in layer.named_modules()] + [n for n, _ in layer.named_parameters()]
    gated = any(n.rpartition(".")[2] in _GATES for n in names)
    rms = sum(type(m).__name__.endswith("RMSNorm") for m in layer.modules())
    return LayerParts(**{k: tuple(v) for k, v in roles.items()}, gated_mlp=gated,
                      rms_norms=rms)


def find_anatomy(model: nn.Module, plan: ModelPlan | None = None) -> Anatomy:
    """The anatomy of ``model`` (whole, before any axis applies): its own declaration if
    it has one, else read from ``plan`` and the module tree (see the module docstring).
    A model without a list of layers gets an anatomy saying so (``origin``), and an
    axis that needs its layers raises :class:`PlanError` with that reason."""
    declare = getattr(model, DECLARATION, None)
    if callable(declare):
        return declare(plan)
    plan = plan or ModelPlan(type(model).__name__)
    ends = (_ends_from_plan(model, plan) if plan.pipeline else None) or _ends_by_search(model)
    names = [n for n, _ in model.named_modules()]
    experts = {n for n in names for p in plan.experts if fnmatch.fnmatchcase(n, p)} \
        if plan.experts else set(expert_blocks(model))
    layers = _maybe(model, ends["layers"])
    layers = layers if isinstance(layers, nn.ModuleList) else nn.ModuleList()
    parts = tuple(_classify(layer, f"{ends['layers']}.{i}", experts)
                  for i, layer in enumerate(layers))
    embedding, head = _maybe(model, ends["embedding"]), _maybe(model, ends["head"])
    tied = embedding is not None and head is not None and bool(
        {id(p) for p in embedding.parameters()} & {id(p) for p in head.parameters()})
    modules = list(model.named_modules())
    mixers = tuple(n for n, m in modules if is_sequence_mixer(m))
    attention = any(_ATTENTION_CLASS.search(type(m).__name__) and not is_sequence_mixer(m)
                    for _, m in modules)
    blocks = tuple(n for n in names if n in experts)
    routed = tuple(f"{b}.{EXPERTS_CHILD}" for b in blocks
                   if _maybe(model, f"{b}.{EXPERTS_CHILD}") is not None)
    mixing = {n for n in mixers if n and not f"{ends['layers']}.".startswith(f"{n}.")} | {
        f"{ends['layers']}.{i}.{c}" for i, p in enumerate(parts) for c in p.attention}
    calls = tuple((n, c) for n, m in modules if n in mixing and (c := class_calls(type(m))))
    adapters = tuple(a for a in plan.adapters if _maybe(model, a.module) is not None)
    return Anatomy(model_class=plan.model_class, num_layers=len(layers), parts=parts,
                   tied=tied, expert_blocks=blocks, routed=routed, mixers=mixers,
                   has_attention=attention, mixer_calls=calls, adapters=adapters, **ends)
