"""Where a peft LoRA model's values come from when it waits on the meta device, and its
parity-probe twin.

``paraxis train`` builds a transformers model on the meta device (its pretrained
weights read by slices, or a family's init drawn per element) and wraps it with peft
before any axis applies. peft renames what it wraps (``q_proj.weight`` becomes
``base_model.model.….q_proj.base_layer.weight``; a module to save is copied into
``original_module`` and ``modules_to_save.<adapter>``) and adds the adapters.
:class:`PeftMaterializer` gives every base weight, and both copies of a module to save,
the value the unwrapped model's materializer gives its original name, and each adapter
peft's own init: A uniform on [-1/sqrt(in), 1/sqrt(in)) (``kaiming_uniform_`` with
a = sqrt(5), Hu et al.'s and peft's default), B zero, drawn from (seed, name, element)
alone like every deferred weight (:mod:`paraxis_hf.invariant_init`), so every layout
starts from the same adapters.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import re
from typing import Any

import torch
from torch import nn

from paraxis.engine.lora import ADAPTED_ATTR
from paraxis.parallel.placement import Piece, Placement
from paraxis_hf.invariant_init import Draw, Fill, InitRule, piece_values
from paraxis_hf.materialize import fill_local, fill_meta_parameters

__all__ = ["PeftMaterializer", "peft_twin"]

# peft's inserted levels: a LoRA layer's base, a module to save's two copies.
_INSERTED = re.compile(r"\.(base_layer|original_module|modules_to_save\.[^.]+)(?=\.)")
_ADAPTER = re.compile(r"\.(lora_A|lora_B)\.[^.]+\.(weight|bias)$")


def base_name(name: str, prefix: str) -> str | None:
    """The name the unwrapped model gives ``name`` (a peft model's parameter), or None
    for an adapter's own parameter."""
    if _ADAPTER.search(name) or ".lora_" in name:
        return None
    return _INSERTED.sub("", name.removeprefix(f"{prefix}."))


def adapter_rule(rec: Placement) -> InitRule:
    """peft's default init of an adapter parameter (see the module docstring)."""
    found = _ADAPTER.search(rec.name)
    if found is None:
        raise KeyError(f"{rec.name}: a peft parameter with no init rule here (a LoRA "
                       "variant's, such as DoRA's magnitude): build the model whole "
                       "(not on the meta device) to use it")
    if found.group(1) == "lora_A" and found.group(2) == "weight":
        bound = 1.0 / math.sqrt(rec.global_shape[1])
        return InitRule(Draw("uniform", -bound, bound))
    return InitRule(Fill(0.0))


class PeftMaterializer:
    """``MATERIALIZE_ATTR`` of a peft model on the meta device (module docstring):
    ``inner`` is the unwrapped model's (a safetensors loader or an invariant init)."""

    def __init__(self, inner: Any, prefix: str, seed: int | None = None):
        self.inner, self.prefix = inner, prefix
        self.seed = torch.initial_seed() if seed is None else seed

    def value(self, rec: Placement, piece: Piece) -> torch.Tensor:
        name = base_name(rec.name, self.prefix)
        if name is not None:
            return self.inner.value(dataclasses.replace(rec, name=name), piece)
        return piece_values(adapter_rule(rec), seed=self.seed, name=rec.name,
                            global_shape=rec.global_shape, where=piece.where,
                            dtype=rec.dtype)

    def fill(self, rec: Placement, out: torch.Tensor) -> None:
        """``rec``'s values into ``out`` (ZeRO-3 fills its shard alone)."""
        fill_local(out, rec, self.value)

    def __call__(self, model: nn.Module) -> None:
        from paraxis.runtime.world import device_for_rank

        device = getattr(self.inner, "device", None) or device_for_rank()
        fill_meta_parameters(model, device, self.value)


def peft_twin(model: nn.Module, layout: Any) -> nn.Module:
    """The parity probe's twin of a peft model: the transformers model's twin
    (:func:`paraxis_hf.twin.twin_model`) wrapped by the same LoRA config, its adapters
    seeded, B drawn too (peft's zero B would make every A's gradient zero, and the
    probe would compare nothing there)."""
    from peft import get_peft_model

    from paraxis_hf.twin import twin_model

    (name, config), = model.peft_config.items()
    twin = twin_model(model.get_base_model(), layout)
    config = copy.deepcopy(config)
    config.inference_mode = False
    config.init_lora_weights = False  # A and B both drawn (nn.Linear's own init)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        wrapped = get_peft_model(twin, config, adapter_name=name)
    # Built from the same lora section as the model (parallelize keeps it, engine.lora)
    setattr(wrapped, ADAPTED_ATTR, getattr(model, ADAPTED_ATTR, None))
    return wrapped
