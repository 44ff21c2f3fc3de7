"""A model's weights by global name, read and written through each parameter's placement:
how the drift judge starts every step of a layout from the reference's weights."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["full_weights", "set_weights"]


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter by its global name, on a world of one (each held whole)."""
    from paraxis.parallel.placement import placement_of

    out = {}
    for p in model.parameters():
        rec = placement_of(p)
        assert tuple(p.shape) == tuple(rec.global_shape), f"{rec.name} is sharded"
        out[rec.name] = p.detach().clone()
    return out


@torch.no_grad()
def set_weights(model: nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Each of this rank's parameters set to its rows of ``weights`` (global tensors by
    global name), through its placement (shards, packed blocks; padding left alone)."""
    from paraxis.parallel.placement import placement_of

    for p in model.parameters():
        rec = placement_of(p)
        whole = weights[rec.name].to(p.dtype)
        for piece in rec.pieces():
            p[piece.local].copy_(whole[piece.where])
