"""Helpers for parity tests: gather what ranks hold into full tensors."""

from __future__ import annotations

import torch
from torch import nn

from paraxis.parallel.placement import Placement, placement_of
from paraxis.testing.tolerance import assert_weights_close

__all__ = ["assemble", "assert_same_weights", "local_shards", "train_on_random_tokens"]


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
    """Write ``local``'s real rows where its placement puts them (nested shards, packed
    blocks and padding included: :meth:`paraxis.parallel.placement.Placement.pieces`)."""
    for piece in rec.pieces():
        tgt, loc = target[piece.where], local[piece.local]
        seen = ~torch.isnan(tgt)
        assert torch.equal(tgt[seen], loc[seen]), f"{rec.name}: replicas disagree"
        tgt.copy_(loc)


def train_on_random_tokens(engine, *, steps: int, batch: int, seq: int, vocab: int,
                           seed: int = 3, ignored: int = 9) -> list[float]:
    """Train ``steps`` global batches of random tokens, each rank on its sample shard;
    the first ``ignored`` labels of sample 0 are -100, so shards hold uneven token
    counts. Returns the per-step losses the engine reported."""
    g = torch.Generator().manual_seed(seed)
    index, count = engine.grid.sample_shard()
    part = slice(index * batch // count, (index + 1) * batch // count)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, vocab, (batch, seq), generator=g)
        labels = ids.clone()
        labels[0, :ignored] = -100
        losses.append(engine.train_step({"input_ids": ids[part],
                                         "labels": labels[part]})["loss"])
    return losses


def assert_same_weights(per_rank: list[dict[str, tuple[torch.Tensor, Placement]]],
                        reference: dict[str, tuple[torch.Tensor, Placement]], *,
                        lr: float, steps: int) -> None:
    """The ranks' shards, assembled, equal the one-process reference parameter by
    parameter (and no parameter is missing or extra), at the shared tolerance for
    weights after ``steps`` Adam steps of peak rate ``lr`` (paraxis.testing.tolerance)."""
    full, ref = assemble(per_rank), assemble([reference])
    assert full.keys() == ref.keys(), sorted(full.keys() ^ ref.keys())
    for name in ref:
        assert_weights_close(full[name], ref[name], lr=lr, steps=steps, what=name)
