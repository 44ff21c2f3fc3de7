"""Writing a checkpoint, in stages the synchronous and the background save share.

1. :func:`begin_save` (collective): the step's name and a fresh temporary directory;
2. :func:`snapshot`: host copies of what this rank writes and their index entries;
3. :func:`gather_entries` (collective): every rank's entries, for the index;
4. write this rank's safetensors file (:func:`write_rank_file`), then on rank 0
   :func:`publish`: the index, the rename into place, then ``latest``.

Writes are atomic: a process killed at any point leaves the previous checkpoint
loadable and ``latest`` naming a complete one. Every file's size and SHA-256 are in the
index and are checked before a file is trusted (:mod:`paraxis.checkpoint.files`).

An optimizer that keeps the weights and their state itself, partitioned its own way
(the DeepSpeed bridge), implements ``checkpoint_state(param)`` (collective: the value
and optimizer state laid out as the parameter's placement says, or None where this rank
does not write them) and ``load_checkpoint_state(param, value, state)``: same format.
"""

from __future__ import annotations

import bisect
import json
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from paraxis.checkpoint.buffers import PREFIX, buffers_to_write
from paraxis.checkpoint.files import file_digest
from paraxis.checkpoint.format import (
    build_index,
    is_owner,
    optimizer_params,
    pieces,
    rng_states,
)
from paraxis.checkpoint.state import TrainState
from paraxis.parallel.placement import Placement, placement_of
from paraxis.runtime.collectives import all_gather_object, barrier

__all__ = ["SaveTarget", "Snapshot", "begin_save", "gather_entries", "publish",
           "save_checkpoint", "snapshot", "write_atomically", "write_rank_file"]


@dataclass(frozen=True)
class SaveTarget:
    """Where one save goes: ``root/name`` once published, ``tmp`` until then."""

    root: Path
    name: str
    tmp: Path
    filename: str  # this rank's safetensors file

    @property
    def final(self) -> Path:
        return self.root / self.name


@dataclass
class Snapshot:
    """Host copies of the tensors this rank writes, and their index entries."""

    tensors: dict[str, torch.Tensor]
    entries: dict[str, Any]


def begin_save(state: TrainState, directory: str | os.PathLike[str]) -> SaveTarget:
    """The step's name and a fresh temporary directory. Collective."""
    root = Path(directory)
    name = f"step-{state.step:08d}"
    tmp = root / f".tmp-{name}"
    if state.grid.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier(state.grid.world)
    return SaveTarget(root, name, tmp, f"rank{state.grid.rank:05d}.safetensors")


def snapshot(state: TrainState, *, copy: bool = True) -> Snapshot:
    """What this rank writes, copied to host memory, with its index entries.

    ``copy`` False (the synchronous save: nothing changes the tensors until it is
    written) keeps a host tensor that is contiguous as it is, unless it overlaps one
    already kept (safetensors refuses overlapping tensors): on a CPU run the copy
    doubled the model state for the length of the save, the run's peak memory under
    ZeRO-3 (issue 36, item 5)."""
    out = Snapshot({}, {})
    kept = _Ranges()

    def put(key: str, t: torch.Tensor, shape: list[int], offsets: list[list[int]],
            whole: bool = False) -> None:
        t = t.detach()
        as_is = not copy and t.device.type == "cpu" and t.is_contiguous() \
            and kept.add(t.data_ptr(), t.numel() * t.element_size())
        out.tensors[key] = t if as_is else t.to(
            "cpu", copy=True, memory_format=torch.contiguous_format)
        out.entries[key] = {"shape": shape, "dtype": str(t.dtype).removeprefix("torch."),
                            "offsets": offsets, "whole": whole}

    weights, states = _to_write(state)
    for rec, value in weights:
        for suffix, view, shape, region in pieces(value, rec):
            put(f"model/{rec.name}{suffix}", view, shape, region)
    for rec, value, opt_state in states:
        for k, v in opt_state.items():
            if isinstance(v, torch.Tensor) and tuple(v.shape) == tuple(value.shape):
                for suffix, view, shape, region in pieces(v, rec):
                    put(f"optim/{rec.name}{suffix}/{k}", view, shape, region)
            elif isinstance(v, torch.Tensor):
                # Not laid out like the parameter (AdamW's step): stored whole.
                put(f"optim/{rec.name}/{k}", v, list(v.shape), [[0, n] for n in v.shape],
                    whole=True)
    for rec, buf in buffers_to_write(state.model, state.grid.coords):
        for suffix, view, shape, region in pieces(buf, rec):
            put(f"{PREFIX}{rec.name}{suffix}", view, shape, region)
    rank = state.grid.rank
    for name, rng in rng_states(state).items():
        put(f"rng/rank{rank}/{name}", rng, [-1], [])
    return out


