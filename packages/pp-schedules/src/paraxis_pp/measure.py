"""The measured timeline of one step: each action's (start, end) on one clock for every
stage of the pipeline.

On CPU an action runs when it is called, so the host clock brackets it. On CUDA the call
only queues the action's kernels: the host clock brackets their launch. With
``parallelism.stream_timing`` (core's :class:`~paraxis.runtime.clock.Stopwatch` on the
stream, a CUDA path no GPU run has validated yet) two CUDA events bracket what the stream
ran instead, waits for a received tensor included; they are read as host seconds against
an anchor taken when the step begins (the device drained once, then an event recorded),
and the mailbox's hand-overs, host spans that do not hold the stream, are left out.

Ranks on one host share the monotonic clock. Ranks on other hosts do not: :meth:`gather`
reads every rank's clock right after a barrier and moves each host's times onto the
first rank's (off by the barrier's exit spread, microseconds against the milliseconds of
a pass), where a shared clock would be moved by that spread for nothing.
"""

from __future__ import annotations

import socket
import time
from typing import Any

import torch
import torch.distributed as dist

from paraxis.runtime.clock import Span, Stopwatch
from paraxis.runtime.grid import AxisGroup
from paraxis_pp.actions import Action
from paraxis_pp.simulate import Timeline

__all__ = ["StepTimer"]


class StepTimer:
    """Records this rank's actions of one step (:meth:`begin` at its start, :meth:`mark`
    before an action, :meth:`record` after it) and gathers the pipeline's timeline."""

    def __init__(self, watch: Stopwatch, device: torch.device):
        self.watch, self.device = watch, device
        self.entries: list[tuple[Action, Any, Any]] = []
        self._anchor: tuple[float, Any] | None = None

    def begin(self) -> None:
        self.entries = []
        if self.watch.on_stream:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # the anchor event runs at once
            self._anchor = (time.perf_counter(), self.watch.mark())

    def mark(self) -> Any:
        return self.watch.mark()

    def record(self, a: Action, start: Any) -> None:
        self.entries.append((a, start, self.watch.mark()))

    def seconds(self) -> list[tuple[Action, float, float]]:
        """This rank's entries in host seconds (on the stream: waits for their events)."""
        if self._anchor is None:
            return list(self.entries)
        host, origin = self._anchor
        return [(a, host + Span(origin, s).seconds(), host + Span(origin, e).seconds())
                for a, s, e in self.entries]

    @property
    def on_host_clock_of_a_device(self) -> bool:
        """Timed on the host while the passes run on a device: launch times."""
        return not self.watch.on_stream and self.device.type not in ("cpu", "meta")

    def gather(self, group: AxisGroup, transfers: list[tuple[float, float]],
               name: str) -> Timeline:
        """The step's timeline from every rank of ``group`` on one clock (collective)."""
        if self.watch.on_stream:
            transfers = []  # host spans beside stream times: not comparable
        dist.barrier(group=group.pg)
        now = time.perf_counter()
        rows: list[Any] = [None] * group.size
        dist.all_gather_object(rows, (self.seconds(), transfers, socket.gethostname(), now),
                               group=group.pg)
        first_host, first_now = rows[0][2], rows[0][3]
        shift = [0.0 if host == first_host else first_now - clock
                 for _, _, host, clock in rows]
        return Timeline(group.size,
                        tuple(tuple((a, s + d, e + d) for a, s, e in row[0])
                              for row, d in zip(rows, shift, strict=True)),
                        name,
                        transfers=tuple(tuple((s + d, e + d) for s, e in row[1])
                                        for row, d in zip(rows, shift, strict=True)))
