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

The gradients are those a training step back-propagates, the router's load-balancing
loss included (issue 32: doubled, it moves the debug Mixtral's global gradient norm by
1.5e-5 of itself and its gates' gradients by 10-11%, 2.7-3.4% in norm). The one-process
reference adds the *model's own* router loss (transformers' ``output_router_logits=True``
-> ``aux_loss``, times the coefficient the model's own loss weights it by, or
``moe.aux_loss_coef`` where the run overrides it), never paraxis's, so a reference that
shared paraxis's loss code cannot hide a defect in it. The loss is computed per forward,
so the reference runs the global microbatches the layout runs (microbatch ``i`` of every
rank with distinct samples); the language-model half alone is also kept, for an
engine whose router loss is another function than the model's own
(``AuxLosses.unlike_model``: DeepSeek-V3's sequence-wise loss, which paraxis trains on
Laguna's and MiniMax-M2's sigmoid routers where their own code computes Switch's).
There, for a model that computes no router loss of its own (DeepSeek-V3) and for a run
with a router z-loss, the auxiliary losses are left out on both sides, and
``Probe.check`` says so (``engine.ctx.extras["probe"]``). A model with a router loss
of its own costs the probe a second backward, and one forward per microbatch.

Under ``parallelism.reduce_dtype: bf16`` each parameter may differ by
:func:`paraxis.parallel.numerics.bf16_wire_rtol` of *its own* norm more (the wire's
roundings of a gradient whose parts do not cancel), the fp32 terms above staying as the
floor for a gradient that nearly cancels. A slack proportional to the whole gradient's
norm (the old rule: 2^-7 of it) passed a 2x error on any parameter under ~0.8% of the
norm.

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
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from paraxis.checkpoint.format import optimizer_params
from paraxis.engine.probe_model import (
    OwnObjective,
    dropout_free,
    global_microbatches,
    own_router_coef,
    probe_rng,
    whole_norm,
)
from paraxis.parallel.model_plan import PlanError
from paraxis.parallel.norms import grad_norms_by_name
from paraxis.parallel.numerics import bf16_wire_rtol, reduction_rtol

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
    global norm of each parameter's gradient (by name), of the language-model loss alone
    and, where the model computes a router loss of its own, with it added
    (``router_norms``); ``router`` says what the reference did with the router loss."""

    ids: torch.Tensor
    loss: float
    grad_norms: dict[str, float]
    rtol: float  # reduction_rtol of the longest reduction the probe runs
    train_mode: bool = False  # probed in train mode (a train-only, dropout-free model)
    router_norms: dict[str, float] | None = None
    router: str = ""

    @property
    def grad_norm(self) -> float:
        return whole_norm(self.grad_norms)

    @classmethod
    def before(cls, model: nn.Module, config: ParallelConfig, *, seq_length: int,
               vocab: int | None, forward_kwargs: dict[str, Any],
               shape: ModelShape | None = None, router_loss: bool = False) -> Probe:
        """Run the whole model on the probe batch (call before any axis applies).
        ``router_loss``: the engine trains a router loss (the plan names MoE blocks)."""
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
        coef, router = own_router_coef(model, config) if router_loss else (None, "")
        groups = global_microbatches(rows, config.sample_shards, config.schedule.microbatches)
        own = OwnObjective(forward_kwargs, groups, coef or 0.0)
        try:
            found = own.run(model, ids, train_mode=False)
            train_mode = False
        except Exception as exc:
            if not dropout_free(model):
                raise
            try:  # a model whose backward needs train mode (Reformer's reversible layers)
                found = own.run(model, ids, train_mode=True)
            except Exception:
                raise exc from None
            train_mode = True
        loss, norms, with_router, missing = found
        return cls(ids, loss, norms, rtol, train_mode=train_mode, router_norms=with_router,
                   router=f"router loss left out: {missing}" if missing else router)

    def check(self, engine: Engine, axes: str) -> str:
        """Evaluate and back-propagate the probe through the parallel engine; refuse if
        its loss or any parameter's gradient disagrees. Returns what was compared of the
        router loss ("" for a model without one)."""
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
            return self.router
        want, aux, said = self._reference_for(engine)
        names = sorted(want)
        with probe_rng(self.train_mode), engine.fp32_backward(
                mine, train_mode=self.train_mode, aux=aux):
            norms = grad_norms_by_name(optimizer_params(engine.optimizer), engine.grid, names)
        self._compare_gradients(engine, axes, dict(zip(names, norms.tolist(), strict=True)),
                                want)
        return said

    def _reference_for(self, engine: Engine) -> tuple[dict[str, float], bool, str]:
        """The norms the engine's gradients are held to, whether its auxiliary losses are
        back-propagated for them, and what that says: the model's own router loss where
        the engine trains that same loss; else neither side's (an engine whose loss is
        another function than the model's says why: ``AuxLosses.unlike_model``)."""
        unlike = engine.ctx.aux_losses.unlike_model
        if self.router_norms is None:
            return self.grad_norms, False, self.router
        if unlike:
            return self.grad_norms, False, (f"router loss left out: paraxis trains {unlike}, "
                                            "not the model's own")
        return self.router_norms, True, self.router

    def _compare_gradients(self, engine: Engine, axes: str, got: dict[str, float],
                           want: dict[str, float] | None = None) -> None:
        """Each parameter's norm within ``rtol`` of itself plus ``rtol`` of the whole
        (fp32 reduction noise; the whole for a gradient that nearly cancels), plus, when
        the data axis reduces in bf16, the wire's rounding of the parameter's own norm
        (:func:`paraxis.parallel.numerics.bf16_wire_rtol`)."""
        want = self.grad_norms if want is None else want
        whole, rtol = whole_norm(want), self.rtol
        wire = (bf16_wire_rtol(engine.config.token_replicas)
                if engine.config.parallelism.reduce_dtype == "bf16" else 0.0)
        worst, excess = None, 0.0
        for name, norm in want.items():
            diff = abs(got[name] - norm)
            over = diff - (rtol + wire) * norm - rtol * whole
            if not math.isfinite(got[name]) or over > excess:
                worst, excess = name, math.inf if not math.isfinite(got[name]) else over
        if worst is not None:
            bf16 = f"{wire:.1e} (bf16 reduction) plus " if wire else ""
            self._refuse(engine, axes, f"gradient of {worst} (norm)", got[worst],
                         want[worst], f"; allowed {bf16}{rtol:.0e} of it plus "
                         f"{rtol:.0e} of the whole gradient's norm {whole:.6g}")

    def _refuse(self, engine: Engine, axes: str, what: str, got: float, want: float,
                allowed: str = "") -> None:
        raise ParityError(
            f"{engine.plan.model_class}: with {axes} the parallel model's {what} on a "
            f"probe batch is {got:.8g}, the model's own is {want:.8g} (relative "
            f"difference {abs(got - want) / max(abs(want), 1e-30):.2e}"
            f"{allowed or f', allowed {self.rtol:.0e}'}). This layout would train "
            "something else, so it is refused; please report the model and the degrees")
