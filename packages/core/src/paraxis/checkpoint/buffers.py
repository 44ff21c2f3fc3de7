"""The model's buffers in a checkpoint: every persistent one, by its global name.

Training changes some buffers: DeepSeek-V3's ``e_score_correction_bias`` moves after
every step (auxiliary-loss-free balancing, arXiv:2412.19437 section 2.1.2), BatchNorm
keeps running statistics. A resume that restarted them from the values the model was
built with would train another run than the uninterrupted one, so a checkpoint holds
what ``state_dict`` would: ``named_buffers()`` minus each module's
``_non_persistent_buffers_set``. Buffers a model computes when it is built are
non-persistent (transformers' rotary ``inv_freq``) and are not saved.

Layout: a buffer that carries a placement record (an axis that split it set one) is
saved by its pieces, as a parameter is. Without one it is whole on every rank holding it,
replicated over every axis but the pipeline, and written once per stage holding it by
the rank whose other coordinates are all zero, under ``buffer/<name>``. Stages keep the
model's module names (:func:`paraxis.parallel.stages.build_stage`), so a buffer's local
name is its global name; a module several stages keep (one outside the layers) is
written by each, the copies all being the model's one buffer.

Loading reads each buffer's region as it reads a parameter's, so any grid loads any
grid's buffers. A checkpoint of format 3 or later holds every persistent buffer: one the
model has and the checkpoint lacks, or of another global shape, means another model
(:class:`~paraxis.checkpoint.files.CheckpointError`). Formats 1 and 2 predate buffers:
the model keeps the values it was built with, and a warning names them, since the run
then resumes only approximately (an uninterrupted run would have moved them).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from paraxis.checkpoint.format import is_owner
from paraxis.config.parallel import AXES
from paraxis.parallel.placement import Placement, has_placement, placement_of
from paraxis.parallel.stages import chunks_of

__all__ = ["BUFFERS_SINCE", "PREFIX", "buffers_to_write", "check_buffers", "load_buffers",
           "model_buffers"]

PREFIX = "buffer/"
BUFFERS_SINCE = 3  # the first format version whose checkpoints hold the buffers
_REPLICATED = tuple(a for a in AXES if a != "pipeline")


def model_buffers(model: nn.Module, replicated: tuple[str, ...] = _REPLICATED
                  ) -> dict[str, tuple[Placement, torch.Tensor]]:
    """Every persistent buffer this rank holds, by global name (its record's, else its
    module path), with its placement: replicated over ``replicated`` (every grid axis
    but the pipeline's) unless it has a record of its own."""
    out: dict[str, tuple[Placement, torch.Tensor]] = {}
    for chunk in chunks_of(model):
        for module_name, module in chunk.named_modules():
            for local, buf in module.named_buffers(recurse=False):
                if buf is None or local in module._non_persistent_buffers_set:
                    continue
                rec = _placement(f"{module_name}.{local}" if module_name else local, buf,
                                 replicated)
                out.setdefault(rec.name, (rec, buf))
    return out


def _placement(name: str, buf: torch.Tensor, replicated: tuple[str, ...]) -> Placement:
    if has_placement(buf):
        return placement_of(buf)
    return Placement(name, tuple(buf.shape), buf.dtype, replicated=replicated)


def buffers_to_write(model: nn.Module, coords: dict[str, int]
                     ) -> list[tuple[Placement, torch.Tensor]]:
    """The buffers (and their placements) this rank writes: one rank of each group
    replicating them (every grid axis of ``coords`` but the pipeline's)."""
    replicated = tuple(a for a in coords if a != "pipeline")
    return [(rec, buf) for rec, buf in model_buffers(model, replicated).values()
            if is_owner(rec, coords)]


def check_buffers(index: dict[str, Any], model: nn.Module, ckpt: Path) -> list[str]:
    """The problems of the checkpoint's buffers against ``model``'s: a global shape that
    differs, or (format 3 and later) a buffer missing. Warns, naming them, when an older
    checkpoint lacks buffers the model has."""
    wrong, absent = [], []
    tensors = index["tensors"]
    for name, (rec, _) in model_buffers(model).items():
        for piece in rec.pieces():
            entry = tensors.get(f"{PREFIX}{name}{piece.suffix}")
            if entry is None:
                absent.append(f"{name}{piece.suffix}")
            elif list(entry["shape"]) != list(piece.shape):
                wrong.append(f"buffer {name}{piece.suffix} has global shape "
                             f"{entry['shape']}, the model's is {list(piece.shape)}")
    if absent and index["format_version"] >= BUFFERS_SINCE:
        wrong += [f"buffer {name} is missing" for name in absent]
    elif absent:
        more = f" and {len(absent) - 4} more" if len(absent) > 4 else ""
        warnings.warn(
            f"{ckpt} is format {index['format_version']}, which saved no buffers: "
            f"{', '.join(absent[:4])}{more} keep the values the model was built with, not "
            "the saved run's; the resumed run is not the one that was saved", stacklevel=3)
    return wrong


def load_buffers(reader: Any, model: nn.Module) -> None:
    """Fill every persistent buffer the checkpoint holds (``reader``:
    :class:`paraxis.checkpoint.read.Reader`); one it lacks keeps its value (formats 1
    and 2, see :func:`check_buffers`)."""
    tensors = reader.index["tensors"]
    for name, (rec, buf) in model_buffers(model).items():
        if all(f"{PREFIX}{name}{p.suffix}" in tensors for p in rec.pieces()):
            reader.read_into(buf, rec, PREFIX)
