"""Reading a checkpoint onto any grid.

Loading computes, for each local tensor, the region it needs from its placement and
reads only the overlapping parts of the shards (:class:`Reader`), so a checkpoint saved
on one grid restores on another. Every file is checked before it is trusted
(:mod:`paraxis.checkpoint.files`).
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import torch

from paraxis.checkpoint.buffers import check_buffers, load_buffers
from paraxis.checkpoint.files import CheckedFiles, CheckpointError, read_index
from paraxis.checkpoint.format import optimizer_keys, optimizer_params, pieces, resolve
from paraxis.checkpoint.packed import has_repacked, read_repacked
from paraxis.checkpoint.state import Restored, TrainState
from paraxis.parallel.placement import Placement, placement_of
from paraxis.runtime.agreement import agreed

__all__ = ["Reader", "check_model", "load_checkpoint", "read_model_tensors"]


class Reader:
    """Regions of a checkpoint's tensors, assembled from whichever shards hold them."""

    def __init__(self, ckpt: Path, index: dict[str, Any], *, verify: bool = True):
        self.ckpt, self.index = ckpt, index
        self.files = CheckedFiles(ckpt, index, verify=verify)

    def read(self, key: str, region: list[list[int]] | None = None) -> torch.Tensor:
        """The part ``region`` ([offset, length] per dim) of tensor ``key``, assembled
        from whichever shards overlap it."""
        entry = self.index["tensors"][key]
        if region is None or entry["shape"] == [-1]:
            (shard,) = entry["shards"][:1]
            return self.files.tensor(shard["file"], shard["key"])
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
                piece = self.files.slice(shard["file"], shard["key"], tuple(src))
                out[tuple(dst)] = piece
                covered += piece.numel()
        if covered < out.numel():
            raise ValueError(f"checkpoint shards cover {covered} of {out.numel()} elements "
                             f"of {key} region {region}")
        return out

    def read_into(self, value: torch.Tensor, rec: Placement, prefix: str,
                  suffix: str = "") -> None:
        """Fill ``value`` (laid out as ``rec``) from ``<prefix><name>[#partK]<suffix>``,
        or from the tensor in the other packing (:mod:`paraxis.checkpoint.packed`)."""
        tensors = self.index["tensors"]
        for part, view, _, region in pieces(value, rec):
            key = f"{prefix}{rec.name}{part}{suffix}"
            got = self.read(key, region) if key in tensors else read_repacked(
                self.read, tensors, rec, prefix, part, suffix, region)
            if got is None:
                raise CheckpointError(f"{self.ckpt} holds no {key}")
            view.copy_(got)


def _optimizer_state(reader: Reader, keys: dict[str, list[str]], param: torch.Tensor,
                     rec: Placement) -> dict[str, torch.Tensor]:
    """Optimizer state of one parameter: tensors laid out like it are assembled from their
    shards and pieces; the others (AdamW's step) are read whole."""
    state: dict[str, torch.Tensor] = {}
    for name, state_keys in keys.items():
        if reader.index["tensors"][state_keys[0]]["whole"]:
            state[name] = reader.read(state_keys[0]).to(param.device)
            continue
        full = torch.zeros_like(param)
        reader.read_into(full, rec, "optim/", f"/{name}")
        state[name] = full
    return state


def check_model(index: dict[str, Any], model: torch.nn.Module, ckpt: Path) -> None:
    """Every parameter of ``model`` is in the checkpoint, with its global shape; so is
    every persistent buffer (:func:`paraxis.checkpoint.buffers.check_buffers`)."""
    wrong = []
    for param in model.parameters():
        rec = placement_of(param)
        for piece in rec.pieces():  # the placement alone: the parameter may be
            suffix, shape = piece.suffix, list(piece.shape)  # partitioned elsewhere
            entry = index["tensors"].get(f"model/{rec.name}{suffix}")
            if entry is None and has_repacked(index["tensors"], rec, "model/", suffix):
                continue
            if entry is None:
                wrong.append(f"{rec.name}{suffix} is missing")
            elif list(entry["shape"]) != list(shape):
                wrong.append(f"{rec.name}{suffix} has global shape {entry['shape']}, the "
                             f"model's is {list(shape)}")
    wrong += check_buffers(index, model, ckpt)
    if wrong:
        raise CheckpointError(
            f"{ckpt} was saved from another model: {'; '.join(wrong[:4])}"
            f"{f' (and {len(wrong) - 4} more)' if len(wrong) > 4 else ''}")


