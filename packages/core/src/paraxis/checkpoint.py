"""Checkpoints that encode the grid (DESIGN section 6).

A checkpoint is a directory ``step-NNNNNNNN/`` holding ``index.json`` and one
safetensors file per rank; a ``latest`` file beside it names the newest. No pickle.

The index records format and software versions, the parallel and model configs, the
grid (degrees and every rank's coordinates), the step, the data position, scheduler
and optimizer hyper-parameters, Python RNG states, and for every tensor its global
name, shape, dtype and the file, key and offsets of each shard. Each distinct shard is
written once, by the replica whose coordinates on the replicated axes are all zero.
Loading computes, for each local tensor, the region it needs from its placement and
reads only the overlapping parts of the shards, so a checkpoint saved on one grid can
restore on another.

An optimizer that keeps the weights and their state itself, partitioned its own way
(the DeepSpeed bridge), implements ``checkpoint_state(param)`` (collective: the value
and optimizer state laid out as the parameter's placement says, or None where this rank
does not write them) and ``load_checkpoint_state(param, value, state)``: same format.

Writes are atomic: every rank writes into a temporary directory, rank 0 writes the
index, renames the directory, then replaces ``latest``; a process killed at any point
leaves the previous checkpoint loadable and ``latest`` naming a complete one. Every
file's size and SHA-256 are in the index and are checked before a file is trusted
(:mod:`paraxis.checkpoint_files`).
"""

from __future__ import annotations

import json
import os
import platform
import random
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file

from paraxis.checkpoint_files import (
    FORMAT_VERSION,
    CheckedFiles,
    CheckpointError,
    file_digest,
    read_index,
)
from paraxis.collectives import all_gather_object, barrier
from paraxis.placement import Placement, placement_of

if TYPE_CHECKING:
    from paraxis.engine import Engine

__all__ = ["FORMAT_VERSION", "CheckpointError", "load_checkpoint", "read_model_tensors",
           "resolve", "save_checkpoint"]


def _pieces(t: torch.Tensor, p: Placement) -> list[tuple[str, torch.Tensor, list[int],
                                                           list[list[int]]]]:
    """(key suffix, local view, global shape, [offset, length] per dim) of each logical
    tensor block that ``t`` (laid out as ``p``) holds: one, one per block of a packed
    dim, or none for a shard of padding only. Nested shards (a data shard of a tensor
    shard, :class:`paraxis.placement.Shard`) map to their global rows; padding rows are
    cut off, so they are neither saved nor loaded."""
    return [(piece.suffix, t[piece.local], list(piece.shape), [list(r) for r in piece.region])
            for piece in p.pieces()]


def _owner(p: Placement, coords: dict[str, int]) -> bool:
    return not p.mirror and all(coords[a] == 0 for a in p.replicated)


