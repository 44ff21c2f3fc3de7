"""Peak anonymous resident memory added inside a block, for construction-memory checks.

Anonymous memory (``RssAnon`` of ``/proc/self/status``) counts tensors, not the page-cache
pages a memory-mapped safetensors read maps in (those are shared and reclaimable), so
it is what a rank's model construction costs. Sampled by a thread every 0.2 ms: a
transient copy shorter than that can be missed, so a bound on it is an upper bound
checked from below, never a proof. Linux only.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

__all__ = ["AnonPeak", "anon_bytes"]


def anon_bytes() -> int:
    """This process's anonymous resident memory now, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise LookupError("/proc/self/status has no RssAnon line (not Linux?)")


class AnonPeak:
    """``with AnonPeak() as peak: ...``; then ``peak.added`` is the peak anonymous
    memory inside the block minus its size at the start, in bytes."""

    def __enter__(self) -> AnonPeak:
        self.before = self.peak = anon_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.0002):
            self.peak = max(self.peak, anon_bytes())

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, anon_bytes())
        self.added = self.peak - self.before
