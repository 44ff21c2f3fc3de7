"""The gradients a parity check reads: one global batch back-propagated through every
axis and synchronized, without a step (the parity probe of ``parallelize``,
:mod:`paraxis.engine.probe`, and :func:`paraxis.testing.parity.local_gradients`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from paraxis.engine.precision import unscale_and_check
from paraxis.parallel.optimizers import optimizer_params

__all__ = ["fp32_backward"]


@contextlib.contextmanager
def fp32_backward(engine: Any, batch: Any, *, train_mode: bool = False,
                  in_precision: bool = False, aux: bool = True) -> Iterator[None]:
    """Within it, the gradients of ``engine``'s (a :class:`paraxis.engine.engine.Engine`)
    objective on this global batch, back-propagated
    through every axis in fp32 (``train.precision`` if ``in_precision``) and eval
    mode (train mode if ``train_mode``: a dropout-free model whose backward needs it)
    and synchronized, without stepping; cleared on exit. The objective is what
    :meth:`Engine.train_step` back-propagates: the mean loss plus the auxiliary losses
    (a router's load-balancing loss) at their training scale, so a check of these
    gradients checks theirs too (issue 32); ``aux=False`` leaves them out (a
    reference that cannot compute them). Modules count no statistics in it
    (``AuxLosses.checking``). The parity probe and the gradient parity checks read
    them. In fp16 they are what the optimizer would step: back-propagated from the
    objective times the current loss scale, then unscaled (without one, gradients
    below fp16's smallest normal, 6e-5, lose their bits: issue 32)."""
    engine.model.train(train_mode)
    engine._fp32_only = not in_precision
    engine.ctx.aux_losses.checking = aux
    try:
        batch, tokens = engine._prepare(batch)
        microbatches = batch.chunk(engine.config.schedule.microbatches)
        scaler = engine.loss_scaler if in_precision else None
        loss_scale = scaler.scale if scaler is not None else 1.0
        scale = engine.replicas.size / tokens.clamp(min=1) * loss_scale
        aux_scale = engine.replicas.size / len(microbatches) * loss_scale if aux else 0.0
        if engine.ctx.forward_backward is not None:
            with engine.ctx.no_sync():
                engine.ctx.forward_backward(microbatches, engine.loss_fn, scale, True,
                                            aux_scale=aux_scale)
        else:
            engine._forward_backward(microbatches, scale, aux_scale)
        engine.ctx.finish_grad_sync()
        if scaler is not None:  # an overflow shows as inf in the gradients read
            unscale_and_check(optimizer_params(engine.optimizer), 1.0 / loss_scale,
                              engine.grid)
        yield
    finally:
        engine._fp32_only = False
        engine.ctx.aux_losses.checking = False
        engine.optimizer.zero_grad(set_to_none=True)
        engine.ctx.aux_losses.clear()  # parts and carries a failed forward left
        engine.ctx.aux_losses.reset_totals()
