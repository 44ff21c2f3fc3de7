"""Cross-entropy over vocabulary-sharded logits, never gathering them (Megatron-LM,
arXiv:1909.08053, section 3: "fuse the output embedding GEMM with the cross entropy").

Each rank holds logits for the token ids ``[start, start + local)``. Three all-reduces
of one number per token replace an all-gather of the logits: the max (for stability),
the target's logit (only its owner contributes), and the sum of exponentials. Columns
past the real vocabulary (padding) are masked to ``-inf``; labels equal to
``ignore_index`` contribute nothing.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from paraxis.runtime.collectives import all_reduce_
from paraxis.runtime.grid import AxisGroup

__all__ = ["VocabParallelLoss", "vocab_parallel_cross_entropy"]


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, start: int, vocab: int,
                group: AxisGroup, ignore_index: int) -> torch.Tensor:
        logits = logits.float()
        local = logits.shape[-1]
        padded = torch.arange(start, start + local, device=logits.device) >= vocab
        if padded.any():
            logits = logits.masked_fill(padded, float("-inf"))
        peak = logits.max(dim=-1).values
        all_reduce_(peak, group, op=dist.ReduceOp.MAX)
        shifted = logits - peak.unsqueeze(-1)
        mine = (target >= start) & (target < start + local)
        index = (target - start).clamp(0, local - 1)
        picked = shifted.gather(-1, index.unsqueeze(-1)).squeeze(-1) * mine
        exp = shifted.exp()
        sums = torch.stack([picked, exp.sum(dim=-1)])
        all_reduce_(sums, group)
        valid = target != ignore_index
        loss = (sums[1].log() - sums[0]) * valid
        ctx.save_for_backward(exp.div_(sums[1].unsqueeze(-1)), index, mine, valid)
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        softmax, index, mine, valid = ctx.saved_tensors
        out = softmax.clone()
        out.scatter_add_(-1, index.unsqueeze(-1), -mine.to(out.dtype).unsqueeze(-1))
        out.mul_((grad * valid).unsqueeze(-1))
        return out, None, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, *, start: int,
                                 vocab: int, group: AxisGroup,
                                 ignore_index: int = -100) -> torch.Tensor:
    """Per-token loss for ``logits`` (..., local vocab) and ``target`` (...)."""
    shape = target.shape
    loss = _VocabParallelCE.apply(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                                  start, vocab, group, ignore_index)
    return loss.view(shape)


class VocabParallelLoss:
    """The engine's loss for vocab-sharded logits: (summed loss, token count) against
    already-shifted targets, equal to :func:`paraxis.engine.loss.causal_lm_loss_sum` on the
    gathered logits."""

    def __init__(self, *, start: int, vocab: int, group: AxisGroup, ignore_index: int = -100):
        self.start, self.vocab, self.group, self.ignore_index = start, vocab, group, ignore_index

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, int]:
        target = targets.to(logits.device)
        loss = vocab_parallel_cross_entropy(logits, target, start=self.start,
                                            vocab=self.vocab, group=self.group,
                                            ignore_index=self.ignore_index)
        return loss.sum(), int((target != self.ignore_index).sum())
