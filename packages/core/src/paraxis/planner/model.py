"""Exact parameter counts by module, for any model a plugin can build.

The model is built on the meta device (``with torch.device("meta")``: shapes, no storage)
through the ``paraxis_build_model`` hook, so core never imports transformers: paraxis-hf
answers for Hugging Face model types with ``AutoModelForCausalLM.from_config``; core
builds its own ``tiny`` family. Parameters are then counted by where they live:

* ``embedding``: everything registered before the layer list (token and position
  embeddings), held by the first pipeline stage;
* ``layers``: per layer, its matrices, its vectors (norms, biases) and its expert
  parameters (a block's routed experts, as the model's anatomy names them; shared
  experts and the router are dense);
* ``final`` and ``head``: what comes after the layer list (final norm) and the output
  projection, held by the last stage; a head tied to the embedding is counted once
  (``tied``), as :meth:`torch.nn.Module.parameters` does.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import nn

from paraxis.config.shape import ModelShape, config_size
from paraxis.engine.metrics import non_embedding_params
from paraxis.engine.plugins import make_plugin_manager
from paraxis.parallel.anatomy import Anatomy, find_anatomy
from paraxis.parallel.code_reading import reads_weights_back
from paraxis.parallel.model_plan import find_plan
from paraxis.planner.units import PlanInputError, fmt_count

__all__ = ["LayerCount", "ModelCounts", "ModelSource", "build_on_meta", "count_model",
           "load_model_source"]

# Keys of a config.json that describe the file, not the model, or would make
# from_config do more than build (quantization).
_NOT_MODEL_KEYS = ("model_type", "transformers_version", "auto_map", "quantization_config",
                   "_name_or_path", "family")


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from: its family (``model_type``), its config fields, and the
    run's defaults found beside it (a run YAML's ``train`` section)."""

    family: str
    config: dict[str, Any]
    origin: str
    defaults: dict[str, Any]


@dataclass(frozen=True)
class LayerCount:
    matrices: int  # ndim >= 2: split by tensor parallelism
    vectors: int  # norms and biases: kept whole on every tensor rank (an upper bound)
    experts: int  # split over the expert axis (and tensor)
    adapters: int = 0  # LoRA's, counted in matrices too: the layer's trainable ones
    adapters_whole: int = 0  # of those, whole on every tensor rank (paraxis.planner.lora)

    @property
    def total(self) -> int:
        return self.matrices + self.vectors + self.experts


