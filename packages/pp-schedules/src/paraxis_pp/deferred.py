"""Weight gradients of linear layers deferred from a split backward's I to its W
(Megatron-LM's and DeepSeek's ``WeightGradStore``, the zero-bubble schedules' own
implementation: Qi et al., arXiv:2401.10241).

A split backward computes the input gradient first (I, on the critical path) and the
weight gradients later (W, filling the bubbles). torch's helpers split an autograd graph
generically: I walks the graph, hooks the nodes that feed weights and calls autograd
with the graph retained; W calls autograd once per parameter group
(``benchmarks/split_backward.py`` compares the two on a Llama stage). Here, for a
stage whose matrices are all ``nn.Linear`` weights, I is one ordinary backward in which
each linear layer computes its input gradient and keeps (its input, its output
gradient) instead of computing its weight gradient; W runs those GEMMs. Everything
else (norm weights, biases) gets its gradient in I, as in a whole backward.

Each linear layer still runs ``F.linear`` on its own weight (and autograd's own linear
where the forward's backward will not be split: ``recording``); only its backward is
written here (``dX = dY W``, ``dW = dY^T X`` as autograd's own, under the forward's
autocast). Deferred weight gradients are written to ``.grad`` directly, as torch's own
``stage_backward_weight`` does (no post-accumulate hook fires for them; every consumer
of gradients under a pipeline reads them after the schedule). A stage holding any other
trainable matrix (fused expert tensors, GPT-2's ``Conv1D``) keeps torch's split.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from paraxis.runtime.differentiable import (
    autocast_as,
    autocast_state,
    linear_weight_grad,
    plain_linear,
)

__all__ = ["DeferredWeights", "uninstall_deferred"]


class _Linear(torch.autograd.Function):
    """``F.linear(x, weight, bias)``; its weight gradient is handed to ``store`` while
    the store is deferring. Under autocast ``x`` is kept in the autocast dtype, as
    autocast's own linear keeps it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                store: DeferredWeights) -> torch.Tensor:
        ctx.autocast = autocast_state(x.device)
        dtype = ctx.autocast[1]
        ctx.store, ctx.has_bias, ctx.x_dtype = store, bias is not None, x.dtype
        # The parameter itself, whose .grad W writes: under recomputation
        # (torch.utils.checkpoint) a saved tensor comes back as a detached alias.
        ctx.param = weight
        x = x if dtype is None else x.to(dtype)  # autocast's own cast, done once
        ctx.save_for_backward(x, weight)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        x, weight = ctx.saved_tensors
        grad_x = grad_w = grad_b = None
        with autocast_as(ctx.autocast):
            if ctx.needs_input_grad[0]:
                grad_x = (grad @ weight).to(ctx.x_dtype)
            if ctx.needs_input_grad[1]:
                if ctx.store.deferring:
                    ctx.store.pending.append((ctx.param, x, grad, ctx.autocast))
                else:
                    grad_w = linear_weight_grad(x, grad).to(weight.dtype)
            if ctx.has_bias and ctx.needs_input_grad[2]:
                grad_b = grad.flatten(0, -2).sum(0).to(weight.dtype)
        return grad_x, grad_w, grad_b, None


class _DeferredForward:
    """A linear layer's forward through :class:`_Linear` (its own weight and bias)."""

    def __init__(self, module: nn.Linear, store: DeferredWeights):
        self.module, self.store = module, store

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m = self.module
        if not self.store.recording:  # this forward's backward will not be split
            return F.linear(x, m.weight, m.bias)
        return _Linear.apply(x, m.weight, m.bias, self.store)


class DeferredWeights:
    """One stage's linear layers with deferrable weight gradients (:func:`install`)."""

    def __init__(self) -> None:
        # recording: forwards build the deferrable backward (only those whose backward
        # will be split: autograd's own linear is cheaper for a whole one);
        # deferring: a backward keeps the weight GEMMs (set by backward_input).
        self.recording = True
        self.deferring = False
        self.pending: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple]] = []

    @classmethod
    def install(cls, chunk: nn.Module) -> DeferredWeights | None:
        """Route ``chunk``'s plain linear layers through the deferrable backward when every
        trainable matrix of the chunk is a linear weight or an embedding table (a lookup
        has no weight GEMM); else None (torch's generic split)."""
        linears = [m for m in chunk.modules() if plain_linear(m)]
        covered = {id(m.weight) for m in linears}
        covered |= {id(m.weight) for m in chunk.modules() if isinstance(m, nn.Embedding)}
        if not linears or any(p.requires_grad and p.dim() >= 2 and id(p) not in covered
                              for p in chunk.parameters()):
            return None
        store = cls()
        for m in linears:
            m.forward = _DeferredForward(m, store)  # type: ignore[method-assign]
        return store

    def backward_input(self, outputs: list[torch.Tensor], grads: list[Any]) -> list:
        """I: the whole backward with the linear weights' GEMMs kept for :meth:`weight`;
        returns what W needs."""
        self.deferring, self.pending = True, []
        try:
            torch.autograd.backward(outputs, grads)
        finally:
            self.deferring, taken, self.pending = False, self.pending, []
        return taken

    @staticmethod
    @torch.no_grad()
    def weight(taken: list) -> None:
        """W: the kept GEMMs, accumulated into each weight's ``.grad`` (not recorded: the
        kept inputs are the graph's, and a W under grad mode gave every gradient a
        ``grad_fn`` holding them)."""
        for weight, x, grad, state in taken:
            held = weight.grad
            if held is not None and state[1] is None and held.dtype == x.dtype == grad.dtype:
                # summed in the GEMM: no temporary
                held.addmm_(grad.flatten(0, -2).t(), x.flatten(0, -2))
                continue
            with autocast_as(state):
                g = linear_weight_grad(x, grad).to(weight.dtype)
            if held is None:
                weight.grad = g
            else:
                held += g


def uninstall_deferred(chunk: nn.Module) -> None:
    """Give ``chunk``'s linear layers back ``nn.Linear``'s own forward (a peer that
    splits backwards with torch's helpers would compute every weight gradient twice)."""
    for m in chunk.modules():
        if isinstance(vars(m).get("forward"), _DeferredForward):
            del m.forward
