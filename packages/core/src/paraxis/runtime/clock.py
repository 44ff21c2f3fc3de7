"""Seconds between two points of a step: on the host clock, or on the CUDA stream.

On CPU an op runs when it is called, so the host time between two points is the time
spent between them. On CUDA, kernels and NCCL collectives are queued and the call
returns at once: the host time between two points is the time to *launch* what lies
between them, not to run it. Two CUDA events recorded on the current stream bracket what
the stream ran (or stalled on) between the points instead; their gap is read after the
step (:meth:`Span.seconds` waits for the later event), so no op is synchronized.

Which clock a run uses is ``parallelism.stream_timing`` (the CUDA path
``stream_timing`` of :mod:`paraxis.runtime.cuda_paths`): until a GPU run validates the
event path, a CUDA run times on the host, so its seconds are launch times.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

__all__ = ["Span", "Stopwatch"]


class Span:
    """The time between two marks of a :class:`Stopwatch`."""

    __slots__ = ("end", "start")

    def __init__(self, start: Any, end: Any):
        self.start, self.end = start, end

    @property
    def on_stream(self) -> bool:
        """Marked by CUDA events (read later) rather than the host clock (known now)."""
        return not isinstance(self.start, float)

    def seconds(self) -> float:
        """The gap in seconds; on the stream this waits for the later event."""
        if not self.on_stream:
            return self.end - self.start
        self.end.synchronize()
        return self.start.elapsed_time(self.end) / 1e3


def _cuda_event() -> Any:
    import torch

    return torch.cuda.Event(enable_timing=True)


class Stopwatch:
    """Marks points in time on the host clock or, with ``on_stream``, on the current
    CUDA stream (``event`` makes an event; tests pass a stand-in)."""

    def __init__(self, on_stream: bool = False, event: Callable[[], Any] | None = None):
        self.on_stream, self._event = on_stream, event

    def mark(self) -> Any:
        if not self.on_stream:
            return time.perf_counter()
        event = (self._event or _cuda_event)()
        event.record()
        return event

    def since(self, start: Any) -> Span:
        """From ``start`` (a :meth:`mark`) to now."""
        return Span(start, self.mark())