@dataclass(frozen=True)
class ModelCounts:
    """Parameter counts of one model and the sizes the formulas need."""

    family: str
    embedding: int
    layers: tuple[LayerCount, ...]
    final: int
    head: int  # 0 when tied to the embedding
    tied: bool
    non_embedding: int  # as paraxis.engine.metrics.non_embedding_params counts it (PaLM's N)
    hidden_size: int
    num_heads: int
    kv_heads: int
    head_dim: int
    vocab_size: int
    intermediate_size: int | None = None
    num_experts: int = 0
    top_k: int = 1
    max_seq: int | None = None
    # "llama" when a layer is two RMSNorms, fused attention and a gated MLP (counted
    # tensor by tensor, planner.activations); else Korthikanti's GPT-3 constants.
    block: str = "korthikanti"
    expert_intermediate: int | None = None
    # > 0: a LoRA run (paraxis.planner.lora): every parameter frozen but the adapters
    lora_rank: int = 0
    # The token embedding's parameters when it is a plain lookup, untied: its backward
    # reads no weight, so ZeRO-3 gathers them for forward only (0: gathered for both).
    lookup: int = 0

    @property
    def trainable(self) -> int:
        """Parameters the optimizer steps: the adapters of a LoRA run, else all."""
        return sum(c.adapters for c in self.layers) if self.lora_rank else self.total

    @property
    def total(self) -> int:
        return self.embedding + sum(c.total for c in self.layers) + self.final + self.head

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def expert_params(self) -> int:
        return sum(c.experts for c in self.layers)

    @property
    def moe_layers(self) -> int:
        return sum(1 for c in self.layers if c.experts)

    @property
    def active_non_embedding(self) -> int:
        """Non-embedding parameters one token runs through: top-k of the experts."""
        if not self.num_experts:
            return self.non_embedding
        idle = self.expert_params * (1 - self.top_k / self.num_experts)
        return round(self.non_embedding - idle)

    def shape(self, seq: int | None = None) -> ModelShape:
        """The sizes validation checks degrees against."""
        return ModelShape(hidden_size=self.hidden_size, num_attention_heads=self.num_heads,
                          num_layers=self.num_layers, vocab_size=self.vocab_size,
                          num_key_value_heads=self.kv_heads,
                          intermediate_size=self.intermediate_size,
                          num_experts=self.num_experts, seq_length=seq or self.max_seq)

    def describe(self) -> str:
        layer = max((c.total for c in self.layers), default=0)
        parts = [f"{self.family}, {fmt_count(self.total)} parameters",
                 f"embedding {fmt_count(self.embedding)}",
                 f"{self.num_layers} layers of up to {fmt_count(layer)}"]
        if self.num_experts:
            parts.append(f"{self.num_experts} experts, top-{self.top_k}")
        parts.append("head tied to the embedding" if self.tied
                     else f"head {fmt_count(self.head)}")
        if self.lora_rank:
            parts.append(f"LoRA rank {self.lora_rank}: {fmt_count(self.trainable)} "
                         f"trainable ({self.trainable / self.total:.2%}), the rest frozen")
        return ", ".join(parts)


def load_model_source(path: str | Path) -> ModelSource:
    """Read ``--model``: a directory with config.json, a config.json, or a YAML run config
    (its ``model: {family, config}`` section; ``train`` gives the defaults)."""
    p = Path(path)
    if p.is_dir() and not (p / "config.json").is_file():
        raise PlanInputError(f"--model {str(path)!r} is a directory without config.json; "
                             "give the model's directory, its config.json, or a run YAML")
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise PlanInputError(f"--model {str(path)!r}: no such file; give a model directory "
                             "holding config.json, a config.json, or a run YAML")
    text = p.read_text()
    try:
        data = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        first = str(exc).splitlines()[0]
        raise PlanInputError(f"--model {str(p)!r} does not parse: {first}") from None
    if not isinstance(data, Mapping):
        raise PlanInputError(f"--model {str(p)!r} must hold a mapping, not "
                             f"{type(data).__name__}")
    if isinstance(data.get("model"), Mapping):  # a run config
        section = data["model"]
        train = data.get("train") if isinstance(data.get("train"), Mapping) else {}
        return ModelSource(str(section.get("family", "tiny")),
                           dict(section.get("config") or {}), str(p), dict(train))
    family = data.get("model_type") or data.get("family")
    if not family:
        raise PlanInputError(f"--model {str(p)!r} has no model_type; add one, e.g. "
                             '"model_type": "llama"')
    config = {k: v for k, v in data.items() if k not in _NOT_MODEL_KEYS}
    return ModelSource(str(family), config, str(p), {})


def build_on_meta(source: ModelSource, plugin_manager: Any) -> nn.Module:
    """Build the model with shapes only: ``tiny`` here, any other family by a plugin."""
    try:
        with torch.device("meta"):
            if source.family == "tiny":
                from paraxis.models.tiny import TinyConfig, TinyTransformer

                return TinyTransformer(TinyConfig(**source.config))
            model = plugin_manager.hook.paraxis_build_model(family=source.family,
                                                            config=source.config)
    except Exception as exc:  # a plugin's own error about the config: one line
        first = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise PlanInputError(f"could not build model_type {source.family!r} from "
                             f"{source.origin}: {first}") from None
    if model is None:
        raise PlanInputError(
            f"model_type {source.family!r} ({source.origin}) is not known: core builds "
            "'tiny'; Hugging Face model types need paraxis-hf (pip install paraxis-hf) "
            "and a transformers version that knows the type")
    return model


