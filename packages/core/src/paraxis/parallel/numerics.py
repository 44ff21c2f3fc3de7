"""How far two orders of the same fp32 arithmetic may disagree: the one number that both
paraxis's own checks (pipeline stages against the whole model, the parity probe at
``parallelize``) and every parity test (:mod:`paraxis.testing.tolerance`) derive from.

A parallel run and its one-process reference do the same arithmetic in a different
order: an all-reduce of partial sums instead of one matmul, a reduce-scatter instead of
a full sum, another microbatch split. In fp32 (unit roundoff u = 2^-24 ≈ 6e-8) a sum of
n terms computed in two orders differs by about u·√n relative (rounding errors add as a
random walk), so a reduction over up to n ≈ 2.5·10^4 terms (more than any matmul inner
dimension or token sum of the models paraxis is tested with) differs by ≲ 1e-5
relative: :data:`REDUCTION_RTOL`. Any real defect (a position added twice, a layer run
twice, a gradient summed once too often) is orders of magnitude larger.
"""

from __future__ import annotations

import math

__all__ = ["FP32_UNIT_ROUNDOFF", "LARGEST_REDUCTION", "REDUCTION_RTOL"]

FP32_UNIT_ROUNDOFF = 2.0 ** -24
LARGEST_REDUCTION = 25_000
REDUCTION_RTOL = 1e-5
assert FP32_UNIT_ROUNDOFF * math.sqrt(LARGEST_REDUCTION) <= REDUCTION_RTOL
