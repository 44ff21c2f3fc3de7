"""Refuse, never mistrain: the parity probe of ``parallelize``.

Before any axis touches the model, every rank computes the model's own loss on a small
fixed probe batch (the whole model, one process, fp32, no dropout) and the norm of the
gradient of *every parameter*. After every axis applied, the engine evaluates the same
batch through the parallel model, each rank on its share, then back-propagates it
without stepping; the globally reduced loss and each parameter's gradient norm (every
element counted once across the grid, :func:`paraxis.parallel.norms.grad_norms_by_name`)
must agree within :func:`paraxis.parallel.numerics.reduction_rtol` of the longest
reduction the probe runs (the vocabulary, the widest matmul, the batch's tokens). The
gradients catch what the loss cannot: a layout whose forward is right but whose backward
is not (a partial gradient never summed), or one that changes a part of the model
contributing little to the loss (a packed weight split as if unpacked, in experts whose
outputs are small at initialization). They are compared per parameter, not as one global
norm, because a gradient off by a constant factor (a reduction missing or done twice on
one axis) hides in the global norm when its parameter carries a small share of it (a
norm weight at 1e-3 of the norm moves it by 1.5e-6 when doubled), and Adam, invariant
to a gradient's scale, would then train the same losses. Each parameter's norm may
differ by ``rtol`` of itself plus ``rtol`` of the global norm (reduction noise in a
gradient that nearly cancels is set by the terms it sums, not by its result).

A layout that would train something else is refused at ``parallelize`` time with a
:class:`ParityError` (a :class:`~paraxis.parallel.model_plan.PlanError` that says a
defect was found, not a feature declined) naming the axes, the parameter and the
difference, before a single step. Every rank reaches the same verdict (every number is
reduced over the grid), so the refusal never leaves a rank waiting.

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

from paraxis.checkpoint.format import optimizer_params
from paraxis.engine.loss import causal_lm_loss_sum
from paraxis.parallel.batch import shift_labels
from paraxis.parallel.model_plan import PlanError
from paraxis.parallel.norms import grad_norms_by_name
from paraxis.parallel.numerics import BF16_WIRE_RTOL, reduction_rtol

if TYPE_CHECKING:
    from paraxis.config.parallel import ParallelConfig
    from paraxis.config.shape import ModelShape
    from paraxis.engine.engine import Engine

__all__ = ["ParityError", "Probe", "longest_reduction"]


class ParityError(PlanError):
    """The parity probe found the parallel model computing something else than the
    model: a defect of the layout (refused), not a feature it declines."""


def longest_reduction(shape: ModelShape | None, tokens: int) -> int:
    """The most terms one sum adds in the probe's forward and backward: a matmul's inner
    dimension (hidden, intermediate, the vocabulary in the head's input gradient and the
    loss's log-sum-exp) or a weight gradient's sum over the batch's tokens."""
    sizes = [tokens]
    if shape is not None:
        sizes += [s for s in (shape.hidden_size, shape.intermediate_size, shape.vocab_size)
                  if isinstance(s, int)]
    return max(sizes)

PROBE_TOKENS = 16  # per sequence, at least; enough positions to exercise masks


@dataclass(frozen=True)
class Probe:
    """The probe batch (every rank's, as one global batch), the model's own loss and the
    global norm of each parameter's gradient (by name, and the whole)."""

    ids: torch.Tensor
    loss: float
    grad_norms: dict[str, float]
    rtol: float  # reduction_rtol of the longest reduction the probe runs
    train_mode: bool = False  # probed in train mode (a train-only, dropout-free model)

    @property
    def grad_norm(self) -> float:
        return math.sqrt(sum(n * n for n in self.grad_norms.values()))

    @classmethod
    def before(cls, model: nn.Module, config: ParallelConfig, *, seq_length: int,
               vocab: int | None, forward_kwargs: dict[str, Any],
               shape: ModelShape | None = None) -> Probe:
        """Run the whole model on the probe batch (call before any axis applies)."""
        par = config.parallelism
        # Two sequences per microbatch of every rank that holds distinct samples: a
        # defect that mixes up samples (an exchange that flattens batch x sequence in
        # another order) is invisible with one.
        rows = 2 * config.sample_shards * config.schedule.microbatches
        # Long enough to split wherever an axis cuts the sequence (context's 2C zigzag
        # chunks, sequence parallel's tensor x context), short enough to be cheap.
        unit = 2 * par.context * par.tensor
        seq = min(seq_length, unit * math.ceil(PROBE_TOKENS / unit))
        g = torch.Generator().manual_seed(1234)
        ids = torch.randint(0, max(vocab or 2, 2), (rows, seq), generator=g)
        rtol = reduction_rtol(longest_reduction(shape, ids.numel()))
        try:
            loss, norms = _own_loss_and_norms(model, ids, forward_kwargs, train_mode=False)
            return cls(ids, loss, norms, rtol)
        except Exception as exc:
            if not _dropout_free(model):
                raise
            try:  # a model whose backward needs train mode (Reformer's reversible layers)
                loss, norms = _own_loss_and_norms(model, ids, forward_kwargs, train_mode=True)
            except Exception:
                raise exc from None
            return cls(ids, loss, norms, rtol, train_mode=True)

    def check(self, engine: Engine, axes: str) -> None:
        """Evaluate and back-propagate the probe through the parallel engine; refuse if
        its loss or any parameter's gradient disagrees."""
        index, count = engine.grid.sample_shard()
        per = self.ids.shape[0] // count
        mine = self.ids[index * per:(index + 1) * per]
        try:
            got = engine.probe_loss(mine)
        except Exception as exc:  # every rank meets a layout's shape error alike
            first = (str(exc).strip().splitlines() or [""])[0]
            raise ParityError(
                f"{engine.plan.model_class}: with {axes} the parallel model cannot run the "
                f"probe batch ({type(exc).__name__}: {first}); this layout does not fit "
                "the model's forward, so it is refused; please report the model and the "
                "degrees") from exc
        if not math.isfinite(got) or abs(got - self.loss) > self.rtol * abs(self.loss):
            self._refuse(engine, axes, "loss", got, self.loss)
        if getattr(engine.optimizer, "clips_in_step", False):
            # An optimizer that owns backward and the step (DeepSpeed's engine) keeps the
            # gradients in its own partitions and counts every backward toward its
            # accumulation: a probe backward would change its state, so only the loss
            # is probed; its parity tests hold the gradients.
            return
        names = sorted(self.grad_norms)
        with probe_rng(self.train_mode), engine.fp32_backward(mine, train_mode=self.train_mode):
            norms = grad_norms_by_name(optimizer_params(engine.optimizer), engine.grid, names)
        self._compare_gradients(engine, axes, dict(zip(names, norms.tolist(), strict=True)))

    def _compare_gradients(self, engine: Engine, axes: str, got: dict[str, float]) -> None:
        """Each parameter's norm within ``rtol`` of itself plus ``rtol`` of the whole
        (two bf16 roundings when the data axis reduces in bf16)."""
        whole = self.grad_norm
        rtol = self.rtol
        if engine.config.parallelism.reduce_dtype == "bf16":
            rtol = max(rtol, BF16_WIRE_RTOL)
        worst, excess = None, 0.0
        for name, want in self.grad_norms.items():
            diff = abs(got[name] - want)
            over = diff - rtol * (want + whole)
            if not math.isfinite(got[name]) or over > excess:
                worst, excess = name, math.inf if not math.isfinite(got[name]) else over
        if worst is not None:
            self._refuse(engine, axes, f"gradient of {worst} (norm)", got[worst],
                         self.grad_norms[worst], f"; allowed {rtol:.0e} of it plus "
                         f"{rtol:.0e} of the whole gradient's norm {whole:.6g}")

    def _refuse(self, engine: Engine, axes: str, what: str, got: float, want: float,
                allowed: str = "") -> None:
        raise ParityError(
            f"{engine.plan.model_class}: with {axes} the parallel model's {what} on a "
            f"probe batch is {got:.8g}, the model's own is {want:.8g} (relative "
            f"difference {abs(got - want) / max(abs(want), 1e-30):.2e}"
            f"{allowed or f', allowed {self.rtol:.0e}'}). This layout would train "
            "something else, so it is refused; please report the model and the degrees")


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


def _own_loss_and_norms(model: nn.Module, ids: torch.Tensor, forward_kwargs: dict[str, Any],
                        *, train_mode: bool) -> tuple[float, dict[str, float]]:
    """The whole model's mean next-token loss on ``ids`` and each parameter's gradient
    norm, by name (0 for a parameter the loss does not reach); modes and gradients are
    restored after."""
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
        norms = {name: float(p.grad.double().norm()) if p.grad is not None else 0.0
                 for name, p in model.named_parameters() if p.requires_grad}
    finally:
        model.zero_grad(set_to_none=True)
        for m, mode in modes.items():
            m.train(mode)
    return float(loss.detach()), norms
