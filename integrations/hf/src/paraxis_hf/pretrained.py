"""Start from a Hugging Face checkpoint directory, each rank reading only its slices.

:func:`from_pretrained` builds the model on the meta device (no parameter memory) and
hands :func:`paraxis.parallelize` a loader (``paraxis.parallel.strategy.MATERIALIZE_ATTR``).
Core calls it once the layout is known, after the pipeline split and the tensor, expert
and context partitions: each parameter left on this rank gets a tensor of its local
shape, and each real block of it (``Placement.pieces``: tensor shards, packed blocks,
an expert's rows; padding rows stay zero) is read from the safetensors file that holds
it with a slice read (``safe_open(...).get_slice``), so a rank never holds more than
its own parameters (DeepSpeed-style meta init, transformers' ``device_map`` loading).
Files are the directory's ``model.safetensors`` or the shards a
``model.safetensors.index.json`` names.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from paraxis.parallel.placement import Piece, Placement
from paraxis.parallel.strategy import MATERIALIZE_ATTR
from paraxis_hf.materialize import fill_local, fill_meta_parameters, meta_model

__all__ = ["SafetensorsDir", "from_pretrained"]

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class SafetensorsDir:
    """The tensors of a ``save_pretrained`` directory: name -> file, opened lazily."""

    def __init__(self, directory: str | Path):
        self.root = Path(directory)
        if (self.root / INDEX).is_file():
            self.where = dict(json.loads((self.root / INDEX).read_text())["weight_map"])
        elif (self.root / SINGLE).is_file():
            with safe_open(str(self.root / SINGLE), framework="pt") as f:
                self.where = dict.fromkeys(f.keys(), SINGLE)
        else:
            raise FileNotFoundError(f"{self.root} holds neither {SINGLE} nor {INDEX}: not a "
                                    "save_pretrained directory with safetensors weights")
        self._open: dict[str, Any] = {}

    def slice(self, name: str) -> Any:
        file = self.where.get(name)
        if file is None:
            raise KeyError(f"{self.root} has no tensor {name!r} (it has {len(self.where)}, "
                           f"e.g. {sorted(self.where)[:3]}); was it saved from this model?")
        if file not in self._open:
            self._open[file] = safe_open(str(self.root / file), framework="pt")
        return self._open[file].get_slice(name)


class _Loader:
    """Gives every meta parameter its rank's slice (see the module docstring)."""

    def __init__(self, files: SafetensorsDir, device: torch.device | None):
        self.files, self.device = files, device
        self.loaded_bytes = 0

    def value(self, rec: Placement, piece: Piece) -> torch.Tensor:
        return self.files.slice(rec.name)[piece.where]

    def fill(self, rec: Placement, out: torch.Tensor) -> None:
        """``rec``'s slices into ``out`` (ZeRO-3 reads its shard alone)."""
        fill_local(out, rec, self.value)
        self.loaded_bytes += out.numel() * out.element_size()

    def __call__(self, model: nn.Module) -> None:
        from paraxis.runtime.world import device_for_rank

        device = self.device or device_for_rank()
        self.loaded_bytes += fill_meta_parameters(model, device, self.value)


def from_pretrained(directory: str | Path, *, dtype: torch.dtype = torch.float32,
                    device: torch.device | None = None, **overrides: Any) -> nn.Module:
    """A transformers causal LM of ``directory``'s config on the meta device, for
    :func:`paraxis.parallelize`, which loads each rank's slices of ``directory``'s
    safetensors weights (as ``dtype``) once the layout is known."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(directory), **overrides)
    config.dtype = dtype
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        model = meta_model(config)
    finally:
        torch.set_default_dtype(previous)
    setattr(model, MATERIALIZE_ATTR, _Loader(SafetensorsDir(directory), device))
    return model
