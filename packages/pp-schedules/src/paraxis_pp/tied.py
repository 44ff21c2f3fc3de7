"""A word embedding tied to the head stays one parameter across pipeline stages.

The first stage holds the embedding, the last the head, and both hold the one weight they
share in the model. Each stage's gradient is only its own use of it; summing the two
over the embedding group (the first and last stage of a pipeline, Megatron-LM's
``embedding_group``, arXiv:2104.04473) gives both the whole gradient, so both take the
same optimizer step and the copies never drift apart.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch
from torch import nn

from paraxis.parallel.placement import placement_of
from paraxis.parallel.strategy import SyncOrder
from paraxis.runtime.collectives import all_reduce_
from paraxis.runtime.grid import AxisGroup

__all__ = ["TiedGradSync"]


class TiedGradSync:
    """Sum the tied parameters' gradients over the embedding group, after data-parallel
    averaging and tensor partial sums (:class:`SyncOrder.TIED`).

    The parameters are found by their placement's ``tied`` flag when the first step
    finishes, not when the pipeline split: axes applied after it (tensor parallel)
    replace a parameter by its shard, whose record keeps the flag."""

    order = SyncOrder.TIED

    def __init__(self, chunks: list[nn.Module], group: AxisGroup):
        self.chunks, self.group = chunks, group
        self._params: list[nn.Parameter] | None = None

    @property
    def params(self) -> list[nn.Parameter]:
        if self._params is None:
            self._params = [p for c in self.chunks for p in c.parameters()
                            if placement_of(p).tied]
        return self._params

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        yield  # nothing happens in backward; finish() does it once per step

    def finish(self) -> float:
        start = time.perf_counter()
        for p in self.params:
            if p.grad is None:  # this stage did not use it this step: contribute zeros
                p.grad = torch.zeros_like(p)
            all_reduce_(p.grad, self.group)
        return time.perf_counter() - start
