"""Refuse, never mistrain: the parity probe of ``parallelize``.

Before any axis touches the model, every rank computes the model's own loss on a small
fixed probe batch (the whole model, one process, fp32, no dropout). After every axis
applied, the engine evaluates the same batch through the parallel model, each rank on
its share, and the globally reduced loss must agree within
:data:`paraxis.numerics.REDUCTION_RTOL`. A layout that would train something else (a
module a strategy misunderstood, a family whose forward does something the axes did not
expect) is refused at ``parallelize`` time with the axes in use and the difference,
before a single step. Every rank reaches the same verdict (the loss is reduced over the
grid), so the refusal never leaves a rank waiting.

An axis whose parallel arithmetic is legitimately not the one-process model's (expert
capacity that drops tokens per expert group) sets ``ctx.skip_verify`` to its reason.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from paraxis.batch import shift_labels
from paraxis.engine import causal_lm_loss_sum
from paraxis.numerics import REDUCTION_RTOL
from paraxis.plan import PlanError

if TYPE_CHECKING:
    from paraxis.config import ParallelConfig
    from paraxis.engine import Engine

__all__ = ["Probe"]

PROBE_TOKENS = 16  # per sequence, at least; enough positions to exercise masks


@dataclass(frozen=True)
class Probe:
    """The probe batch (every rank's, as one global batch) and the model's own loss."""

    ids: torch.Tensor
    loss: float

    @classmethod
    def before(cls, model: nn.Module, config: ParallelConfig, *, seq_length: int,
               vocab: int | None, forward_kwargs: dict[str, Any]) -> Probe:
        """Run the whole model on the probe batch (call before any axis applies)."""
        par = config.parallelism
        rows = par.data * par.expert  # one sequence per rank that holds distinct samples
        # Long enough to split wherever an axis cuts the sequence (context's 2C zigzag
        # chunks, sequence parallel's tensor x context), short enough to be cheap.
        unit = 2 * par.context * par.tensor
        seq = min(seq_length, unit * math.ceil(PROBE_TOKENS / unit))
        g = torch.Generator().manual_seed(1234)
        ids = torch.randint(0, max(vocab or 2, 2), (rows, seq), generator=g)
        device = next(model.parameters()).device
        modes = {m: m.training for m in model.modules()}
        model.eval()
        try:
            with torch.no_grad():
                out = model(ids.to(device), **forward_kwargs)
                logits = out.logits if hasattr(out, "logits") else out
                loss_sum, count = causal_lm_loss_sum(logits, shift_labels(ids).to(device))
        finally:
            for m, mode in modes.items():
                m.train(mode)
        return cls(ids, float(loss_sum) / max(count, 1))

    def check(self, engine: Engine, axes: str) -> None:
        """Evaluate the probe through the parallel engine; refuse if it disagrees."""
        index, count = engine.grid.sample_shard()
        per = self.ids.shape[0] // count
        got = engine.probe_loss(self.ids[index * per:(index + 1) * per])
        if not math.isfinite(got) or abs(got - self.loss) > REDUCTION_RTOL * abs(self.loss):
            raise PlanError(
                f"{engine.plan.model_class}: with {axes} the parallel model's loss on a "
                f"probe batch is {got:.8g}, the model's own is {self.loss:.8g} (relative "
                f"difference {abs(got - self.loss) / abs(self.loss):.2e}, allowed "
                f"{REDUCTION_RTOL:.0e}). This layout would train something else, so it is "
                "refused; please report the model and the degrees")
