"""The checkpoint's layout: which bytes a rank writes, under which keys, and the index.

A checkpoint is a directory ``step-NNNNNNNN/`` holding ``index.json`` and one
safetensors file per rank; a ``latest`` file beside it names the newest. No pickle.

The index records format and software versions, the parallel and model configs, the
grid (degrees and every rank's coordinates), the step, the data position, scheduler
and optimizer hyper-parameters, Python RNG states, every file's size and SHA-256, and
for every tensor its global name, shape, dtype and the file, key and offsets of each
shard. Keys: ``model/<name>[#partK]``, ``optim/<name>[#partK]/<state>``,
``buffer/<name>[#partK]`` (persistent buffers, :mod:`paraxis.checkpoint.buffers`),
``rng/rank<r>/<stream>``. Each distinct shard is written once, by the replica whose
coordinates on the replicated axes are all zero.
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any

import torch

from paraxis.checkpoint.files import FORMAT_VERSION, CheckpointError, is_plain_name
from paraxis.checkpoint.state import TrainState
from paraxis.parallel.optimizers import optimizer_params
from paraxis.parallel.placement import Placement
from paraxis.version import __version__

__all__ = ["build_index", "is_owner", "optimizer_keys", "optimizer_params", "pieces",
           "resolve", "rng_states"]

Piece = tuple[str, torch.Tensor, list[int], list[list[int]]]


def pieces(t: torch.Tensor, p: Placement) -> list[Piece]:
    """(key suffix, local view, global shape, [offset, length] per dim) of each logical
    tensor block that ``t`` (laid out as ``p``) holds: one, one per block of a packed
    dim, or none for a shard of padding only. Nested shards (a data shard of a tensor
    shard, :class:`paraxis.parallel.placement.Shard`) map to their global rows; padding
    rows are cut off, so they are neither saved nor loaded."""
    return [(piece.suffix, t[piece.local], list(piece.shape), [list(r) for r in piece.region])
            for piece in p.pieces()]


def is_owner(p: Placement, coords: dict[str, int]) -> bool:
    """Whether this rank writes the shard: coordinate 0 on every replicated axis."""
    return not p.mirror and all(coords[a] == 0 for a in p.replicated)


def rng_states(state: TrainState) -> dict[str, torch.Tensor]:
    """torch's generators and the run's own streams, as tensors."""
    states = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state()
    for name, stream in state.rng_streams.items():
        states[name] = stream.get_state()
    return states


def optimizer_keys(index: dict[str, Any]) -> dict[str, dict[str, list[str]]]:
    """parameter name -> state name -> its keys (``optim/<param>[#partK]/<state>``)."""
    out: dict[str, dict[str, list[str]]] = {}
    for key in index["tensors"]:
        if key.startswith("optim/"):
            owner, _, state = key.removeprefix("optim/").rpartition("/")
            out.setdefault(owner.partition("#")[0], {}).setdefault(state, []).append(key)
    return out


def build_index(state: TrainState, gathered: list[Any]) -> dict[str, Any]:
    """The index from every rank's ``(file, entries, python RNG state, digest)``."""
    layout = state.grid.layout
    tensors: dict[str, Any] = {}
    for filename, entries, _, _ in gathered:
        for key, e in entries.items():
            slot = tensors.setdefault(key, {"shape": e["shape"], "dtype": e["dtype"],
                                            "whole": e["whole"], "shards": []})
            slot["shards"].append({"file": filename, "key": key, "offsets": e["offsets"]})
    model_cfg = getattr(state.model, "config", None)
    if hasattr(model_cfg, "to_dict"):
        model_cfg = model_cfg.to_dict()
    elif model_cfg is not None and hasattr(model_cfg, "__dataclass_fields__"):
        model_cfg = dict(model_cfg.__dict__)
    opt_groups = [{k: v for k, v in g.items() if k != "params"}
                  for g in state.optimizer.param_groups]
    # A peft model's adapter configs (a LoRA run's r, alpha, targets): export-hf rebuilds
    # the wrapper from them to merge the adapters or write them as peft's directory.
    adapters = getattr(state.model, "peft_config", None)
    return {
        "format": "paraxis-checkpoint",
        "format_version": FORMAT_VERSION,
        "versions": {"paraxis": __version__, "torch": torch.__version__,
                     "python": platform.python_version()},
        "parallel_config": state.config.model_dump(mode="json"),
        "model_config": json.loads(json.dumps(model_cfg, default=str)),
        "peft_config": {name: json.loads(json.dumps(c.to_dict(), default=_listed))
                        for name, c in adapters.items()} if isinstance(adapters, dict) else None,
        "grid": {"degrees": layout.degrees, "world_size": layout.size,
                 "coords": [layout.coords(r) for r in range(layout.size)]},
        "step": state.step,
        "data": state.data_state,
        "scheduler": state.scheduler.state_dict() if state.scheduler else None,
        "loss_scaler": _state_of(getattr(state, "loss_scaler", None)),
        "optimizer": {"param_groups": opt_groups},
        "python_rng": [list(map(_jsonable, rng)) for _, _, rng, _ in gathered],
        "files": {filename: digest for filename, _, _, digest in gathered},
        "tensors": tensors,
    }


def _listed(obj: Any) -> Any:
    """JSON for what ``json`` cannot write: a set (peft's target modules) as a sorted list."""
    return sorted(obj) if isinstance(obj, (set, frozenset)) else str(obj)


def _state_of(obj: Any) -> Any:
    return obj.state_dict() if obj is not None else None


def _jsonable(x: Any) -> Any:
    return [_jsonable(v) for v in x] if isinstance(x, tuple) else x


def resolve(directory: str | os.PathLike[str]) -> Path:
    """A step directory: ``directory`` itself, or what its ``latest`` names (a save of
    the same step killed between its two renames left it as ``.old-step-N``)."""
    root = Path(directory)
    if (root / "index.json").exists():
        return root
    latest = root / "latest"
    if not latest.exists():
        raise CheckpointError(f"no checkpoint in {root}: neither index.json nor latest")
    name = latest.read_text().strip()
    if not is_plain_name(name):  # never a directory outside ``root``
        raise CheckpointError(f"{latest} names {name!r}, not a step directory beside it: "
                              "refused; write the step's directory name into it")
    step = root / name
    if not step.exists() and (root / f".old-{step.name}").exists():
        return root / f".old-{step.name}"
    return step
