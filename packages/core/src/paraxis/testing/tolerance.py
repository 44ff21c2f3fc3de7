"""The one parity tolerance every paraxis test uses, and why it is what it is.

The budget of one step's numbers is :data:`paraxis.parallel.numerics.REDUCTION_RTOL` (1e-5): a
parallel run sums the same terms as its one-process reference in another order, and in
fp32 two orders of a sum of up to 2.5·10^4 terms differ by ≲ u·√n ≈ 1e-5 relative (the
derivation is in :mod:`paraxis.parallel.numerics`, shared with paraxis's own checks).

* :data:`STEP_RTOL` (1e-5): the loss, the gradient norm and the first step's gradients.
  Later steps' losses use it too: over the ≤ 20-step runs of this suite the weights
  differ by far less than a loss can resolve (next bullet), so the loss noise stays one
  step's. *Derived* (u·√n for the suite's reductions, n ≤ 2.5·10^4).

* Gradients are compared per parameter (:func:`assert_gradients_close`): the norm of
  the difference may be ``STEP_RTOL`` of the parameter's own gradient norm, and never
  less than ``STEP_RTOL`` x :data:`GRAD_FLOOR` of the largest parameter's gradient norm.
  The rounding of a sum is set by the terms it adds, not by its result: a gradient that
  nearly cancels (a bias before a norm) carries its layer's rounding, which the floor
  admits. A 2x gradient is a relative error of 1, a hundred thousand times over.
  Losses, norms and weights after Adam cannot see such a defect (Adam is invariant to a
  gradient's scale; a norm weight at 1e-3 of the global norm moves the norm by 1.5e-6
  when doubled), which is why every parity test compares these.
  *Derived* as above; the floor's 1e-3 is a choice, not a measurement.

* Weights after Adam do not obey a relative bound. Adam divides every update by the
  running RMS of its gradient, so an element whose gradient sits at the noise floor of
  the reduction (|g| ≈ u·√n·max|g|) gets an update of either sign: reduction-order noise
  becomes up to a whole ``lr`` per step on that element. Any *real* defect is normalized
  the same way and moves an element by about ``lr`` per step too, so the useful bound is
  a fraction of ``lr`` per step: :func:`weight_atol` allows :data:`ADAM_FRACTION` (1%) of
  one step per step taken, a hundredth of what a defect does, and :data:`WEIGHT_RTOL`
  (1e-4, ten times a step's budget) for the elements far from zero. We saw 0.05% of a
  step per step on a 2-core machine (2.2e-6 after 4 steps at lr 1e-3), twenty times
  inside the bound. *Empirical*: 1% is a choice with a hundredfold margin on both sides
  (measured noise 20x below it, a defect 100x above it), not a derivation.

* :data:`BF16_RTOL` (4 x 2^-8 ≈ 1.6e-2): the same checks when both runs compute in
  bf16 (``train.precision: bf16``; fp16's 2^-11 is inside it). A bf16 result carries a
  relative rounding of up to u = 2^-8, eight significand bits. A layout does not add
  arithmetic; it moves where results are rounded: a row-parallel GEMM's two partial
  outputs are each rounded before their sum (one rounding more per element), a
  sequence or pipeline split rounds at other shapes, and the matmul kernels block
  differently on the smaller operands (fp32 accumulation, so below u). A block of a
  transformer rounds an element at most a few times on its way through (projection,
  attention output, MLP in and out), so four roundings per element, 4u, bound one step's
  relative difference; the means a loss and a norm take only average them down.
  *Derived* from u and that count; the count of four is the model of where a layout
  rounds, checked by the measured differences the bf16 tests print (well inside it).
  Weights are not compared after bf16 steps: Adam turns the rounding of a near-zero
  gradient into an update of either sign, as in fp32 but at 2^16 times the rate.

Tolerances are not tuned per test or per machine: a test that needs another number has
found a defect or a different kind of arithmetic (a compiled optimizer), and says so
next to its own, derived, constant.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist

import torch

from paraxis.parallel.numerics import BF16_RTOL, BF16_UNIT_ROUNDOFF, REDUCTION_RTOL

__all__ = ["ADAM_FRACTION", "BF16_RTOL", "BF16_UNIT", "FP64_RTOL", "GRAD_FLOOR",
           "SAMPLE_FALSE_ALARM", "STEP_RTOL", "WEIGHT_RTOL", "SampleAllowance",
           "assert_gradients_close", "assert_losses_close", "assert_step_close",
           "assert_weights_close", "weight_atol"]

STEP_RTOL = REDUCTION_RTOL
BF16_UNIT = BF16_UNIT_ROUNDOFF
WEIGHT_RTOL = 10 * STEP_RTOL
ADAM_FRACTION = 1e-2
# Kernels checked in float64 against a float64 reference of another order (blockwise
# attention merged by log-sum-exp against one softmax; a model's logits through another
# attention path): u = 2^-53 ≈ 1.1e-16, so the sums differ by u·√n ≈ 2e-14, and the exp
# and log of the merges and their backward amplify that by at most ~1e4 on the tests'
# inputs. 1e-10 (relative, and absolute for elements near zero) keeps four orders of
# margin and is still a million times tighter than fp32 rounding, so a kernel that
# silently fell back to fp32 arithmetic fails.
FP64_RTOL = 1e-10
# The share of the largest gradient element below which an element's rounding is its
# layer's, not its own (see the module docstring).
GRAD_FLOOR = 1e-3


def weight_atol(lr: float, steps: int) -> float:
    """Absolute tolerance on weights after ``steps`` Adam steps of peak rate ``lr``."""
    return ADAM_FRACTION * lr * max(steps, 1)


def assert_losses_close(losses: Sequence[float], reference: Sequence[float],
                        what: str = "per-step losses", *, rtol: float = STEP_RTOL) -> None:
    torch.testing.assert_close(torch.tensor(list(losses), dtype=torch.float64),
                               torch.tensor(list(reference), dtype=torch.float64),
                               rtol=rtol, atol=0.0, msg=lambda m: f"{what}: {m}")


def assert_step_close(got: torch.Tensor, want: torch.Tensor, what: str = "tensor") -> None:
    """One step's numbers (outputs, gradients before any Adam step): relative to the
    largest element, which sets the rounding of the sums that made them."""
    scale = float(want.detach().abs().max()) if want.numel() else 0.0
    torch.testing.assert_close(got, want, rtol=STEP_RTOL, atol=STEP_RTOL * scale,
                               msg=lambda m: f"{what}: {m}")


def assert_weights_close(got: torch.Tensor, want: torch.Tensor, *, lr: float, steps: int,
                         what: str = "weights") -> None:
    torch.testing.assert_close(got, want, rtol=WEIGHT_RTOL, atol=weight_atol(lr, steps),
                               msg=lambda m: f"{what}: {m}")


def assert_gradients_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                           *, rtol: float = STEP_RTOL) -> None:
    """Every parameter's gradient, in norm (see the module docstring). The message names
    each parameter that differs with its relative error."""
    if not want:
        return
    norms = {name: float(w.double().norm()) for name, w in want.items()}
    floor = GRAD_FLOOR * max(norms.values())
    bad = []
    for name, w in want.items():
        diff = float((got[name].double() - w.double()).norm())
        if not diff <= rtol * max(norms[name], floor):
            rel = diff / max(norms[name], 1e-30)
            bad.append(f"{name} (relative error {rel:.2e}, gradient norm {norms[name]:.3g})")
    assert not bad, f"{len(bad)} parameter gradient(s) differ from one process: " + \
        "; ".join(bad[:6])


# Samples against the distribution they should follow: a family's recorded init rule
# against the n values an eager build drew (issue 32). If the rule is right those are n
# independent draws from it, and each statistic below gets the allowance a right rule
# exceeds with probability SAMPLE_FALSE_ALARM (alpha = 1e-9). The every-family init test
# takes ~2e4 such statistics (~150 families x ~30 parameters x 5), so a right recorder
# fails it with probability <= 2e-5 (Bonferroni); the draws are seeded, so a run never
# flickers. *Derived*, each from n alone:
# * mean: |mean - mu| <= z sigma / sqrt(n), z = Phi^-1(1 - alpha/2) = 6.1 (CLT);
# * std: |s - sigma| <= z sigma sqrt((kappa - 1) / (4n)) (delta method on Var s^2 =
#   (mu4 - sigma^4) / n); every rule paraxis replays has kurtosis kappa <= 3 (normal 3,
#   truncated normal less, uniform 1.8), so z sigma / sqrt(2n) holds for all;
# * shape: sup |F_n - F| <= sqrt(ln(2/alpha) / (2n)) (Dvoretzky-Kiefer-Wolfowitz with
#   Massart's constant); two samples of n and m: sqrt(ln(2/alpha) / 2 * (n + m) / (n m));
# * reach: the largest value lies above the rule's 1 - delta quantile and the smallest
#   below its delta quantile, delta = 1 - alpha^(1/n): n draws all miss a tail of mass
#   delta with probability (1 - delta)^n = alpha. A tensor cut at 2 sigma fails an
#   uncut normal rule from n ~ 1000 on (a cut at 3 sigma only from n ~ 10^4: below
#   that, no test can tell the two apart);
# * support: exact, every value inside a bounded rule's [lo, hi].
SAMPLE_FALSE_ALARM = 1e-9


@dataclass(frozen=True)
class SampleAllowance:
    """The allowances above for a sample of ``n`` values (see the comment above)."""

    n: int
    alpha: float
    z: float  # standard errors a mean or a std may stray
    cdf: float  # sup |F_n - F|
    tail: float  # delta: the extremes reach the rule's delta and 1 - delta quantiles

    @classmethod
    def of(cls, n: int, *, alpha: float = SAMPLE_FALSE_ALARM) -> SampleAllowance:
        n = max(n, 1)
        return cls(n, alpha, NormalDist().inv_cdf(1 - alpha / 2),
                   math.sqrt(math.log(2 / alpha) / (2 * n)), -math.expm1(math.log(alpha) / n))

    def mean(self, sigma: float) -> float:
        return self.z * sigma / math.sqrt(self.n)

    def std(self, sigma: float) -> float:
        return self.z * sigma / math.sqrt(2 * self.n)

    def two_sample_cdf(self, m: int) -> float:
        return math.sqrt(math.log(2 / self.alpha) / 2 * (self.n + m) / (self.n * m))
