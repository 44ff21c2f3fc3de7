"""Helpers for parity tests: gather what ranks hold into full tensors."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from paraxis.checkpoint.format import optimizer_params
from paraxis.parallel.placement import Placement, placement_of
from paraxis.testing.tolerance import (
    STEP_RTOL,
    assert_gradients_close,
    assert_sgd_weights_close,
    assert_weights_close,
)

__all__ = ["assemble", "assert_same_gradients", "assert_same_sgd_weights",
           "assert_same_weights", "local_gradients", "local_shards", "random_token_shares",
           "stepped_gradients", "train_on_random_tokens"]

Shards = dict[str, tuple[torch.Tensor, Placement]]


def local_shards(model: nn.Module) -> dict[str, tuple[torch.Tensor, Placement]]:
    """This rank's parameters with their placements, by global name (picklable)."""
    out = {}
    for p in model.parameters():
        rec = placement_of(p)
        out[rec.name] = (p.detach().clone(), rec)
    return out


def local_gradients(engine: Any, batch: Any, *, in_precision: bool = False) -> Shards:
    """This rank's gradients of its share of a global ``batch`` (the mean loss and the
    auxiliary losses, a router's load-balancing loss, as a training step back-propagates
    them: :meth:`~paraxis.engine.engine.Engine.fp32_backward`; through every axis,
    synchronized, before any clipping or step), by global name with their
    placements: what the optimizer steps (a sharding optimizer's shards), mirrors left
    out; a parameter the loss does not reach reads zeros (a data-parallel bucket gives
    it zeros, one process None: the same gradient). Gradients are cleared after; the
    engine's state is untouched. A model whose backward needs train mode (Reformer's
    reversible layers; dropout-free, as the probe requires) is run in it. In fp32, or
    in the run's ``train.precision`` if ``in_precision``."""
    try:
        return _gradients(engine, batch, train_mode=False, in_precision=in_precision)
    except AssertionError:  # Reformer asserts ``training`` in its backward
        with torch.random.fork_rng(devices=[]):
            return _gradients(engine, batch, train_mode=True, in_precision=in_precision)


def _gradients(engine: Any, batch: Any, *, train_mode: bool, in_precision: bool) -> Shards:
    with engine.fp32_backward(batch, train_mode=train_mode, in_precision=in_precision):
        return _optimizer_gradients(engine.optimizer)


def _optimizer_gradients(optimizer: torch.optim.Optimizer) -> Shards:
    out: Shards = {}
    for p in optimizer_params(optimizer):
        rec = placement_of(p)
        if not rec.mirror:
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            out[rec.name] = (grad.detach().clone(), rec)
    return out


@contextlib.contextmanager
def stepped_gradients(engine: Any) -> Iterator[Shards]:
    """Within it, the first ``train_step`` records the gradients its optimizer steps,
    as :func:`local_gradients` names them: after fp16's unscale and any clipping, read
    at the optimizer's ``step`` (empty if the step was skipped)."""
    out: Shards = {}
    optimizer = engine.optimizer
    own = optimizer.__dict__.get("step")  # an instance's own step, else the class's
    step = optimizer.step

    def record(*args: Any, **kwargs: Any) -> Any:
        if not out:
            out.update(_optimizer_gradients(optimizer))
        return step(*args, **kwargs)

    optimizer.step = record
    try:
        yield out
    finally:
        if own is None:
            del optimizer.step
        else:
            optimizer.step = own


def assert_same_gradients(per_rank: list[Shards], reference: Shards, *,
                          rtol: float = STEP_RTOL) -> None:
    """Every parameter's gradient, assembled from the ranks (replicas must agree), equals
    one process's, element by element at the one-step tolerance
    (:func:`paraxis.testing.tolerance.assert_gradients_close`); none missing or extra."""
    full, ref = assemble(per_rank), assemble([reference])
    assert full.keys() == ref.keys(), sorted(full.keys() ^ ref.keys())
    assert_gradients_close(full, ref, rtol=rtol)


def assemble(per_rank: list[Shards]) -> dict[str, torch.Tensor]:
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


def random_token_shares(engine: Any, *, steps: int, batch: int, seq: int, vocab: int,
                        seed: int = 3, ignored: int = 9) -> list[dict[str, torch.Tensor]]:
    """This rank's share of ``steps`` global batches of random tokens; the first
    ``ignored`` labels of sample 0 are -100, so shards hold uneven token counts."""
    g = torch.Generator().manual_seed(seed)
    index, count = engine.grid.sample_shard()
    part = slice(index * batch // count, (index + 1) * batch // count)
    shares = []
    for _ in range(steps):
        ids = torch.randint(0, vocab, (batch, seq), generator=g)
        labels = ids.clone()
        labels[0, :ignored] = -100
        shares.append({"input_ids": ids[part], "labels": labels[part]})
    return shares


def train_on_random_tokens(engine: Any, *, steps: int, batch: int, seq: int, vocab: int,
                           seed: int = 3, ignored: int = 9, gradients: bool = False,
                           ) -> Any:
    """Train on :func:`random_token_shares`; return the per-step losses the engine
    reported, and with ``gradients`` also the first batch's gradients before any step
    (:func:`local_gradients`): ``(losses, gradients)``."""
    shares = random_token_shares(engine, steps=steps, batch=batch, seq=seq, vocab=vocab,
                                 seed=seed, ignored=ignored)
    grads = local_gradients(engine, shares[0]) if gradients else None
    losses = [engine.train_step(share)["loss"] for share in shares]
    return (losses, grads) if gradients else losses


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


def assert_same_sgd_weights(per_rank: list[Shards], reference: Shards,
                            initial: dict[str, torch.Tensor], *, rtol: float,
                            steps: int) -> None:
    """The ranks' shards, assembled, against the one-process reference after ``steps``
    SGD steps from the ``initial`` weights both started from (full tensors by global
    name), per parameter relative to its displacement
    (:func:`paraxis.testing.tolerance.assert_sgd_weights_close`)."""
    full, ref = assemble(per_rank), assemble([reference])
    assert full.keys() == ref.keys() == initial.keys(), sorted(
        (full.keys() | initial.keys()) ^ ref.keys())
    assert_sgd_weights_close(full, ref, initial, rtol=rtol, steps=steps)
