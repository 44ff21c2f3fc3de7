"""``train.profile``: torch.profiler over chosen steps on every rank (issue 38).

The window opens before step ``start`` fetches its batch and closes after step
``start + steps - 1``, so it holds whole steps: the data, the forward and backward, the
gradient synchronization, the optimizer (Megatron's ``--profile-step-start/-end`` and
torchtitan's ``profile_freq`` do the same around their step). Each rank writes:

* ``rank<R>.steps<A>-<B>.trace.json``: the Chrome trace (Perfetto, chrome://tracing) of
  torch's CPU activity (and CUDA's, where the run is on a GPU), one ``ProfilerStep#N``
  range per step and paraxis's own spans (forward, backward, optimizer, the token count,
  the metrics gather... :class:`paraxis.engine.metrics.Tracer`) as ``paraxis/<span>``
  ranges;
* with ``memory: true``, on CUDA ``rank<R>.steps<A>-<B>.memory.pickle``, the allocator's
  snapshot (``torch.cuda.memory._dump_snapshot``; open it in pytorch.org/memory_viz), on
  CPU ``rank<R>.steps<A>-<B>.tracemalloc.txt``, the allocations still alive at the end of
  the window by source line, largest first, and the window's peak.

A run resumed inside the window profiles what is left of it; one resumed after it
profiles nothing.
"""

from __future__ import annotations

import tracemalloc
from pathlib import Path
from typing import Any

import torch

from paraxis.config.run import ProfileWindow

__all__ = ["StepProfiler"]

TOP_ALLOCATIONS = 40


class StepProfiler:
    """Opens and closes the profiler around the window's steps; a no-op without one."""

    def __init__(self, window: ProfileWindow | None, *, rank: int, device: torch.device,
                 tracer: Any, directory: Path):
        self.window, self.rank, self.device, self.tracer = window, rank, device, tracer
        self.directory = Path(window.dir) if window is not None and window.dir else directory
        self._prof: Any = None
        self._first = 0
        self.written: list[Path] = []

    @property
    def last(self) -> int:
        assert self.window is not None
        return self.window.start + self.window.steps - 1

    def before_step(self, step: int) -> None:
        """Step ``step`` (counted from 1) is about to fetch its batch."""
        if (self.window is None or self._prof is not None or self.written
                or not self.window.start <= step <= self.last):
            return
        from torch.profiler import ProfilerAction, ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self._first = step
        # A schedule that always records: torch then marks each step (ProfilerStep#N,
        # numbered as the console counts them) and the window is ours to open and close.
        self._prof = profile(activities=activities, profile_memory=self.window.memory,
                             record_shapes=False, with_stack=False,
                             schedule=lambda _: ProfilerAction.RECORD)
        self._prof.step_num = step
        self._prof.start()
        if self.window.memory:  # after the profiler's own start-up, which it would trace
            self._start_memory()
        self.tracer.ranges = True  # paraxis's spans become record_function ranges

    def after_step(self, step: int) -> None:
        """Step ``step`` is done (its metrics reported)."""
        if self._prof is None:
            return
        if step >= self.last:
            self._stop(step)
        else:
            self._prof.step()

    def close(self, step: int) -> None:
        """The run ends (or fails) with the window open: keep what it recorded."""
        if self._prof is not None:
            self._stop(step)

    def _name(self, last: int, suffix: str) -> Path:
        return self.directory / f"rank{self.rank:05d}.steps{self._first}-{last}.{suffix}"

    def _stop(self, last: int) -> None:
        prof, self._prof = self._prof, None
        self.tracer.ranges = False
        self.directory.mkdir(parents=True, exist_ok=True)
        memory = (self._stop_memory(last) if self.window is not None and self.window.memory
                  else None)
        prof.stop()
        trace = self._name(last, "trace.json")
        prof.export_chrome_trace(str(trace))
        self.written.append(trace)
        if memory is not None:
            self.written.append(memory)

    def _start_memory(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        elif not tracemalloc.is_tracing():
            tracemalloc.start(8)

    def _stop_memory(self, last: int) -> Path:
        if self.device.type == "cuda":
            path = self._name(last, "memory.pickle")
            torch.cuda.memory._dump_snapshot(str(path))
            torch.cuda.memory._record_memory_history(enabled=None)
            return path
        path = self._name(last, "tracemalloc.txt")
        snapshot = tracemalloc.take_snapshot()
        current, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        stats = snapshot.statistics("lineno")[:TOP_ALLOCATIONS]
        lines = [f"# rank {self.rank}, steps {self._first}-{last}: Python allocations "
                 f"(tracemalloc) still alive at the window's end, by line, largest first; "
                 f"alive {current / 2**10:,.1f} KiB, peak {peak / 2**10:,.1f} KiB. Tensor "
                 "storage is allocated by torch in C++ and is not traced here (see the "
                 "trace's memory events)."]
        lines += [f"{s.size / 2**10:12,.1f} KiB  {s.count:8,d} blocks  {s.traceback[0]}"
                  for s in stats]
        path.write_text("\n".join(lines) + "\n")
        return path
