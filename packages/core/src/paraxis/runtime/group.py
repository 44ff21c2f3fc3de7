"""One rank's group along some grid axes: members, index and the process group.

Its own module so that the collectives, the liveness check and the grid can all name it
without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["AxisGroup"]


@dataclass(frozen=True)
class AxisGroup:
    """This rank's group along some axes: the members, our index and the process group.

    ``pg`` is None when the group has one member: collectives over it are no-ops.
    ``stats`` is the grid's :class:`~paraxis.runtime.comm_stats.CommStats`, where core's
    collectives count the bytes and blocked seconds of every op over this group.
    """

    axes: tuple[str, ...]
    ranks: tuple[int, ...]
    rank: int
    pg: Any = field(default=None, compare=False, repr=False)
    stats: Any = field(default=None, compare=False, repr=False)
    # Its collectives order against CUDA streams (NCCL) instead of blocking the calling
    # thread: blocked time is then the stream's, read from CUDA events where
    # parallelism.stream_timing is on (collectives._Clock), else the launch's.
    stream_ordered: bool = field(default=False, compare=False)

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def first(self) -> int:
        """Global rank of the group's first member (the source of broadcasts)."""
        return self.ranks[0]