def _local_entries(engine: Engine) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The tensors this rank writes and their index entries."""
    tensors: dict[str, torch.Tensor] = {}
    entries: dict[str, Any] = {}

    def put(key: str, t: torch.Tensor, shape: list[int], offsets: list[list[int]],
            whole: bool = False) -> None:
        tensors[key] = t.detach().to("cpu", copy=True).contiguous()
        entries[key] = {"shape": shape, "dtype": str(t.dtype).removeprefix("torch."),
                        "offsets": offsets, "whole": whole}

    weights, states = _to_write(engine)
    for rec, value in weights:
        for suffix, view, shape, region in _pieces(value, rec):
            put(f"model/{rec.name}{suffix}", view, shape, region)
    for rec, value, state in states:
        for k, v in state.items():
            if isinstance(v, torch.Tensor) and tuple(v.shape) == tuple(value.shape):
                for suffix, view, shape, region in _pieces(v, rec):
                    put(f"optim/{rec.name}{suffix}/{k}", view, shape, region)
            elif isinstance(v, torch.Tensor):
                # Not laid out like the parameter (AdamW's step): stored whole.
                put(f"optim/{rec.name}/{k}", v, list(v.shape), [[0, n] for n in v.shape],
                    whole=True)
    rank = engine.grid.rank
    for name, state in _rng_states(engine).items():
        put(f"rng/rank{rank}/{name}", state, [-1], [])
    return tensors, entries


def _to_write(engine: Engine) -> tuple[list[tuple[Placement, torch.Tensor]],
                                       list[tuple[Placement, torch.Tensor, dict[str, Any]]]]:
    """The weights and the optimizer states this rank writes, each with its placement.

    Weights are the model's parameters this rank owns. State follows the optimizer's own
    parameters: the model's, or the shards a ZeRO optimizer steps. An optimizer that
    holds the weights itself (the DeepSpeed bridge) decides who writes what."""
    held = getattr(engine.optimizer, "checkpoint_state", None)
    if held is not None:
        weights, states = [], []
        for param in engine.model.parameters():
            got = held(param)  # collective: every rank asks for every parameter
            if got is not None:
                rec = placement_of(param)
                weights.append((rec, got[0]))
                states.append((rec, got[0], got[1]))
        return weights, states
    coords = engine.grid.coords
    weights = [(placement_of(p), p) for p in engine.model.parameters()
               if _owner(placement_of(p), coords)]
    states = [(placement_of(p), p, engine.optimizer.state.get(p, {}))
              for p in _optimizer_params(engine.optimizer) if _owner(placement_of(p), coords)]
    return weights, states


def _optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            seen.setdefault(id(p), p)
    return list(seen.values())


def _rng_states(engine: Engine) -> dict[str, torch.Tensor]:
    states = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state()
    for name, stream in engine.ctx.rng_streams.items():
        states[name] = stream.get_state()
    return states


def save_checkpoint(engine: Engine, directory: str | os.PathLike[str]) -> str:
    """Write ``directory/step-NNNNNNNN`` and point ``directory/latest`` at it.
    Collective: every rank calls it."""
    root, name, tmp, filename = _begin_save(engine, directory)
    rank = engine.grid.rank
    tensors, entries = _local_entries(engine)
    save_file(tensors, str(tmp / filename))
    digest = file_digest(tmp / filename)
    gathered = all_gather_object((filename, entries, random.getstate(), digest),
                                 engine.grid.world)
    if rank == 0:
        index = _index(engine, gathered)
        _write_atomically(tmp / "index.json", json.dumps(index, indent=1))
        _publish(tmp, root / name)
        _write_atomically(root / "latest", name + "\n")
    barrier(engine.grid.world)
    return str(root / name)


def _begin_save(engine: Engine, directory: str | os.PathLike[str],
                ) -> tuple[Path, str, Path, str]:
    """Root, step name, fresh temporary directory and this rank's file. Collective."""
    root = Path(directory)
    name = f"step-{engine.step:08d}"
    tmp = root / f".tmp-{name}"
    if engine.grid.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier(engine.grid.world)
    return root, name, tmp, f"rank{engine.grid.rank:05d}.safetensors"


def _write_atomically(path: Path, text: str) -> None:
    """Write a small file so that readers see the old or the new content, never half."""
    part = path.with_name(f".{path.name}.part")
    with open(part, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, path)


def _publish(tmp: Path, final: Path) -> None:
    """Rename a finished save into place. A step saved again replaces the old copy by
    renames only, so no moment leaves ``latest`` naming a half-deleted directory."""
    if final.exists():
        old = final.with_name(f".old-{final.name}")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)


def _index(engine: Engine, gathered: list[Any]) -> dict[str, Any]:
    layout = engine.grid.layout
    tensors: dict[str, Any] = {}
    for filename, entries, _, _ in gathered:
        for key, e in entries.items():
            slot = tensors.setdefault(key, {"shape": e["shape"], "dtype": e["dtype"],
                                            "whole": e["whole"], "shards": []})
            slot["shards"].append({"file": filename, "key": key, "offsets": e["offsets"]})
    model_cfg = getattr(engine.model, "config", None)
    if hasattr(model_cfg, "to_dict"):
        model_cfg = model_cfg.to_dict()
    elif model_cfg is not None and hasattr(model_cfg, "__dataclass_fields__"):
        model_cfg = dict(model_cfg.__dict__)
    opt_groups = [{k: v for k, v in g.items() if k != "params"}
                  for g in engine.optimizer.param_groups]
    return {
        "format": "paraxis-checkpoint",
        "format_version": FORMAT_VERSION,
        "versions": {"paraxis": _version(), "torch": torch.__version__,
                     "python": platform.python_version()},
        "parallel_config": engine.config.model_dump(mode="json"),
        "model_config": json.loads(json.dumps(model_cfg, default=str)),
        "grid": {"degrees": layout.degrees, "world_size": layout.size,
                 "coords": [layout.coords(r) for r in range(layout.size)]},
        "step": engine.step,
        "data": engine.data_state,
        "scheduler": engine.scheduler.state_dict() if engine.scheduler else None,
        "optimizer": {"param_groups": opt_groups},
        "python_rng": [list(map(_jsonable, state)) for _, _, state, _ in gathered],
        "files": {filename: digest for filename, _, _, digest in gathered},
        "tensors": tensors,
    }


