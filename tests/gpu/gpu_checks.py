"""What the single-GPU checks (``nox -s gpu``, tests/gpu) share: the skip where CUDA is
absent, one line per test naming what was not checked, and a world of one."""

from __future__ import annotations

import time

import pytest
import torch

__all__ = ["needs_cuda", "synchronized_seconds"]


def needs_cuda(what: str) -> pytest.MarkDecorator:
    """Skip with one line where there is no CUDA device (CPU CI, this project's own
    machines): ``what`` names the check that did not run."""
    return pytest.mark.skipif(not torch.cuda.is_available(),
                              reason=f"no CUDA device: {what} not checked")


def synchronized_seconds(fn, repeats: int) -> float:
    """Mean seconds of ``fn()`` with the device drained before and after each call: what
    the work takes, the reference a stream clock is held to."""
    total = 0.0
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        total += time.perf_counter() - start
    return total / repeats