def count_model(model: nn.Module, family: str, seq: int | None = None,
                anatomy: Anatomy | None = None) -> ModelCounts:
    """Count ``model``'s parameters by module (see the module docstring); its
    ``anatomy`` (found through the installed plugins' plan when not given) says which
    modules are the layers, the head and the routed experts."""
    if anatomy is None:
        anatomy = find_anatomy(model, find_plan(model, make_plugin_manager(), None))
    if anatomy.layers is None:
        raise PlanInputError(f"{type(model).__name__} has no layer list (nn.ModuleList) "
                             "to count layers in")
    list_name, layers = anatomy.layers, anatomy.layer_list(model)
    per_layer = [[0, 0, 0] for _ in layers]
    out = anatomy.head_of(model)
    head_ids = {id(p) for p in out.parameters()} if out is not None else set()
    input_ids = {id(p) for m in model.modules() if isinstance(m, nn.Embedding)
                 for p in m.parameters()}
    routed = tuple(f"{r}." for r in anatomy.routed)
    embedding = final = head = 0
    seen_layer = False
    for name, param in model.named_parameters():  # tied parameters appear once
        n = param.numel()
        if name.startswith(list_name + "."):
            seen_layer = True
            index = name[len(list_name) + 1:].partition(".")[0]
            kind = 2 if name.startswith(routed) else (0 if param.ndim >= 2 else 1)
            per_layer[int(index)][kind] += n
        elif id(param) in input_ids or not seen_layer:
            embedding += n
        elif id(param) in head_ids:
            head += n
        else:
            final += n
    tied = bool(head_ids & input_ids)
    table = anatomy.embedding_of(model)
    lookup = 0 if tied or table is None or reads_weights_back(table) else \
        sum(p.numel() for p in table.parameters())
    return _with_shape(model, family, seq, embedding=embedding, final=final, head=head,
                       tied=tied, layers=tuple(LayerCount(*c) for c in per_layer),
                       block=_block_kind(model, anatomy), lookup=lookup)


def _block_kind(model: nn.Module, anatomy: Anatomy) -> str:
    """"llama" when every layer has exactly two RMSNorms, a gated MLP (gate and up
    projections) and the model runs fused attention without dropout; these are the
    layers :mod:`paraxis.planner.activations` counts exactly."""
    cfg = getattr(model, "config", None)
    if getattr(cfg, "_attn_implementation", None) != "sdpa" or \
            float(getattr(cfg, "attention_dropout", 0.0) or 0.0):
        return "korthikanti"
    if any(part.rms_norms != 2 or not part.gated_mlp for part in anatomy.parts):
        return "korthikanti"
    return "llama"


def _with_shape(model: nn.Module, family: str, seq: int | None, **counts: Any) -> ModelCounts:
    cfg = getattr(model, "config", None)

    def first(*names: str, default: Any = None) -> Any:
        for name in names:
            value = getattr(cfg, name, None)
            if value is not None:
                return value
        return default

    shape = ModelShape.from_hf_config(cfg, seq_length=seq)
    hidden, heads = shape.hidden_size, shape.num_attention_heads
    if not hidden or not heads:
        raise PlanInputError(f"model_type {family!r}: its config names no hidden size or "
                             "attention heads I can read")
    experts = int(shape.num_experts or 0)
    return ModelCounts(
        family=family, non_embedding=non_embedding_params(model),
        hidden_size=hidden, num_heads=heads, kv_heads=shape.kv_heads,
        head_dim=first("head_dim", default=hidden // heads),
        vocab_size=shape.vocab_size, intermediate_size=shape.intermediate_size,
        num_experts=experts,
        top_k=config_size(cfg, "experts_per_token", 1) if experts else 1,
        max_seq=config_size(cfg, "seq_length"),
        expert_intermediate=first("moe_intermediate_size") if experts else None,
        **counts)
