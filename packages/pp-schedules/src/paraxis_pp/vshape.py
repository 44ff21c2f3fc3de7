"""The V-shape schedules: two model chunks per rank placed in a V (rank ``r`` holds stage
``r`` as chunk 0 and stage ``2p-1-r`` as chunk 1; :class:`Schedule` placement ``v``).

Folding the stages into a V puts the first and the last stage on rank 0, so a
microbatch's forward goes down the ranks and comes back up, and its backward starts on
the rank that will also finish it: the warm-up and the drain of the two chunks overlap,
and the turn of the V (stages ``p-1`` and ``p``, both on rank ``p-1``) costs no message.

* :func:`zbv`: ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism", arXiv:2401.10241,
  section 6): split backwards (I, W), the W's filling the warm-up and the drain; 1F1B's
  peak activation memory (``2p`` chunk-microbatches of half a stage each on rank 0).
* :func:`dualpipev`: DualPipe (DeepSeek-V3, arXiv:2412.19437, section 3.2.1) cut in half
  into a V over ``p`` ranks (DeepSeek's open DualPipeV): in the steady phase every rank
  runs a forward of one chunk beside the whole backward of the other (DeepSeek overlaps
  the pair's computation with its expert all-to-all; with no such exchange they run one
  after the other), and the drain splits its backwards so the W's fill it.

Both orders are those of torch.distributed.pipelining's ``ScheduleZBVZeroBubble`` and
``ScheduleDualPipeV`` (torch 2.13), written in this package's actions, so the benchmark's
peer runs the very same order; both are proved legal by :mod:`paraxis_pp.check`.
"""

from __future__ import annotations

from paraxis_pp.actions import Action, Schedule

__all__ = ["dualpipev", "zbv"]


class _Counters:
    """The next microbatch of each (kind, chunk) on one rank, and the input gradients
    whose weight gradient is still owed (oldest first)."""

    def __init__(self) -> None:
        self.next: dict[tuple[str, int], int] = {}
        self.owed: list[tuple[int, int]] = []  # (chunk, microbatch)
        self.row: list[Action] = []

    def add(self, kind: str, chunk: int) -> None:
        key = ("I" if kind == "B" else kind, chunk)  # B and I count backwards alike
        mb = self.next.get(key, 0)
        self.next[key] = mb + 1
        self.row.append(Action(kind, mb, chunk))
        if kind == "I":
            self.owed.append((chunk, mb))

    def owed_weight(self) -> None:
        """The oldest owed weight gradient, if any."""
        if self.owed:
            chunk, mb = self.owed.pop(0)
            self.row.append(Action("W", mb, chunk))


def _v_checks(name: str, ranks: int, microbatches: int, least: int) -> None:
    if microbatches < least:
        raise ValueError(f"{name} needs at least {least} microbatches on {ranks} ranks "
                         f"(2 x {ranks} stages in a V), got {microbatches}")


def zbv(ranks: int, microbatches: int) -> Schedule:
    """ZB-V on ``ranks`` ranks (``2 x ranks`` stages). Per rank ``r``: ``2(p-r)-1``
    forwards of chunk 0, ``r`` pairs (F chunk 1, F chunk 0), ``p-r`` triples F, I, W of
    chunk 1; then the steady phase, per step one F, I, W of each chunk; then the drain:
    ``r`` pairs of input gradients, ``p-r`` (I, W) of chunk 0, and the owed W's. Built
    for ``max(m, 2p-1)`` microbatches and cut to ``m`` (as torch does), so any ``m`` of
    at least ``p`` runs."""
    p, m = ranks, microbatches
    _v_checks("zbv", p, m, p)
    n = max(2 * p - 1, m)
    rows = []
    for r in range(p):
        c = _Counters()
        for _ in range(2 * (p - r) - 1):
            c.add("F", 0)
        for _ in range(r):
            c.add("F", 1)
            c.add("F", 0)
        for _ in range(p - r):
            c.add("F", 1)
            c.add("I", 1)
            c.owed_weight()
        while c.next.get(("F", 1), 0) < c.next[("F", 0)] or c.next[("F", 0)] < n:
            if c.next[("F", 0)] < n:
                c.add("F", 0)
            c.add("I", 0)
            c.owed_weight()
            c.add("F", 1)
            c.add("I", 1)
            c.owed_weight()
        for _ in range(r):  # the drain: input gradients first, their W's owed
            c.add("I", 0)
            c.add("I", 1)
        for _ in range(p - r):
            c.add("I", 0)
            chunk, mb = c.owed.pop(_first_owed(c.owed, 0))
            c.row.append(Action("W", mb, chunk))
        owed = sorted(c.owed, key=lambda o: (-o[0], o[1]))  # chunk 1's first, as torch
        c.row += [Action("W", mb, chunk) for chunk, mb in owed]
        rows.append(tuple(a for a in c.row if a.mb < m))
    return Schedule("zbv", p, m, 2, tuple(rows), placement="v")


def _first_owed(owed: list[tuple[int, int]], chunk: int) -> int:
    return next(i for i, (ch, _) in enumerate(owed) if ch == chunk)


def dualpipev(ranks: int, microbatches: int) -> Schedule:
    """DualPipeV on ``ranks`` ranks (``2 x ranks`` stages), DeepSeek's eight steps per
    rank ``r``: (1) ``2(p-r-1)`` forwards of chunk 0; (2) ``r+1`` pairs F0 F1;
    (3) ``p-r-1`` times I1 W1 F1; (4) ``m-2p+r+1`` times F0 B1 then F1 B0 (the
    overlapped pairs); (5) ``p-r-1`` times B1, F1 B0; (6) ``r+1`` pairs B1 B0, switching to
    split backwards half way; (7) ``p-r-1`` times W, I0; (8) the owed W's. Needs at least
    ``2p`` microbatches (one per stage)."""
    p, m = ranks, microbatches
    _v_checks("dualpipev", p, m, 2 * p)
    rows = []
    for r in range(p):
        c = _Counters()
        for _ in range(2 * (p - r - 1)):
            c.add("F", 0)
        for _ in range(r + 1):
            c.add("F", 0)
            c.add("F", 1)
        for _ in range(p - r - 1):
            c.add("I", 1)
            c.owed_weight()
            c.add("F", 1)
        for _ in range(m - 2 * p + r + 1):
            c.add("F", 0)
            c.add("B", 1)
            c.add("F", 1)
            c.add("B", 0)
        for _ in range(p - r - 1):
            c.add("B", 1)
            c.add("F", 1)
            c.add("B", 0)
        split = False  # the second half of the drain splits its backwards
        for i in range(r + 1):
            split = split or (i == (r + 1) // 2 and r % 2 == 1)
            c.add("I" if split else "B", 1)
            split = split or (i == (r + 1) // 2 and r % 2 == 0)
            c.add("I" if split else "B", 0)
        for _ in range(p - r - 1):
            c.owed_weight()
            c.add("I", 0)
        while c.owed:
            c.owed_weight()
        rows.append(tuple(c.row))
    return Schedule("dualpipev", p, m, 2, tuple(rows), placement="v")
