"""Ties and reasons: how two plans' step times compare, in words that never contradict
the order (issue 38: "it is slower than #1 because same time, more memory").

Two plans whose step times lie within :data:`TIE_RTOL` tie: the model's own error is
far larger than that, so neither is "slower". A tie is broken by what costs less
beyond the time (:func:`tie_key`): less communication left exposed (the part of the
estimate a slower network or a busier link moves first), then fewer parallel axes
(fewer moving parts), then less memory per rank; and the reason line says so. A plan
slower than another by more than that is explained by the components that make up
the difference: the largest one, and what offsets it when the net is smaller.
"""

from __future__ import annotations

from typing import Any

from paraxis.planner.units import fmt_bytes, fmt_seconds

__all__ = ["TIE_RTOL", "is_tie", "tie_key", "tie_reason", "why_slower"]

TIE_RTOL = 0.002  # step times this close (0.2%) tie

_WORDS = {"gemm": "GEMMs", "attention": "attention", "elementwise": "elementwise work",
          "launch": "kernel launches", "optimizer": "optimizer step and accumulation"}


def is_tie(a: Any, b: Any) -> bool:
    """Whether plans ``a`` and ``b`` take the same time within :data:`TIE_RTOL`."""
    return abs(a.step.step_s - b.step.step_s) <= TIE_RTOL * min(a.step.step_s, b.step.step_s)


def tie_key(plan: Any) -> tuple[float, int, float]:
    """What breaks a tie, smallest first: exposed communication, parallel axes, memory."""
    axes = sum(1 for d in plan.layout.degrees.values() if d > 1)
    return (sum(plan.step.exposed_s.values()), axes, plan.worst.total)


def tie_reason(plan: Any, other: Any, rank: int = 1) -> str:
    """How ``plan`` ties ``other`` (ranked #``rank``) and what put it below."""
    (e1, a1, m1), (e0, a0, m0) = tie_key(plan), tie_key(other)
    same = (f"ties #{rank} on time ({fmt_seconds(plan.step.step_s)} vs "
            f"{fmt_seconds(other.step.step_s)})")
    if e1 > e0 * (1 + 1e-6):
        return f"{same}, more communication exposed ({fmt_seconds(e1)} vs {fmt_seconds(e0)})"
    if a1 > a0:
        return f"{same}, more moving parts ({a1} parallel axes vs {a0})"
    if m1 > m0:
        return f"{same}, more memory ({fmt_bytes(m1)} vs {fmt_bytes(m0)})"
    return f"{same}, listed second"


def _name(cause: str, plan: Any, best: Any, short: bool = False) -> str:
    if cause == "recompute":
        return f"recomputes ({plan.layout.schedule.activation_checkpointing})"
    if cause == "bubble":
        return f"bubble {plan.bubble.fraction:.1%} vs {best.bubble.fraction:.1%}"
    comm = {a.axis: a for a in plan.comm}.get(cause) or {a.axis: a for a in best.comm}.get(cause)
    if comm is not None:
        what = cause if short else f"{cause} {comm.collective}"
        return f"{what} over {comm.link} exposed"
    return _WORDS.get(cause, cause)


def why_slower(plan: Any, best: Any) -> str:
    """Why ``plan`` ranks below ``best``: a tie and what broke it, or the components
    that make ``plan``'s extra time, with what offsets them when the net is smaller
    (never a reason that contradicts the order)."""
    if is_tie(plan, best):
        return tie_reason(plan, best)
    mine, theirs = plan.step.components(), best.step.components()
    diffs = {k: mine.get(k, 0.0) - theirs.get(k, 0.0) for k in set(mine) | set(theirs)}
    net = plan.step.step_s - best.step.step_s
    if net < 0:  # faster yet ranked below: only a tie can do that, never a contradiction
        return f"faster than #1 by {fmt_seconds(-net)} but ranked below it"
    ups = sorted(((k, d) for k, d in diffs.items() if d > 0), key=lambda kv: -kv[1])
    top = ups[0][1]
    ups = [(k, d) for k, d in ups if d >= 0.25 * top][:3]
    downs = sorted(((k, d) for k, d in diffs.items() if d < -0.25 * net), key=lambda kv: kv[1])
    if len(ups) == 1 and not downs and abs(top - net) <= 0.2 * net:
        return f"{_name(ups[0][0], plan, best)} +{fmt_seconds(top)}"
    line = ", ".join(f"{_name(k, plan, best, True)} +{fmt_seconds(d)}" for k, d in ups)
    if downs:
        k, d = downs[0]
        line += f"; less {_name(k, best, plan, True)} {fmt_seconds(-d)}"
    return f"{line} (net +{fmt_seconds(net)})"
