"""Pipeline schedules as data: for each rank, the ordered actions it runs in one step.

An :class:`Action` is one pass of one microbatch on one model chunk, named as
torch.distributed.pipelining names them: the forward (``F``), the whole backward
(``B``), or a backward split in two (Qi et al., arXiv:2401.10241): the input gradient
(``I``, on the critical path) and the weight gradient (``W``, free to move). Sends and
receives are implied: a forward's output goes to the next stage, an input gradient to
the previous one.

Where the stages live is part of the schedule (:attr:`Schedule.placement`): ``looped``
puts global stage ``s`` on rank ``s % p`` as chunk ``s // p`` (Megatron's interleaved
placement; one chunk per rank is the plain pipeline); ``v`` folds the stages into a V,
rank ``r`` holding stage ``r`` as chunk 0 and stage ``2p-1-r`` as chunk 1 (the V-shape of
ZB-V and DualPipeV), so the first and last stage share rank 0 and the turn of the V
(stages ``p-1`` and ``p``) passes on rank ``p-1`` without a message.

Builders: :func:`gpipe` (Huang et al., arXiv:1811.06965), :func:`one_f_one_b`
(PipeDream-Flush, Narayanan et al., arXiv:2006.09503), :func:`interleaved_1f1b`
(Narayanan et al., arXiv:2104.04473), :func:`zero_bubble_h1` (Qi et al.,
arXiv:2401.10241); the V schedules in :mod:`paraxis_pp.vshape`; the data in
:mod:`paraxis_pp.actions`. Schedules are checked
by :mod:`paraxis_pp.check` and dry-run by :mod:`paraxis_pp.simulate` without processes.
"""

from __future__ import annotations

from collections.abc import Callable

from paraxis.config.parallel import V_SCHEDULES
from paraxis_pp.actions import KINDS, PLACEMENTS, Action, Schedule
from paraxis_pp.vshape import dualpipev, zbv

__all__ = ["KINDS", "PLACEMENTS", "SCHEDULES", "V_SCHEDULES", "Action", "Schedule", "build",
           "gpipe", "interleaved_1f1b", "one_f_one_b", "zero_bubble_h1"]

def gpipe(ranks: int, microbatches: int) -> Schedule:
    """All forwards, then all backwards."""
    m = microbatches
    rows = tuple(tuple([Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)])
                 for _ in range(ranks))
    return Schedule("gpipe", ranks, m, 1, rows)


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
    return Schedule("1f1b", ranks, m, 1, tuple(rows))


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
    return Schedule("interleaved_1f1b", p, m, v, tuple(rows))


def zero_bubble_h1(ranks: int, microbatches: int) -> Schedule:
    """ZB-H1: the backward split into input gradient (I, on the critical path) and
    weight gradient (W, free to move), ordered by the greedy rule of Qi et al.'s
    scheduler under 1F1B's memory limit: at each free moment rank ``r`` runs a ready I,
    else a ready F if fewer than ``p - r`` microbatches await their I, else a pending W;
    at most ``p - r - 1`` W's wait at once. I frees most of a microbatch's activations
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
                r == p - 1 or done.get(("I", i, r + 1), float("inf")) <= t)
            f_ready = j < m and alive[r] < p - r and (
                r == 0 or done.get(("F", j, r - 1), float("inf")) <= t)
            if len(pending[r]) > p - r - 1:  # bound the deferred weight gradients
                action = Action("W", pending[r].pop(0))
            elif b_ready:
                action = Action("I", i)
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
    return Schedule("zero_bubble_h1", p, m, 1, tuple(tuple(r) for r in rows))


SCHEDULES: dict[str, Callable[..., Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved_1f1b": interleaved_1f1b,
    "zero_bubble_h1": zero_bubble_h1,
    "zbv": zbv,
    "dualpipev": dualpipev,
}


def build(name: str, ranks: int, microbatches: int, chunks: int = 1) -> Schedule:
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; known: {sorted(SCHEDULES)}")
    if name == "interleaved_1f1b":
        return interleaved_1f1b(ranks, microbatches, chunks)
    if name in V_SCHEDULES:
        if chunks != 2:
            raise ValueError(f"schedule {name!r} places exactly two chunks per rank in a "
                             f"V (stages r and 2p-1-r), not {chunks}")
        return SCHEDULES[name](ranks, microbatches)
    if chunks != 1:
        raise ValueError(f"schedule {name!r} runs one chunk per rank, not {chunks}")
    return SCHEDULES[name](ranks, microbatches)
