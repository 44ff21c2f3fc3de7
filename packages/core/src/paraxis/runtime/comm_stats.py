"""What a grid's collectives put on the wire and how long callers sat blocked, per
(axes, op): the counters :mod:`paraxis.runtime.collectives` fills and the engine reports as
``comm/<group>_bytes`` (named by :func:`paraxis.parallel.metric_names.group_names`)
and ``exposed_comm_s``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["CommStats"]


@dataclass
class CommStats:
    """Bytes and blocked seconds per (axes, op) for one grid; ``since(mark)`` gives the
    totals of one step."""

    bytes: dict[tuple[str, str], float] = field(default_factory=dict)
    seconds: dict[tuple[str, str], float] = field(default_factory=dict)
    calls: dict[tuple[str, str], int] = field(default_factory=dict)
    # CUDA event pairs around stream waits not yet read (NCCL; see collectives._Clock).
    stream_waits: list[tuple[tuple[str, str], Any, Any]] = field(default_factory=list)
    # Blocked seconds on NCCL groups read from CUDA events (parallelism.stream_timing,
    # resolved by Grid.build); False: the host clock, which on NCCL times the launch.
    on_stream: bool = False

    def add(self, axes: tuple[str, ...], op: str, nbytes: float = 0.0,
            seconds: float = 0.0, calls: int = 1) -> None:
        key = ("x".join(axes) or "self", op)
        self.bytes[key] = self.bytes.get(key, 0.0) + nbytes
        self.seconds[key] = self.seconds.get(key, 0.0) + seconds
        self.calls[key] = self.calls.get(key, 0) + calls

    def add_stream_wait(self, axes: tuple[str, ...], op: str, start: Any, end: Any) -> None:
        """A compute-stream stall bracketed by two recorded CUDA events."""
        self.stream_waits.append((("x".join(axes) or "self", op), start, end))

    def settle(self) -> None:
        """Read the stream stalls recorded so far into ``seconds`` (waits for them)."""
        waits, self.stream_waits = self.stream_waits, []
        for key, start, end in waits:
            end.synchronize()
            self.seconds[key] = self.seconds.get(key, 0.0) + start.elapsed_time(end) / 1e3

    def mark(self) -> dict[str, dict[tuple[str, str], float]]:
        self.settle()
        return {"bytes": dict(self.bytes), "seconds": dict(self.seconds)}

    def since(self, mark: dict[str, dict[tuple[str, str], float]] | None = None,
              ) -> dict[str, dict[tuple[str, str], float]]:
        """Per-key differences from ``mark`` (everything when None)."""
        self.settle()
        mark = mark or {"bytes": {}, "seconds": {}}
        return {kind: {k: v - mark[kind].get(k, 0.0) for k, v in getattr(self, kind).items()
                       if v - mark[kind].get(k, 0.0)}
                for kind in ("bytes", "seconds")}

    def bytes_by_axis(self, mark: Any = None) -> dict[str, float]:
        out: dict[str, float] = {}
        for (axes, _), n in self.since(mark)["bytes"].items():
            out[axes] = out.get(axes, 0.0) + n
        return out

    def seconds_by_axis(self, mark: Any = None) -> dict[str, float]:
        out: dict[str, float] = {}
        for (axes, _), n in self.since(mark)["seconds"].items():
            out[axes] = out.get(axes, 0.0) + n
        return out

    def total_seconds(self, mark: Any = None) -> float:
        return sum(self.since(mark)["seconds"].values())

    def total_bytes(self, mark: Any = None) -> float:
        return sum(self.since(mark)["bytes"].values())
