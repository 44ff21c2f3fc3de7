"""Dry-run a schedule with per-action costs: the timeline and the bubble.

Each rank runs its actions in order; an action starts when the rank is free and its
dependencies (:func:`paraxis_pp.check.dependencies`) have finished, plus ``comm`` when
the dependency ran on another rank. ``f``, ``b`` and ``w`` are the costs of a forward,
an input gradient and a weight gradient; a whole backward (``B``) costs ``b + w``.
:func:`replay` runs a schedule on a measured step's own pass durations instead.
"""

from __future__ import annotations

from dataclasses import dataclass

from paraxis.parallel.bubble import closed_form_bubble
from paraxis_pp.check import check, dependencies, passes
from paraxis_pp.schedules import Action, Schedule

__all__ = ["Timeline", "replay", "simulate", "theoretical_bubble"]


@dataclass(frozen=True)
class Timeline:
    """Per rank, (action, start, end); the same shape serves measured timelines.

    A measured timeline also holds, per rank, the (start, end) spans its thread spent
    handing messages to the transport (``transfers``: posting receives, sending). They
    lie between actions, so they are part of the idle time: what the executor's
    point-to-point exposes, apart from waiting for another stage."""

    ranks: int
    entries: tuple[tuple[tuple[Action, float, float], ...], ...]
    name: str = ""
    transfers: tuple[tuple[tuple[float, float], ...], ...] = ()

    @property
    def makespan(self) -> float:
        starts = [s for row in self.entries for _, s, _ in row]
        ends = [e for row in self.entries for _, _, e in row]
        return max(ends) - min(starts) if ends else 0.0

    def busy(self, rank: int) -> float:
        return sum(e - s for _, s, e in self.entries[rank])

    @property
    def bubble(self) -> float:
        """Idle share of ranks x makespan: 1 - busy / (ranks x makespan)."""
        total = self.ranks * self.makespan
        return 1.0 - sum(self.busy(r) for r in range(self.ranks)) / total if total else 0.0

    def handing(self, rank: int) -> float:
        """Seconds of ``rank``'s idle time spent handing messages to the transport
        (its spans clipped to the makespan)."""
        if not self.transfers or not self.entries[rank]:
            return 0.0
        lo = min(s for row in self.entries for _, s, _ in row)
        hi = lo + self.makespan
        return sum(max(0.0, min(e, hi) - max(s, lo)) for s, e in self.transfers[rank])

    @property
    def handing_share(self) -> float:
        """The part of :attr:`bubble` spent handing messages to the transport."""
        total = self.ranks * self.makespan
        return sum(self.handing(r) for r in range(self.ranks)) / total if total else 0.0


def simulate(s: Schedule, *, f: float = 1.0, b: float = 1.0, w: float = 1.0,
             comm: float = 0.0) -> Timeline:
    cost = {"F": f, "B": b + w, "I": b, "W": w}
    return _run(s, lambda r, a: cost[a.kind], comm, s.name)


def replay(s: Schedule, measured: Timeline) -> Timeline:
    """``s`` run again on ``measured``'s own pass durations with nothing between them: the
    timeline those very passes make under an executor that costs nothing (no
    communication, no steps of its own). The measured bubble less the replayed one is
    what the executor added; the replayed one less :func:`simulate`'s at median costs is
    what the passes' uneven and varying durations added. A W the runner recorded as the
    whole backward it ran (a B) keeps that duration, and the I that did nothing costs 0."""
    took = {(r, a): end - start for r, row in enumerate(measured.entries)
            for a, start, end in row}

    def cost(r: int, a: Action) -> float:
        if (r, a) in took:
            return took[r, a]
        whole = (r, Action("B", a.mb, a.chunk))
        if a.kind in ("I", "W") and whole in took:
            return took[whole] if a.kind == "W" else 0.0
        raise ValueError(f"rank {r} has no measured {a} in {measured.name!r} to replay")

    return _run(s, cost, 0.0, f"{s.name} (replayed)")


def _run(s: Schedule, cost, comm: float, name: str) -> Timeline:
    legal = check(s)  # a global order that respects every dependency
    end: dict[tuple[str, int, int], tuple[float, int]] = {}
    free = [0.0] * s.ranks
    rows: list[list[tuple[Action, float, float]]] = [[] for _ in range(s.ranks)]
    for r, a in legal.order:
        start = free[r]
        for dep in dependencies(s, r, a):
            t, where = end[dep]
            start = max(start, t + (comm if where != r else 0.0))
        stop = start + cost(r, a)
        end.update((done, (stop, r)) for done in passes(s, r, a))
        free[r] = stop
        rows[r].append((a, start, stop))
    return Timeline(s.ranks, tuple(tuple(row) for row in rows), name)


def theoretical_bubble(s: Schedule) -> float:
    """The closed-form bubble of ``s`` (core's :mod:`paraxis.parallel.bubble`, which the
    planner uses too)."""
    return closed_form_bubble(s.name, s.ranks, s.microbatches, s.chunks).fraction
