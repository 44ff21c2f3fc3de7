"""Refuse, never mistrain: the parity probe of ``parallelize``.

Before any axis touches the model, every rank computes the model's own loss on a small
fixed probe batch (the whole model, one process, fp32, no dropout) and the global norm
of its gradient. After every axis applied, the engine evaluates the same batch through
the parallel model, each rank on its share, then back-propagates it without stepping;
the globally reduced loss and gradient norm must both agree within
:data:`paraxis.parallel.numerics.REDUCTION_RTOL`. The gradient catches what the loss cannot: a
layout whose forward is right but whose backward is not (a partial gradient never
summed), or one that changes a part of the model contributing little to the loss (a
packed weight split as if unpacked, in experts whose outputs are small at
initialization). A layout that would train something else is refused at ``parallelize``
time with the axes in use and the difference, before a single step. Every rank reaches
the same verdict (both numbers are reduced over the grid), so the refusal never leaves a
rank waiting.

A parallel model that cannot run the probe batch at all (a tensor the model passes to
every layer beside the hidden states, left whole where sequence parallelism split the
hidden states) is refused the same way, with the error it raised.

An axis whose parallel arithmetic is legitimately not the one-process model's (expert
capacity that drops tokens per expert group) sets ``ctx.skip_verify`` to its reason.

The probe runs in eval mode (no dropout). A model that refuses a backward in eval mode
(Reformer's reversible layers assert ``training``) is probed in train mode instead, and
only when that is the same function: every dropout probability it has (``nn.Dropout``
modules and the config's ``*dropout*``/``*_prob`` numbers) is 0. Both probe runs then
fork the random generators, so the training stream is untouched.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from paraxis.engine.loss import causal_lm_loss_sum
from paraxis.parallel.batch import shift_labels
from paraxis.parallel.model_plan import PlanError
from paraxis.parallel.numerics import REDUCTION_RTOL

if TYPE_CHECKING:
    from paraxis.config.parallel import ParallelConfig
    from paraxis.engine.engine import Engine

__all__ = ["Probe"]

PROBE_TOKENS = 16  # per sequence, at least; enough positions to exercise masks


@dataclass(frozen=True)
class Probe:
    """The probe batch (every rank's, as one global batch), the model's own loss and the
    global norm of its gradient."""

    ids: torch.Tensor
    loss: float
    grad_norm: float
    train_mode: bool = False  # probed in train mode (a train-only, dropout-free model)

    @classmethod
    def before(cls, model: nn.Module, config: ParallelConfig, *, seq_length: int,
               vocab: int | None, forward_kwargs: dict[str, Any]) -> Probe:
        """Run the whole model on the probe batch (call before any axis applies)."""
        par = config.parallelism
        # One sequence per microbatch of every rank that holds distinct samples.
        rows = config.sample_shards * config.schedule.microbatches
        # Long enough to split wherever an axis cuts the sequence (context's 2C zigzag
        # chunks, sequence parallel's tensor x context), short enough to be cheap.
        unit = 2 * par.context * par.tensor
        seq = min(seq_length, unit * math.ceil(PROBE_TOKENS / unit))
        g = torch.Generator().manual_seed(1234)
        ids = torch.randint(0, max(vocab or 2, 2), (rows, seq), generator=g)
        try:
            loss, norm = _own_loss_and_norm(model, ids, forward_kwargs, train_mode=False)
            return cls(ids, loss, norm)
        except Exception as exc:
            if not _dropout_free(model):
                raise
            try:  # a model whose backward needs train mode (Reformer's reversible layers)
                loss, norm = _own_loss_and_norm(model, ids, forward_kwargs, train_mode=True)
            except Exception:
                raise exc from None
            return cls(ids, loss, norm, train_mode=True)

    def check(self, engine: Engine, axes: str) -> None:
        """Evaluate and back-propagate the probe through the parallel engine; refuse if
        its loss or gradient norm disagrees."""
        index, count = engine.grid.sample_shard()
        per = self.ids.shape[0] // count
        mine = self.ids[index * per:(index + 1) * per]
        try:
            got = engine.probe_loss(mine)
        except Exception as exc:  # every rank meets a layout's shape error alike
            first = (str(exc).strip().splitlines() or [""])[0]
            raise PlanError(
                f"{engine.plan.model_class}: with {axes} the parallel model cannot run the "
                f"probe batch ({type(exc).__name__}: {first}); this layout does not fit "
                "the model's forward, so it is refused; please report the model and the "
                "degrees") from exc
        if _differ(got, self.loss):
            self._refuse(engine, axes, "loss", got, self.loss)
        if getattr(engine.optimizer, "clips_in_step", False):
            # An optimizer that owns backward and the step (DeepSpeed's engine) keeps the
            # gradients in its own partitions and counts every backward toward its
            # accumulation: a probe backward would change its state, so only the loss
            # is probed; its parity tests hold the gradients.
            return
        with probe_rng(self.train_mode):
            norm = engine.probe_grad_norm(mine, train_mode=self.train_mode)
        if _differ(norm, self.grad_norm):
            self._refuse(engine, axes, "gradient norm", norm, self.grad_norm)

    @staticmethod
    def _refuse(engine: Engine, axes: str, what: str, got: float, want: float) -> None:
        raise PlanError(
            f"{engine.plan.model_class}: with {axes} the parallel model's {what} on a "
            f"probe batch is {got:.8g}, the model's own is {want:.8g} (relative "
            f"difference {abs(got - want) / max(abs(want), 1e-30):.2e}, allowed "
            f"{REDUCTION_RTOL:.0e}). This layout would train something else, so it is "
            "refused; please report the model and the degrees")


def _differ(got: float, want: float) -> bool:
    return not math.isfinite(got) or abs(got - want) > REDUCTION_RTOL * abs(want)


@contextmanager
def probe_rng(fork: bool) -> Iterator[None]:
    """Fork (and afterwards restore) the random generators if ``fork``: a train-mode
    probe must leave the training stream where it was."""
    if not fork:
        yield
        return
    with torch.random.fork_rng(devices=[]):
        yield


def _dropout_free(model: nn.Module) -> bool:
    """Every dropout probability of ``model`` is 0: its ``nn.Dropout`` modules and its
    config's numbers named ``*dropout*`` or ``*_prob`` (functional dropouts read them)."""
    if any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p for m in model.modules()):
        return False
    config = getattr(model, "config", None)
    values = config.to_dict() if hasattr(config, "to_dict") else {}
    return not any(isinstance(v, float) and v and ("dropout" in k or k.endswith("_prob"))
                   for k, v in values.items())


def _own_loss_and_norm(model: nn.Module, ids: torch.Tensor, forward_kwargs: dict[str, Any],
                       *, train_mode: bool) -> tuple[float, float]:
    """The whole model's mean next-token loss on ``ids`` and its gradient's global norm;
    modes and gradients are restored after."""
    device = next(model.parameters()).device
    modes = {m: m.training for m in model.modules()}
    model.train(train_mode)
    try:
        with probe_rng(train_mode):
            out = model(ids.to(device), **forward_kwargs)
            logits = out.logits if hasattr(out, "logits") else out
            loss_sum, count = causal_lm_loss_sum(logits, shift_labels(ids).to(device))
            loss = loss_sum / max(count, 1)
            loss.backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        norm = float(torch.sqrt(sum(g.double().pow(2).sum() for g in grads))) if grads else 0.0
    finally:
        model.zero_grad(set_to_none=True)
        for m, mode in modes.items():
            m.train(mode)
    return float(loss.detach()), norm
