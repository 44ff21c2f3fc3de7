"""Legality of a schedule, without processes: every action once, every dependency met,
no deadlock, and the activations each rank keeps alive.

Dependencies (stage ``s`` of ``S``): ``F(i, s)`` after ``F(i, s-1)``; ``B(i, s)`` after
``F(i, s)`` and ``B(i, s+1)``; ``W(i, s)`` after ``B(i, s)``. Ranks run their lists in
order; a rank waits at an action whose dependency is not done. If no rank can move and
some actions are left, the schedule deadlocks.
"""

from __future__ import annotations

from dataclasses import dataclass

from paraxis_pp.schedules import Action, Schedule

__all__ = ["Legality", "ScheduleError", "check", "dependencies"]


class ScheduleError(ValueError):
    pass


@dataclass(frozen=True)
class Legality:
    order: tuple[tuple[int, Action], ...]  # a global order that respects every dependency
    peak_activations: tuple[int, ...]  # per rank: microbatch-chunks alive at once


def dependencies(s: Schedule, rank: int, a: Action) -> list[tuple[str, int, int]]:
    """(kind, microbatch, global stage) that must be done before ``a``."""
    stage = s.stage(rank, a.chunk)
    if a.kind == "F":
        return [("F", a.mb, stage - 1)] if stage > 0 else []
    if a.kind == "B":
        deps = [("F", a.mb, stage)]
        return deps + ([("B", a.mb, stage + 1)] if stage < s.stages - 1 else [])
    return [("B", a.mb, stage)]


def check(s: Schedule) -> Legality:
    problems = []
    kinds = ("F", "B", "W") if s.split_backward else ("F", "B")
    want = {(k, i, st) for k in kinds for i in range(s.microbatches) for st in range(s.stages)}
    have: list[tuple[str, int, int]] = [
        (a.kind, a.mb, s.stage(r, a.chunk)) for r, row in enumerate(s.actions) for a in row]
    dupes = {x for x in have if have.count(x) > 1}
    if dupes:
        problems.append(f"actions run more than once: {sorted(dupes)[:5]}")
    if set(have) != want:
        problems.append(f"missing {sorted(want - set(have))[:5]}, "
                        f"unexpected {sorted(set(have) - want)[:5]}")
    if problems:
        raise ScheduleError(f"{s.name}: " + "; ".join(problems))
    done: set[tuple[str, int, int]] = set()
    cursor = [0] * s.ranks
    order: list[tuple[int, Action]] = []
    alive, peak = [0] * s.ranks, [0] * s.ranks
    release = "W" if s.split_backward else "B"
    while len(order) < len(have):
        moved = False
        for r, row in enumerate(s.actions):
            while cursor[r] < len(row):
                a = row[cursor[r]]
                if not all(d in done for d in dependencies(s, r, a)):
                    break
                done.add((a.kind, a.mb, s.stage(r, a.chunk)))
                order.append((r, a))
                cursor[r] += 1
                moved = True
                alive[r] += 1 if a.kind == "F" else -1 if a.kind == release else 0
                peak[r] = max(peak[r], alive[r])
        if not moved:
            stuck = {r: str(s.actions[r][cursor[r]]) for r in range(s.ranks)
                     if cursor[r] < len(s.actions[r])}
            raise ScheduleError(f"{s.name}: deadlock; ranks wait at {stuck}")
    if any(alive):
        raise ScheduleError(f"{s.name}: activations never freed on ranks "
                            f"{[r for r, n in enumerate(alive) if n]}")
    return Legality(tuple(order), tuple(peak))
