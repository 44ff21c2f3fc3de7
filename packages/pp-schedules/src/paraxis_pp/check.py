"""Legality of a schedule, without processes: every pass once, every dependency met,
no deadlock, and the activations each rank keeps alive.

Each action computes some of a microbatch's passes on a stage (``KINDS``): F the
forward, B the input and the weight gradients, I the input gradient, W the weight
gradients. Dependencies (stage ``s`` of ``S``): the forward of ``(i, s)`` after the
forward of ``(i, s-1)``; its input gradient (B or I) after its forward and the input
gradient of ``(i, s+1)``; its weight gradients after its input gradient (a W after the
I, a B computes both). Every (microbatch, stage) needs each pass exactly once: F, then
B or I and W. Ranks run their lists in order; a rank waits at an action whose
dependency is not done. If no rank can move and some actions are left, the schedule
deadlocks.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from paraxis_pp.schedules import KINDS, Action, Schedule

__all__ = ["Legality", "ScheduleError", "check", "dependencies", "passes"]

Pass = tuple[str, int, int]  # (what: F, dX or dW; microbatch; global stage)


class ScheduleError(ValueError):
    pass


@dataclass(frozen=True)
class Legality:
    order: tuple[tuple[int, Action], ...]  # a global order that respects every dependency
    peak_activations: tuple[int, ...]  # per rank: microbatch-chunks alive at once


def passes(s: Schedule, rank: int, a: Action) -> list[Pass]:
    """What ``a`` on ``rank`` computes."""
    stage = s.stage(rank, a.chunk)
    return [(what, a.mb, stage) for what in KINDS[a.kind]]


def dependencies(s: Schedule, rank: int, a: Action) -> list[Pass]:
    """The passes that must be done before ``a``."""
    stage = s.stage(rank, a.chunk)
    if a.kind == "F":
        return [("F", a.mb, stage - 1)] if stage > 0 else []
    if a.kind == "W":
        return [("dX", a.mb, stage)]
    deps = [("F", a.mb, stage)]
    return deps + ([("dX", a.mb, stage + 1)] if stage < s.stages - 1 else [])


def _coverage(s: Schedule) -> list[str]:
    """What is run twice, missing or unexpected, and actions of unknown kinds."""
    unknown = sorted({a.kind for row in s.actions for a in row} - KINDS.keys())
    if unknown:
        return [f"unknown action kinds {unknown}; known: {sorted(KINDS)}"]
    want = {(what, i, st) for what in ("F", "dX", "dW") for i in range(s.microbatches)
            for st in range(s.stages)}
    have = Counter(x for r, row in enumerate(s.actions) for a in row for x in passes(s, r, a))
    problems = []
    dupes = sorted(x for x, n in have.items() if n > 1)
    if dupes:
        problems.append(f"passes run more than once: {dupes[:5]}")
    if set(have) != want:
        problems.append(f"missing {sorted(want - set(have))[:5]}, "
                        f"unexpected {sorted(set(have) - want)[:5]}")
    return problems


def check(s: Schedule) -> Legality:
    problems = _coverage(s)
    if problems:
        raise ScheduleError(f"{s.name}: " + "; ".join(problems))
    done: set[Pass] = set()
    cursor = [0] * s.ranks
    order: list[tuple[int, Action]] = []
    alive, peak = [0] * s.ranks, [0] * s.ranks
    total = sum(len(row) for row in s.actions)
    while len(order) < total:
        moved = False
        for r, row in enumerate(s.actions):
            while cursor[r] < len(row):
                a = row[cursor[r]]
                if not all(d in done for d in dependencies(s, r, a)):
                    break
                done.update(passes(s, r, a))
                order.append((r, a))
                cursor[r] += 1
                moved = True
                # A microbatch's activations live from its forward until its weight
                # gradients (W keeps the layer inputs and output gradients it needs).
                alive[r] += 1 if a.kind == "F" else -1 if a.kind in ("B", "W") else 0
                peak[r] = max(peak[r], alive[r])
        if not moved:
            stuck = {r: str(s.actions[r][cursor[r]]) for r in range(s.ranks)
                     if cursor[r] < len(s.actions[r])}
            raise ScheduleError(f"{s.name}: deadlock; ranks wait at {stuck}")
    if any(alive):
        raise ScheduleError(f"{s.name}: activations never freed on ranks "
                            f"{[r for r, n in enumerate(alive) if n]}")
    return Legality(tuple(order), tuple(peak))
