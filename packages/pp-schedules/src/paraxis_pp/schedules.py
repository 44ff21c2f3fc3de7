"""Pipeline schedules as data: for each rank, the ordered actions it runs in one step.

An :class:`Action` is the forward (``F``), backward (``B``; input gradient only when the
schedule splits the backward) or weight-gradient (``W``) of one microbatch on one model
chunk. Sends and receives are implied: a forward's output goes to the next stage, a
backward's input gradient to the previous one. With ``v`` chunks per rank (interleaved),
global stage ``s`` lives on rank ``s % p`` as chunk ``s // p`` (Megatron's placement).

Builders: :func:`gpipe` (Huang et al., arXiv:1811.06965), :func:`one_f_one_b`
(PipeDream-Flush, Narayanan et al., arXiv:2006.09503), :func:`interleaved_1f1b`
(Narayanan et al., arXiv:2104.04473), :func:`zero_bubble_h1` (Qi et al.,
arXiv:2401.10241). Schedules are checked by :mod:`paraxis_pp.check` and dry-run by
:mod:`paraxis_pp.simulate` without processes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["SCHEDULES", "Action", "Schedule", "build", "gpipe", "interleaved_1f1b",
           "one_f_one_b", "zero_bubble_h1"]


@dataclass(frozen=True)
class Action:
    kind: str  # "F", "B" or "W"
    mb: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.kind}{self.mb}" + (f"c{self.chunk}" if self.chunk else "")


@dataclass(frozen=True)
class Schedule:
    name: str
    ranks: int
    microbatches: int
    chunks: int
    split_backward: bool
    actions: tuple[tuple[Action, ...], ...]  # per rank

    @property
    def stages(self) -> int:
        return self.ranks * self.chunks

    def stage(self, rank: int, chunk: int) -> int:
        return chunk * self.ranks + rank

    def place(self, stage: int) -> tuple[int, int]:
        """(rank, chunk) holding global stage ``stage``."""
        return stage % self.ranks, stage // self.ranks

    def table(self) -> str:
        """One line per rank, the actions in order, for logs and docs."""
        width = max(len(str(a)) for row in self.actions for a in row)
        return "\n".join(f"rank {r}: " + " ".join(str(a).ljust(width) for a in row)
                         for r, row in enumerate(self.actions))


def gpipe(ranks: int, microbatches: int) -> Schedule:
    """All forwards, then all backwards."""
    m = microbatches
    rows = tuple(tuple([Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)])
                 for _ in range(ranks))
    return Schedule("gpipe", ranks, m, 1, False, rows)


def one_f_one_b(ranks: int, microbatches: int) -> Schedule:
    """Warm up with ``p - r - 1`` forwards, alternate one forward and one backward, then
    drain: at most ``p - r`` microbatches' activations alive on rank ``r``."""
    m, rows = microbatches, []
    for r in range(ranks):
        warm = min(ranks - r - 1, m)
        row = [Action("F", i) for i in range(warm)]
        for i in range(m - warm):
            row += [Action("F", warm + i), Action("B", i)]
        row += [Action("B", i) for i in range(m - warm, m)]
        rows.append(tuple(row))
    return Schedule("1f1b", ranks, m, 1, False, tuple(rows))


def interleaved_1f1b(ranks: int, microbatches: int, chunks: int) -> Schedule:
    """Megatron's interleaved 1F1B: each rank holds ``chunks`` model chunks and works on
    groups of ``p`` microbatches chunk by chunk; the bubble shrinks by ``chunks``."""
    p, m, v = ranks, microbatches, chunks
    if m % p:
        raise ValueError(f"interleaved 1F1B needs microbatches ({m}) divisible by the "
                         f"pipeline degree ({p})")
    total = m * v

    def forward(k: int) -> Action:
        return Action("F", (k // (p * v)) * p + k % p, (k // p) % v)

    def backward(k: int) -> Action:
        return Action("B", (k // (p * v)) * p + k % p, v - 1 - (k // p) % v)

    rows = []
    for r in range(p):
        warm = min((p - r - 1) * 2 + (v - 1) * p, total)
        row = [forward(k) for k in range(warm)]
        for i in range(total - warm):
            row += [forward(warm + i), backward(i)]
        row += [backward(k) for k in range(total - warm, total)]
        rows.append(tuple(row))
    return Schedule("interleaved_1f1b", p, m, v, False, tuple(rows))


def zero_bubble_h1(ranks: int, microbatches: int) -> Schedule:
    """ZB-H1: the backward split into input gradient (B, on the critical path) and
    weight gradient (W, free to move), ordered by the greedy rule of Qi et al.'s
    scheduler under 1F1B's memory limit: at each free moment rank ``r`` runs a ready B,
    else a ready F if fewer than ``p - r`` microbatches await their B, else a pending W;
    at most ``p - r - 1`` W's wait at once. B frees most of a microbatch's activations
    (W keeps only its layer inputs and output gradients), so the deferred W's fill the
    drain where 1F1B idles. Orders are derived with unit costs for F, B and W."""
    p, m = ranks, microbatches
    done: dict[tuple[str, int, int], float] = {}  # (kind, mb, stage) -> end time
    free = [0.0] * p
    next_f, next_b = [0] * p, [0] * p
    pending: list[list[int]] = [[] for _ in range(p)]
    alive = [0] * p
    rows: list[list[Action]] = [[] for _ in range(p)]
    left = 3 * p * m
    while left:
        progressed = False
        for r in sorted(range(p), key=lambda k: free[k]):
            t = free[r]
            i, j = next_b[r], next_f[r]
            b_ready = i < m and ("F", i, r) in done and (
                r == p - 1 or done.get(("B", i, r + 1), float("inf")) <= t)
            f_ready = j < m and alive[r] < p - r and (
                r == 0 or done.get(("F", j, r - 1), float("inf")) <= t)
            if len(pending[r]) > p - r - 1:  # bound the deferred weight gradients
                action = Action("W", pending[r].pop(0))
            elif b_ready:
                action = Action("B", i)
                next_b[r] += 1
                pending[r].append(i)
                alive[r] -= 1
            elif f_ready:
                action = Action("F", j)
                next_f[r] += 1
                alive[r] += 1
            elif pending[r]:
                action = Action("W", pending[r].pop(0))
            else:
                continue
            done[(action.kind, action.mb, r)] = t + 1.0
            free[r] = t + 1.0
            rows[r].append(action)
            left -= 1
            progressed = True
            break
        if not progressed:  # everyone waits on another rank: jump to the next finish
            later = [e for e in done.values() if e > min(free)]
            waiting = min(free)
            bump = min(later) if later else waiting + 1.0
            free = [max(f, bump) if f == waiting else f for f in free]
    return Schedule("zero_bubble_h1", p, m, 1, True, tuple(tuple(r) for r in rows))


SCHEDULES: dict[str, Callable[..., Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved_1f1b": interleaved_1f1b,
    "zero_bubble_h1": zero_bubble_h1,
}


def build(name: str, ranks: int, microbatches: int, chunks: int = 1) -> Schedule:
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; known: {sorted(SCHEDULES)}")
    if name == "interleaved_1f1b":
        return interleaved_1f1b(ranks, microbatches, chunks)
    if chunks != 1:
        raise ValueError(f"schedule {name!r} runs one chunk per rank, not {chunks}")
    return SCHEDULES[name](ranks, microbatches)
