"""A recorded init rule against the tensor an eager build drew (issue 32).

The deferred model draws other numbers than the eager one (same distribution, other
stream), so a rule is not compared value by value: the eager tensor is taken as n draws
from the family's own init, and the rule must be the distribution they came from. Each
statistic has the allowance :class:`paraxis.testing.samples.SampleAllowance` derives
from n: the mean, the std, the largest gap between the empirical and the rule's CDF
(Kolmogorov-Smirnov), the reach of the extremes into the rule's tails, and the support,
exactly. Truncation is seen both ways: a cut eager tensor fails an uncut rule by its
extremes (once n can show the cut), an uncut one fails a cut rule by its support.
Constants and padding rows are compared exactly; a :class:`Copy` (values the family
computes from the config and the RNG) against the eager values by the two-sample
statistic, since the RNG stream differs.
"""

from __future__ import annotations

import math

import torch

from paraxis.testing.samples import SampleAllowance
from paraxis_hf.invariant_init import Copy, Draw, Fill, InitRule

__all__ = ["rule_mismatches", "rule_moments"]


def _phi(x: float) -> float:
    return math.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


def _cdf(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2))


def _trunc(draw: Draw) -> tuple[float, float, float]:
    """A truncated normal's standardized cut (alpha, beta) and its mass Z."""
    alpha, beta = (draw.lo - draw.a) / draw.b, (draw.hi - draw.a) / draw.b
    return alpha, beta, _cdf(beta) - _cdf(alpha)


def rule_moments(draw: Draw) -> tuple[float, float]:
    """The mean and std of ``draw``'s distribution (a truncated normal's from Johnson,
    Kotz & Balakrishnan, Continuous Univariate Distributions 1, sec. 10.1)."""
    if draw.kind == "normal":
        return draw.a, draw.b
    if draw.kind == "uniform":
        return (draw.a + draw.b) / 2, (draw.b - draw.a) / math.sqrt(12)
    alpha, beta, mass = _trunc(draw)
    shift = (_phi(alpha) - _phi(beta)) / mass
    var = 1 + (alpha * _phi(alpha) - beta * _phi(beta)) / mass - shift * shift
    return draw.a + draw.b * shift, draw.b * math.sqrt(max(var, 0.0))


def _rule_cdf(draw: Draw, x: torch.Tensor) -> torch.Tensor:
    if draw.kind == "uniform":
        return ((x - draw.a) / (draw.b - draw.a)).clamp(0, 1)
    phi = torch.special.ndtr((x - draw.a) / draw.b)
    if draw.kind == "normal":
        return phi
    alpha, _, mass = _trunc(draw)
    return ((phi - _cdf(alpha)) / mass).clamp(0, 1)


def _bounds(draw: Draw) -> tuple[float, float]:
    if draw.kind == "uniform":
        return draw.a, draw.b
    if draw.kind == "trunc_normal":
        return draw.lo, draw.hi
    return -math.inf, math.inf


def _draw_mismatches(draw: Draw, x: torch.Tensor, dtype: torch.dtype) -> list[str]:
    """``x`` (sorted, float64) as draws from ``draw``: mean, std, support, shape, reach."""
    n = x.numel()
    allow = SampleAllowance.of(n)
    mu, sigma = rule_moments(draw)
    out = []
    mean = float(x.mean())
    if abs(mean - mu) > allow.mean(sigma):
        out.append(f"mean {mean:.4g} where the rule's is {mu:.4g} (+-{allow.mean(sigma):.2g})")
    std = float(x.std()) if n > 1 else sigma
    if abs(std - sigma) > allow.std(sigma):
        out.append(f"std {std:.4g} where the rule's is {sigma:.4g} (+-{allow.std(sigma):.2g})")
    lo, hi = _bounds(draw)
    slack = torch.finfo(dtype).eps * max(abs(lo), abs(hi)) if math.isfinite(lo) else 0.0
    if float(x[0]) < lo - slack or float(x[-1]) > hi + slack:
        out.append(f"values in [{float(x[0]):.4g}, {float(x[-1]):.4g}], outside the rule's "
                   f"support [{lo:.4g}, {hi:.4g}]")
    cdf = _rule_cdf(draw, x)
    steps = torch.arange(n + 1, dtype=torch.float64) / n
    gap = float(torch.maximum(steps[1:] - cdf, cdf - steps[:-1]).max())
    if gap > allow.cdf:
        out.append(f"distribution {gap:.3f} from the rule's (Kolmogorov-Smirnov; "
                   f"allowed {allow.cdf:.3f})")
    low, high = float(cdf[0]), float(cdf[-1])
    if high < 1 - allow.tail or low > allow.tail:
        out.append(f"extremes at the rule's quantiles {low:.4f} and {high:.4f}, short of "
                   f"its tails ({allow.tail:.4f} and {1 - allow.tail:.4f}): cut where the "
                   "rule is not")
    return out


def _two_sample_gap(a: torch.Tensor, b: torch.Tensor) -> float:
    both = torch.cat([a, b])
    fa = torch.searchsorted(a, both, right=True) / a.numel()
    fb = torch.searchsorted(b, both, right=True) / b.numel()
    return float((fa - fb).abs().max())


def _exactly(x: torch.Tensor, value: float, what: str) -> list[str]:
    want = torch.tensor(value, dtype=x.dtype)
    if x.numel() and not bool((x == want).all()):
        return [f"{what} not all {value:g} (in [{float(x.min()):.4g}, {float(x.max()):.4g}])"]
    return []


def rule_mismatches(rule: InitRule, eager: torch.Tensor) -> list[str]:
    """Why ``eager`` (a parameter of an eager build) was not drawn by ``rule``; empty
    when it could have been."""
    eager = eager.detach()
    out: list[str] = []
    keep = torch.ones(eager.shape[0] if eager.dim() else 1, dtype=torch.bool)
    for start, stop, value in rule.rows:  # padding rows: exactly, and left out below
        out += _exactly(eager[start:stop], value, f"rows {start}:{stop}")
        keep[start:stop] = False
    rest = (eager[keep] if eager.dim() else eager.reshape(1)).reshape(-1)
    base = rule.base
    if isinstance(base, Draw) and (base.b == 0 if base.kind != "uniform" else base.a == base.b):
        base = Fill(base.a)  # a draw of no spread is its constant
    if isinstance(base, Fill):
        return out + _exactly(rest, base.value, "values")
    x = rest.double().sort().values
    if not x.numel():
        return out
    if isinstance(base, Copy):
        want = base.values.reshape(eager.shape if eager.dim() else (1,))[keep]
        want = want.to(eager.dtype).double().reshape(-1).sort().values
        gap, allowed = _two_sample_gap(x, want), SampleAllowance.of(x.numel()).two_sample_cdf(
            want.numel())
        return out + ([f"values {gap:.3f} from the copied ones' distribution (two-sample "
                       f"Kolmogorov-Smirnov; allowed {allowed:.3f})"] if gap > allowed else [])
    return out + _draw_mismatches(base, x, eager.dtype)
