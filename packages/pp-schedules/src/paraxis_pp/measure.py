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
    """Records this rank's actions of one training step (:meth:`begin` at its start,
    :meth:`mark` before an action, :meth:`record` after it, :meth:`end` with the
    mailbox's hand-overs) and gathers the pipeline's timeline. An evaluation step runs
    forwards only, not the schedule: it leaves the last training step's timeline be."""

    def __init__(self, watch: Stopwatch, device: torch.device):
        self.watch, self.device = watch, device
        self.recording = False
        self.entries: list[tuple[Action, Any, Any]] = []
        self.transfers: list[tuple[float, float]] = []
        self._anchor: tuple[float, Any] | None = None

    def begin(self, training: bool) -> None:
        self.recording = training
        if not training:
            return
        self.entries, self.transfers = [], []
        if self.watch.on_stream:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # the anchor event runs at once
            self._anchor = (time.perf_counter(), self.watch.mark())

    def mark(self) -> Any:
        return self.watch.mark() if self.recording else None

    def record(self, a: Action, start: Any) -> None:
        if self.recording:
            self.entries.append((a, start, self.watch.mark()))

    def end(self, transfers: list[tuple[float, float]]) -> None:
        """The step's hand-overs to the transport (host spans: none on the stream)."""
        if self.recording and not self.watch.on_stream:
            self.transfers = list(transfers)

    def seconds(self) -> list[tuple[Action, float, float]]:
        """This rank's entries in host seconds (on the stream: waits for their events)."""
        if self._anchor is None:
            return list(self.entries)
        host, origin = self._anchor
        return [(a, host + Span(origin, s).seconds(), host + Span(origin, e).seconds())
                for a, s, e in self.entries]

    @property
    def times_launches(self) -> bool:
        """Timed on the host while the passes run on a device: launch times."""
        return not self.watch.on_stream and self.device.type not in ("cpu", "meta")

    def gather(self, group: AxisGroup, name: str) -> Timeline:
        """The last training step's timeline from every rank of ``group`` on one clock
        (collective)."""
        dist.barrier(group=group.pg)
        now = time.perf_counter()
        rows: list[Any] = [None] * group.size
        dist.all_gather_object(rows, (self.seconds(), self.transfers, socket.gethostname(),
                                      now), group=group.pg)
        first_host, first_now = rows[0][2], rows[0][3]
        shift = [0.0 if host == first_host else first_now - clock
                 for _, _, host, clock in rows]
        return Timeline(group.size,
                        tuple(tuple((a, s + d, e + d) for a, s, e in row[0])
                              for row, d in zip(rows, shift, strict=True)),
                        name,
                        transfers=tuple(tuple((s + d, e + d) for s, e in row[1])
                                        for row, d in zip(rows, shift, strict=True)))