class _Ranges:
    """Byte ranges of the tensors a snapshot keeps without copying."""

    def __init__(self) -> None:
        self.spans: list[tuple[int, int]] = []  # (start, end), sorted

    def add(self, start: int, length: int) -> bool:
        """Keep ``[start, start + length)`` unless it overlaps a kept range."""
        i = bisect.bisect(self.spans, (start, start + length))
        if (i and self.spans[i - 1][1] > start) or \
                (i < len(self.spans) and self.spans[i][0] < start + length):
            return False
        self.spans.insert(i, (start, start + length))
        return True


def _to_write(state: TrainState) -> tuple[list[tuple[Placement, torch.Tensor]],
                                          list[tuple[Placement, torch.Tensor, dict[str, Any]]]]:
    """The weights and the optimizer states this rank writes, each with its placement.

    Weights are the model's parameters this rank owns. State follows the optimizer's own
    parameters: the model's, or the shards a ZeRO optimizer steps. An optimizer that
    holds the weights itself (the DeepSpeed bridge) decides who writes what."""
    held = getattr(state.optimizer, "checkpoint_state", None)
    if held is not None:
        weights, states = [], []
        for param in state.model.parameters():
            got = held(param)  # collective: every rank asks for every parameter
            if got is not None:
                rec = placement_of(param)
                weights.append((rec, got[0]))
                states.append((rec, got[0], got[1]))
        return weights, states
    coords = state.grid.coords
    weights = [(placement_of(p), p) for p in state.model.parameters()
               if is_owner(placement_of(p), coords)]
    states = [(placement_of(p), p, state.optimizer.state.get(p, {}))
              for p in optimizer_params(state.optimizer) if is_owner(placement_of(p), coords)]
    return weights, states


def gather_entries(state: TrainState, target: SaveTarget, snap: Snapshot,
                   digest: dict[str, Any] | None) -> list[Any]:
    """Every rank's (file, entries, Python RNG state, digest or None). Collective."""
    return all_gather_object((target.filename, snap.entries, random.getstate(), digest),
                             state.grid.world)


def write_rank_file(target: SaveTarget, snap: Snapshot) -> dict[str, Any]:
    """This rank's safetensors file in the temporary directory; its size and SHA-256."""
    path = target.tmp / target.filename
    save_file(snap.tensors, str(path))
    return file_digest(path)


def publish(target: SaveTarget, index: dict[str, Any]) -> None:
    """Rank 0: the index, the rename into place, then ``latest``. A step saved again
    replaces the old copy by renames only, so no moment leaves ``latest`` naming a
    half-deleted directory."""
    write_atomically(target.tmp / "index.json", json.dumps(index, indent=1))
    final = target.final
    if final.exists():
        old = final.with_name(f".old-{final.name}")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(target.tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(target.tmp, final)
    write_atomically(target.root / "latest", target.name + "\n")


def write_atomically(path: Path, text: str) -> None:
    """Write a small file so that readers see the old or the new content, never half."""
    part = path.with_name(f".{path.name}.part")
    with open(part, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, path)


def save_checkpoint(state: TrainState, directory: str | os.PathLike[str]) -> str:
    """Write ``directory/step-NNNNNNNN`` and point ``directory/latest`` at it.
    Collective: every rank calls it."""
    target = begin_save(state, directory)
    snap = snapshot(state, copy=False)
    digest = write_rank_file(target, snap)
    gathered = gather_entries(state, target, snap, digest)
    if state.grid.rank == 0:
        publish(target, build_index(state, gathered))
    barrier(state.grid.world)
    return str(target.final)
