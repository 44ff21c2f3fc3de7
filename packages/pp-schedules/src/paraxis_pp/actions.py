"""A schedule as frozen data: :class:`Action` (one pass of one microbatch on one model
chunk, named as torch.distributed.pipelining names them: ``F`` forward, ``B`` whole
backward, ``I`` input gradient and ``W`` weight gradient of a split backward, Qi et al.,
arXiv:2401.10241) and :class:`Schedule` (each rank's actions in order, and where each
global stage lives: ``looped`` or ``v``, core's :func:`paraxis.parallel.split.stage_of`).
The builders live in :mod:`paraxis_pp.schedules` and :mod:`paraxis_pp.vshape`.
"""

from __future__ import annotations

from dataclasses import dataclass

from paraxis.parallel.split import PLACEMENTS, stage_of

__all__ = ["KINDS", "PLACEMENTS", "Action", "Schedule"]

# What each kind of action computes: "dX" the input gradient, "dW" the weight gradients.
KINDS = {"F": ("F",), "B": ("dX", "dW"), "I": ("dX",), "W": ("dW",)}


@dataclass(frozen=True)
class Action:
    kind: str  # a key of KINDS
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
    actions: tuple[tuple[Action, ...], ...]  # per rank
    placement: str = "looped"  # one of PLACEMENTS: where each global stage lives

    def __post_init__(self) -> None:
        if self.placement not in PLACEMENTS:
            raise ValueError(f"unknown stage placement {self.placement!r}; known: "
                             f"{PLACEMENTS}")
        if self.placement == "v" and self.chunks % 2:
            raise ValueError(f"{self.name}: a V placement folds the stages down and back "
                             f"up, so it needs an even number of chunks per rank, not "
                             f"{self.chunks}")

    @property
    def stages(self) -> int:
        return self.ranks * self.chunks

    @property
    def split_backward(self) -> bool:
        """Whether any backward runs as an input-gradient and a weight-gradient pass."""
        return any(a.kind == "I" for row in self.actions for a in row)

    def stage(self, rank: int, chunk: int) -> int:
        """The global stage of chunk ``chunk`` on rank ``rank`` (core's rule, which the
        planner counts layers with)."""
        return stage_of(rank, chunk, self.ranks, self.placement)

    def place(self, stage: int) -> tuple[int, int]:
        """(rank, chunk) holding global stage ``stage``."""
        chunk, offset = divmod(stage, self.ranks)
        if self.placement == "v" and chunk % 2:  # the way back up the V
            return self.ranks - 1 - offset, chunk
        return offset, chunk

    def table(self) -> str:
        """One line per rank, the actions in order, for logs and docs."""
        width = max(len(str(a)) for row in self.actions for a in row)
        return "\n".join(f"rank {r}: " + " ".join(str(a).ljust(width) for a in row)
                         for r, row in enumerate(self.actions))
