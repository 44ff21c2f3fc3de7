"""Samples against the distribution they should follow: a family's recorded init rule
against the n values an eager build drew (issue 32).

If the rule is right those are n independent draws from it, and each statistic below
gets the allowance a right rule exceeds with probability :data:`SAMPLE_FALSE_ALARM`
(alpha = 1e-9). The every-family init test takes ~2e4 such statistics (~150 families x
~30 parameters x 5), so a right recorder fails it with probability <= 2e-5 (Bonferroni);
the draws are seeded, so a run never flickers. *Derived*, each from n alone:

* mean: |mean - mu| <= z sigma / sqrt(n), z = Phi^-1(1 - alpha/2) = 6.1 (CLT);
* std: |s - sigma| <= z sigma sqrt((kappa - 1) / (4n)) (delta method on Var s^2 =
  (mu4 - sigma^4) / n); every rule paraxis replays has kurtosis kappa <= 3 (normal 3,
  truncated normal less, uniform 1.8), so z sigma / sqrt(2n) holds for all;
* shape: sup |F_n - F| <= sqrt(ln(2/alpha) / (2n)) (Dvoretzky-Kiefer-Wolfowitz with
  Massart's constant); two samples of n and m: sqrt(ln(2/alpha) / 2 * (n + m) / (n m));
* reach: the largest value lies above the rule's 1 - delta quantile and the smallest
  below its delta quantile, delta = 1 - alpha^(1/n): n draws all miss a tail of mass
  delta with probability (1 - delta)^n = alpha. A tensor cut at 2 sigma fails an uncut
  normal rule from n ~ 1000 on (a cut at 3 sigma only from n ~ 10^4: below that, no test
  can tell the two apart);
* support: exact, every value inside a bounded rule's [lo, hi].
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

__all__ = ["SAMPLE_FALSE_ALARM", "SampleAllowance"]

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
