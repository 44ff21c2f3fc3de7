"""A packed dimension read across layouts: a fused tensor (gate and up blocks of one
projection) that one layout splits is saved as one logical tensor per block
(``<name>#partK``, :meth:`paraxis.parallel.placement.Placement.pieces`), while a layout
that holds it whole saves ``<name>``. Either is read by the other: a block is a range of
the whole tensor along the packed dimension, and a range of the whole tensor is the
concatenation of the blocks' ranges it crosses. (paraxis-tp's ``packed_colwise`` and
paraxis-moe-ep's expert tensor split write the blocks.)"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from paraxis.parallel.placement import Placement

__all__ = ["has_repacked", "read_repacked"]

Read = Callable[[str, list[list[int]]], torch.Tensor]


def _saved_parts(tensors: dict[str, Any], key: Callable[[str], str]) -> list[str]:
    found: list[str] = []
    while key(f"#part{len(found)}") in tensors:
        found.append(key(f"#part{len(found)}"))
    return found


def has_repacked(tensors: dict[str, Any], rec: Placement, prefix: str, part: str) -> bool:
    """Whether the checkpoint holds ``rec``'s tensor in the other packing than ``part``."""
    if part:
        entry = tensors.get(f"{prefix}{rec.name}")
        return entry is not None and list(entry["shape"]) == list(rec.global_shape)
    return f"{prefix}{rec.name}#part0" in tensors


def read_repacked(read: Read, tensors: dict[str, Any], rec: Placement, prefix: str,
                  part: str, suffix: str, region: list[list[int]]) -> torch.Tensor | None:
    """``region`` of logical tensor ``<prefix><rec.name><part><suffix>`` from the other
    packing; None when the checkpoint holds neither."""
    def key(p: str) -> str:
        return f"{prefix}{rec.name}{p}{suffix}"

    if part:  # this layout splits the packed dimension; the checkpoint holds it whole
        if key("") not in tensors:
            return None
        dim, parts = next((d, n) for d in range(len(rec.global_shape))
                          if (n := rec.runs(d)[1]) > 1)
        shifted = [list(r) for r in region]
        shifted[dim][0] += int(part.removeprefix("#part")) * (rec.global_shape[dim] // parts)
        return read(key(""), shifted)
    keys = _saved_parts(tensors, key)
    if not keys:
        return None
    shape = tensors[keys[0]]["shape"]
    dim = next(d for d, (a, b) in enumerate(zip(shape, rec.global_shape, strict=True))
               if a != b)
    block, (lo, n) = shape[dim], region[dim]
    out = []
    for k, block_key in enumerate(keys):
        a, b = max(lo, k * block), min(lo + n, (k + 1) * block)
        if a < b:
            sub = [list(r) for r in region]
            sub[dim] = [a - k * block, b - a]
            out.append(read(block_key, sub))
    return torch.cat(out, dim)