def _jsonable(x: Any) -> Any:
    return [_jsonable(v) for v in x] if isinstance(x, tuple) else x


def _version() -> str:
    from paraxis import __version__

    return __version__


def resolve(directory: str | os.PathLike[str]) -> Path:
    """A step directory: ``directory`` itself, or what its ``latest`` names (a save of
    the same step killed between its two renames left it as ``.old-step-N``)."""
    root = Path(directory)
    if (root / "index.json").exists():
        return root
    latest = root / "latest"
    if not latest.exists():
        raise CheckpointError(f"no checkpoint in {root}: neither index.json nor latest")
    step = root / latest.read_text().strip()
    if not step.exists() and (root / f".old-{step.name}").exists():
        return root / f".old-{step.name}"
    return step


class _Reader:
    def __init__(self, ckpt: Path, index: dict[str, Any], *, verify: bool = True):
        self.ckpt, self.index = ckpt, index
        self.files = CheckedFiles(ckpt, index, verify=verify)

    def _file(self, name: str) -> Any:
        return self.files.open(name)

    def read(self, key: str, region: list[list[int]] | None = None) -> torch.Tensor:
        """The part ``region`` ([offset, length] per dim) of tensor ``key``, assembled
        from whichever shards overlap it."""
        entry = self.index["tensors"][key]
        if region is None or entry["shape"] == [-1]:
            (shard,) = entry["shards"][:1]
            return self._file(shard["file"]).get_tensor(shard["key"])
        out = torch.empty([n for _, n in region], dtype=getattr(torch, entry["dtype"]))
        covered = 0
        for shard in entry["shards"]:
            src, dst, ok = [], [], True
            for (lo, n), (so, sn) in zip(region, shard["offsets"], strict=True):
                a, b = max(lo, so), min(lo + n, so + sn)
                if a >= b:
                    ok = False
                    break
                src.append(slice(a - so, b - so))
                dst.append(slice(a - lo, b - lo))
            if ok:
                piece = self._file(shard["file"]).get_slice(shard["key"])[tuple(src)]
                out[tuple(dst)] = piece
                covered += piece.numel()
        if covered < out.numel():
            raise ValueError(f"checkpoint shards cover {covered} of {out.numel()} elements "
                             f"of {key} region {region}")
        return out


def _optimizer_keys(index: dict[str, Any]) -> dict[str, dict[str, list[str]]]:
    """parameter name -> state name -> its keys (``optim/<param>[#partK]/<state>``)."""
    out: dict[str, dict[str, list[str]]] = {}
    for key in index["tensors"]:
        if key.startswith("optim/"):
            owner, _, state = key.removeprefix("optim/").rpartition("/")
            out.setdefault(owner.partition("#")[0], {}).setdefault(state, []).append(key)
    return out


def _load_optimizer_state(reader: _Reader, keys: dict[str, list[str]], param: torch.Tensor,
                          rec: Placement) -> dict[str, torch.Tensor]:
    """Optimizer state of one parameter: tensors laid out like it are assembled from their
    shards and pieces; the others (AdamW's step) are read whole."""
    state: dict[str, torch.Tensor] = {}
    for name, state_keys in keys.items():
        if reader.index["tensors"][state_keys[0]]["whole"]:
            state[name] = reader.read(state_keys[0]).to(param.device)
            continue
        full = torch.zeros_like(param)
        for suffix, view, _, region in _pieces(full, rec):
            view.copy_(reader.read(f"optim/{rec.name}{suffix}/{name}", region))
        state[name] = full
    return state