@torch.no_grad()
def load_checkpoint(state: TrainState, directory: str | os.PathLike[str], *,
                    verify: bool = True) -> Restored:
    """Restore model (parameters and persistent buffers), optimizer, scheduler and (same
    grid) RNG into ``state``; return the step and data position for the run to take over.
    ``verify`` checks the SHA-256 of what is read before reading it (of each block
    read, or of each whole file for a checkpoint older than format 4; sizes are always
    checked).
    Collective; an error one rank meets (a file only it reads is damaged) is raised on
    every rank with its message (:func:`paraxis.runtime.agreement.agreed`)."""
    with agreed(state.grid.world, "loading the checkpoint", known=(CheckpointError,)):
        restored = _restore(state, directory, verify)
    return restored


def _restore(state: TrainState, directory: str | os.PathLike[str], verify: bool
             ) -> Restored:
    """:func:`load_checkpoint` on this rank, the status exchange aside."""
    ckpt = resolve(directory)
    index = read_index(ckpt)
    check_model(index, state.model, ckpt)
    reader = Reader(ckpt, index, verify=verify)
    _load_weights_and_state(state, reader)
    load_buffers(reader, state.model)
    for group, saved in zip(state.optimizer.param_groups,
                            index["optimizer"]["param_groups"], strict=True):
        group.update({k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()})
    if state.scheduler is not None and index["scheduler"] is not None:
        state.scheduler.load_state_dict(index["scheduler"])
    scaler = getattr(state, "loss_scaler", None)  # fp16's loss scale, when both have one
    if scaler is not None and index.get("loss_scaler") is not None:
        scaler.load_state_dict(index["loss_scaler"])
    if index["grid"]["degrees"] == state.grid.layout.degrees:
        _load_rng(state, reader)  # RNG streams belong to ranks; elsewhere they mean nothing
    return Restored(step=int(index["step"]), data_state=dict(index["data"]))


def _load_weights_and_state(state: TrainState, reader: Reader) -> None:
    keys = optimizer_keys(reader.index)
    give = getattr(state.optimizer, "load_checkpoint_state", None)
    for param in state.model.parameters():
        rec = placement_of(param)
        # An optimizer that holds the weights (DeepSpeed's partitions) takes them whole.
        value = param if give is None else torch.zeros(rec.local_shape, dtype=rec.dtype)
        reader.read_into(value, rec, "model/")
        if give is not None:
            give(param, value, _optimizer_state(reader, keys.get(rec.name, {}), value, rec))
    # State follows the optimizer's own parameters (the model's, or ZeRO's shards).
    for param in optimizer_params(state.optimizer) if give is None else ():
        rec = placement_of(param)
        opt_state = _optimizer_state(reader, keys.get(rec.name, {}), param, rec)
        if opt_state:
            state.optimizer.state[param] = opt_state


def _load_rng(state: TrainState, reader: Reader) -> None:
    rank, index = state.grid.rank, reader.index
    torch.set_rng_state(reader.read(f"rng/rank{rank}/torch"))
    if torch.cuda.is_available() and f"rng/rank{rank}/cuda" in index["tensors"]:
        torch.cuda.set_rng_state(reader.read(f"rng/rank{rank}/cuda"))
    for name, stream in state.rng_streams.items():
        stream.set_state(reader.read(f"rng/rank{rank}/{name}"))
    version, internal, gauss = index["python_rng"][rank]
    random.setstate((version, tuple(internal), gauss))


def read_model_tensors(directory: str | os.PathLike[str], *, verify: bool = True,
                       ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The index and every model tensor of a checkpoint, whole, assembled from its shards
    on whatever grid wrote it (one process, no process group). Keys are the global
    parameter names; a packed dimension's blocks keep their ``#partK`` suffix (the
    caller knows along which dimension they go). Parameters only: the ``buffer/``
    tensors are left out. For exporters (paraxis-hf's ``paraxis checkpoint export-hf``)."""
    ckpt = resolve(directory)
    index = read_index(ckpt)
    reader = Reader(ckpt, index, verify=verify)
    out = {}
    for key, entry in index["tensors"].items():
        if key.startswith("model/"):
            out[key.removeprefix("model/")] = reader.read(
                key, [[0, n] for n in entry["shape"]])
    return index, out
