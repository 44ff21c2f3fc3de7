"""How far two orders of the same fp32 arithmetic may disagree: the one rule that both
paraxis's own checks (pipeline stages against the whole model, the parity probe at
``parallelize``) and every parity test (:mod:`paraxis.testing.tolerance`) derive from.

A parallel run and its one-process reference do the same arithmetic in a different
order: an all-reduce of partial sums instead of one matmul, a reduce-scatter instead of
a full sum, another microbatch split. In fp32 (unit roundoff u = 2^-24 ≈ 6e-8) a sum of
n terms computed in two orders differs by about u·√n relative: rounding errors that are
independent and of either sign add as a random walk (Higham and Mary's probabilistic
bound, SIAM J. Sci. Comput. 2019; the worst case, n·u, needs every rounding to go the
same way and is not what sums of activations and gradients do). That estimate, not a
worst-case bound, is what is *derived* here; that real runs stay inside it is
*measured* (every parity test and coverage cell checks it).

:data:`REDUCTION_RTOL` (1e-5) covers n ≤ :data:`LARGEST_REDUCTION` = 2.5·10^4 terms: the
matmul inner dimensions and token sums of the models paraxis is tested with. A longer
reduction (a 150k-token vocabulary's log-sum-exp and the head's input gradient, a
million-token batch) gets :func:`reduction_rtol` of its length: the parity probe
computes the longest reduction it runs and uses that. Any real defect (a position added
twice, a layer run twice, a gradient summed once too often) is orders of magnitude
larger.
"""

from __future__ import annotations

import math

__all__ = ["BF16_RTOL", "BF16_UNIT_ROUNDOFF", "BF16_WIRE_RTOL", "FP16_RTOL",
           "FP16_UNIT_ROUNDOFF", "FP32_UNIT_ROUNDOFF", "LARGEST_REDUCTION", "LAYOUT_ROUNDINGS",
           "REDUCTION_RTOL", "UNIT_ROUNDOFF", "bf16_wire_rtol", "reduction_rtol"]

FP32_UNIT_ROUNDOFF = 2.0 ** -24
# bf16 keeps 8 significant bits, fp16 11. Their budgets count roundings of u rather than
# terms of a sum, because one such rounding (3.9e-3, 4.9e-4) outweighs any fp32
# reduction's noise:
# * BF16_WIRE_RTOL, a gradient sent over a bf16 reduction (parallelism.reduce_dtype):
#   each rank's part rounded before the sum, the sum rounded after: 2u;
# * BF16_RTOL and FP16_RTOL, a gradient computed in that dtype on both sides
#   (train.precision), where a layout moves where results are rounded: at most
#   LAYOUT_ROUNDINGS of them per element, so 4u. Derived, with what it implies for the
#   loss and for weights after SGD steps, in paraxis.testing.tolerance.
BF16_UNIT_ROUNDOFF = 2.0 ** -8
FP16_UNIT_ROUNDOFF = 2.0 ** -11
UNIT_ROUNDOFF = {"fp32": FP32_UNIT_ROUNDOFF, "bf16": BF16_UNIT_ROUNDOFF,
                 "fp16": FP16_UNIT_ROUNDOFF}
LAYOUT_ROUNDINGS = 4
BF16_WIRE_RTOL = 2 * BF16_UNIT_ROUNDOFF
BF16_RTOL = LAYOUT_ROUNDINGS * BF16_UNIT_ROUNDOFF
FP16_RTOL = LAYOUT_ROUNDINGS * FP16_UNIT_ROUNDOFF
LARGEST_REDUCTION = 25_000
REDUCTION_RTOL = 1e-5
assert FP32_UNIT_ROUNDOFF * math.sqrt(LARGEST_REDUCTION) <= REDUCTION_RTOL


def reduction_rtol(longest: int, unit_roundoff: float = FP32_UNIT_ROUNDOFF) -> float:
    """The relative tolerance for arithmetic whose longest reduction sums ``longest``
    terms: u·√n rounded up to one significant digit, and never below
    :data:`REDUCTION_RTOL` in fp32 (``unit_roundoff`` for another dtype)."""
    bound = unit_roundoff * math.sqrt(max(longest, 1))
    digits = 10.0 ** math.floor(math.log10(bound))
    rounded = float(f"{math.ceil(bound / digits) * digits:.1e}")
    floor = REDUCTION_RTOL if unit_roundoff == FP32_UNIT_ROUNDOFF else 0.0
    return max(rounded, floor)


def bf16_wire_rtol(ranks: int) -> float:
    """How far a gradient reduced over ``ranks`` ranks in bf16 (``parallelism.reduce_dtype:
    bf16``) may be from the same sum in fp32, relative to *its own* norm: ``ranks`` x u.

    Each rank's part is rounded to bf16 before it travels (at most u of itself), and the
    reduction adds the ``ranks`` parts in bf16 (``ranks - 1`` additions, each rounding
    the running sum by at most u of it). Where the parts do not cancel (the same sign
    element by element, so each running sum is at most the whole), an element's error is
    at most u·|g| + (ranks - 1)·u·|g|, and so in norm at most ``ranks`` x u of the
    gradient's own norm: 2u = 2^-7 for two ranks (:data:`BF16_WIRE_RTOL`). The worst case,
    not the random walk: a handful of roundings, not a long sum. Parts that cancel each
    other are rounded at their own size, which a check that sees only the sum cannot
    bound; the parity probe keeps its fp32 floor for them (a share of the whole
    gradient's norm). Measured (``tests/test_reduce_bf16.py``, the debug Llama on data 2
    and ZeRO-2): the worst parameter is 3.2e-3 of its own norm off fp32 (a norm weight),
    0.4 of this bound; the probe's norms use at most 0.17 of their allowance on the debug
    Llama, Mixtral, Qwen2 and GPT-2."""
    return max(ranks, 1) * BF16_UNIT_ROUNDOFF


assert bf16_wire_rtol(2) == BF16_WIRE_RTOL
