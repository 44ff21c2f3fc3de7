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

A directory that cannot be used (no loadable ``config.json``, no weights, a shard file
the index names missing or outside the directory, weights of another model) is a
:class:`~paraxis.config.errors.ConfigError` on ``model.pretrained`` naming what is wrong;
``paraxis validate`` and ``paraxis train`` build the model on the meta device before any
rank starts and ask its loader (:meth:`_Loader.problems`), so it is said once, there.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from paraxis.config.errors import ConfigError, Problem
from paraxis.parallel.placement import Piece, Placement, placement_of
from paraxis.parallel.strategy import MATERIALIZE_ATTR
from paraxis_hf.materialize import fill_local, fill_meta_parameters, meta_model

__all__ = ["SafetensorsDir", "from_pretrained"]

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def _refused(directory: str | Path, rule: str, fix: str = "give a directory "
             "save_pretrained wrote (config.json and safetensors weights)") -> ConfigError:
    return ConfigError([Problem("model.pretrained", str(directory), rule, fix)])


class SafetensorsDir:
    """The tensors of a ``save_pretrained`` directory: name -> file, opened lazily."""

    def __init__(self, directory: str | Path):
        self.root = Path(directory)
        if (self.root / INDEX).is_file():
            try:
                self.where = dict(json.loads((self.root / INDEX).read_text())["weight_map"])
            except (ValueError, KeyError, TypeError) as exc:
                raise _refused(directory, f"{INDEX} cannot be read ({type(exc).__name__}: "
                               f"{exc})") from None
        elif (self.root / SINGLE).is_file():
            with self._opened(SINGLE) as f:
                self.where = dict.fromkeys(f.keys(), SINGLE)
        else:
            raise _refused(directory, f"holds neither {SINGLE} nor {INDEX}: not a "
                           "save_pretrained directory with safetensors weights")
        for file in sorted(set(self.where.values())):
            if Path(file).name != file or file in ("", ".", ".."):  # never read outside
                raise _refused(directory, f"{INDEX} names {file!r}, a file outside the "
                               "directory", "keep every shard beside its index")
            if not (self.root / file).is_file():
                raise _refused(directory, f"{INDEX} names {file}, which is missing",
                               "copy every shard the index names")
        self._open: dict[str, Any] = {}

    def _opened(self, file: str) -> Any:
        try:
            return safe_open(str(self.root / file), framework="pt")
        except (SafetensorError, OSError) as exc:
            raise _refused(self.root, f"{file} cannot be read as safetensors ({exc})"
                           ) from None

    def slice(self, name: str) -> Any:
        file = self.where.get(name)
        if file is None:
            raise _refused(self.root, f"has no tensor {name!r} (it has {len(self.where)}, "
                           f"e.g. {sorted(self.where)[:3]})", "was it saved from this "
                           "model? give the directory of this model's weights")
        if file not in self._open:
            self._open[file] = self._opened(file)
        return self._open[file].get_slice(name)

    def shape(self, name: str) -> list[int] | None:
        """The saved shape of tensor ``name``, or None when the directory lacks it."""
        return None if name not in self.where else list(self.slice(name).get_shape())


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

    def problems(self, model: nn.Module) -> list[str]:
        """What this loader cannot give ``model`` (its parameters by global name, with
        their placements): a tensor the directory lacks, or one of another shape."""
        wrong = []
        for param in model.parameters():
            rec = placement_of(param)
            saved = self.files.shape(rec.name)
            if saved is None:
                wrong.append(f"{rec.name} is missing")
            elif saved != list(rec.global_shape):
                wrong.append(f"{rec.name} has shape {saved}, the model's is "
                             f"{list(rec.global_shape)}")
        return wrong

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

    if not Path(directory).is_dir():
        raise _refused(directory, "is not a directory")
    if not (Path(directory) / "config.json").is_file():
        raise _refused(directory, "holds no config.json")
    try:
        config = AutoConfig.from_pretrained(str(directory), local_files_only=True,
                                            **overrides)
    except (OSError, ValueError, KeyError) as exc:  # no config.json, or no model_type
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise _refused(directory, f"holds no config transformers can load "
                       f"({type(exc).__name__}: {first})") from None
    config.dtype = dtype
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        model = meta_model(config)
    finally:
        torch.set_default_dtype(previous)
    setattr(model, MATERIALIZE_ATTR, _Loader(SafetensorsDir(directory), device))
    return model