def _check_model(index: dict[str, Any], engine: Engine, ckpt: Path) -> None:
    """Every parameter of the model is in the checkpoint, with its global shape."""
    wrong = []
    for param in engine.model.parameters():
        rec = placement_of(param)
        for piece in rec.pieces():  # the placement alone: the parameter may be
            suffix, shape = piece.suffix, list(piece.shape)  # partitioned elsewhere
            entry = index["tensors"].get(f"model/{rec.name}{suffix}")
            if entry is None:
                wrong.append(f"{rec.name}{suffix} is missing")
            elif list(entry["shape"]) != list(shape):
                wrong.append(f"{rec.name}{suffix} has global shape {entry['shape']}, the "
                             f"model's is {list(shape)}")
    if wrong:
        raise CheckpointError(
            f"{ckpt} was saved from another model: {'; '.join(wrong[:4])}"
            f"{f' (and {len(wrong) - 4} more)' if len(wrong) > 4 else ''}")


@torch.no_grad()
def load_checkpoint(engine: Engine, directory: str | os.PathLike[str], *,
                    verify: bool = True) -> None:
    """Restore model, optimizer, scheduler, step, data position and (same grid) RNG.
    ``verify`` checks each file's SHA-256 before reading it (sizes are always checked)."""
    ckpt = resolve(directory)
    index = read_index(ckpt)
    _check_model(index, engine, ckpt)
    reader = _Reader(ckpt, index, verify=verify)
    optimizer_keys = _optimizer_keys(index)
    give = getattr(engine.optimizer, "load_checkpoint_state", None)
    for param in engine.model.parameters():
        rec = placement_of(param)
        # An optimizer that holds the weights (DeepSpeed's partitions) takes them whole.
        value = param if give is None else torch.zeros(rec.local_shape, dtype=rec.dtype)
        for suffix, view, _, region in _pieces(value, rec):
            view.copy_(reader.read(f"model/{rec.name}{suffix}", region))
        if give is not None:
            give(param, value, _load_optimizer_state(
                reader, optimizer_keys.get(rec.name, {}), value, rec))
    # State follows the optimizer's own parameters (the model's, or ZeRO's shards).
    for param in _optimizer_params(engine.optimizer) if give is None else ():
        rec = placement_of(param)
        state = _load_optimizer_state(reader, optimizer_keys.get(rec.name, {}), param, rec)
        if state:
            engine.optimizer.state[param] = state
    for group, saved in zip(engine.optimizer.param_groups,
                            index["optimizer"]["param_groups"], strict=True):
        group.update({k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()})
    if engine.scheduler is not None and index["scheduler"] is not None:
        engine.scheduler.load_state_dict(index["scheduler"])
    engine.step = int(index["step"])
    engine.data_state = dict(index["data"])
    same_grid = index["grid"]["degrees"] == engine.grid.layout.degrees
    if same_grid:  # RNG streams belong to ranks; on another grid they mean nothing
        rank = engine.grid.rank
        torch.set_rng_state(reader.read(f"rng/rank{rank}/torch"))
        if torch.cuda.is_available() and f"rng/rank{rank}/cuda" in index["tensors"]:
            torch.cuda.set_rng_state(reader.read(f"rng/rank{rank}/cuda"))
        for name, stream in engine.ctx.rng_streams.items():
            stream.set_state(reader.read(f"rng/rank{rank}/{name}"))
        version, internal, gauss = index["python_rng"][rank]
        random.setstate((version, tuple(internal), gauss))
    barrier(engine.grid.world)


def read_model_tensors(directory: str | os.PathLike[str], *, verify: bool = True,
                       ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The index and every model tensor of a checkpoint, whole, assembled from its shards
    on whatever grid wrote it (one process, no process group). Keys are the global
    parameter names; a packed dimension's blocks keep their ``#partK`` suffix (the
    caller knows along which dimension they go). For exporters (paraxis-hf's
    ``paraxis checkpoint export-hf``)."""
    ckpt = resolve(directory)
    index = read_index(ckpt)
    reader = _Reader(ckpt, index, verify=verify)
    out = {}
    for key, entry in index["tensors"].items():
        if key.startswith("model/"):
            out[key.removeprefix("model/")] = reader.read(
                key, [[0, n] for n in entry["shape"]])
    return index, out
