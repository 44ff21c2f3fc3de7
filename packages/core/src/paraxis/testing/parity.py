"""Helpers for parity tests: gather what ranks hold into full tensors."""

from __future__ import annotations

import torch
from torch import nn

from paraxis.placement import Placement, placement_of

__all__ = ["assemble", "local_shards"]


def local_shards(model: nn.Module) -> dict[str, tuple[torch.Tensor, Placement]]:
    """This rank's parameters with their placements, by global name (picklable)."""
    out = {}
    for p in model.parameters():
        rec = placement_of(p)
        out[rec.name] = (p.detach().clone(), rec)
    return out


def assemble(per_rank: list[dict[str, tuple[torch.Tensor, Placement]]]) -> dict[str, torch.Tensor]:
    """Full tensors from every rank's shards (padding dropped, packed blocks rejoined).
    Asserts that replicas of the same region agree exactly."""
    full: dict[str, torch.Tensor] = {}
    for shards in per_rank:
        for name, (local, rec) in shards.items():
            target = full.setdefault(name, torch.full(rec.global_shape, float("nan"),
                                                      dtype=local.dtype))
            _place(target, local, rec)
    for name, t in full.items():
        assert not torch.isnan(t).any(), f"{name}: some elements were held by no rank"
    return full


def _place(target: torch.Tensor, local: torch.Tensor, rec: Placement) -> None:
    views = [(target, local)]
    for s in rec.shards:
        nxt = []
        for tgt, loc in views:
            loc = loc.narrow(s.dim, 0, s.length * s.parts)
            blocks_t = tgt.chunk(s.parts, dim=s.dim)
            blocks_l = loc.chunk(s.parts, dim=s.dim)
            for bt, bl in zip(blocks_t, blocks_l, strict=True):
                nxt.append((bt.narrow(s.dim, s.offset, s.length), bl))
        views = nxt
    for tgt, loc in views:
        seen = ~torch.isnan(tgt)
        assert torch.equal(tgt[seen], loc[seen]), f"{rec.name}: replicas disagree"
        tgt.copy_(loc)
