"""Which rank died: a heartbeat on the rendezvous store, read when a collective fails.

When a rank dies mid-step its peers' next collective fails (gloo: "connection reset by
peer"; NCCL: the collective timeout), but that error names a socket, not a rank. Every
rank writes the time into the default store once a second (:class:`Heartbeat`, started
with the grid); when a collective fails, :func:`guard` waits until some rank's beat is
stale and re-raises as :class:`CollectiveError` naming the collective, the group, this
rank and the ranks that stopped beating. Under torchrun the store lives in the agent, so
it outlives any worker; elsewhere it lives in rank 0 (when rank 0 is the one that died,
the error says the store could not be reached).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

if TYPE_CHECKING:
    from paraxis.runtime.group import AxisGroup

__all__ = ["CollectiveError", "Heartbeat", "guard", "stale_ranks"]

INTERVAL_S = 1.0
STALE_AFTER_S = 4.0
KEY = "paraxis/beat/{}"


class CollectiveError(RuntimeError):
    """A collective failed because a peer is gone (or unreachable)."""


def _store() -> Any:
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None


class Heartbeat:
    """A daemon thread writing this rank's time into the default store every second."""

    def __init__(self, rank: int, interval: float = INTERVAL_S):
        self.rank, self.interval = rank, interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Heartbeat:
        store = _store()
        if store is None:
            return self
        self._beat(store)

        def run() -> None:
            while not self._stop.wait(self.interval):
                with contextlib.suppress(Exception):  # a dying job: nothing to report
                    self._beat(store)

        self._thread = threading.Thread(target=run, name="paraxis-heartbeat", daemon=True)
        self._thread.start()
        return self

    def _beat(self, store: Any) -> None:
        store.set(KEY.format(self.rank), repr(time.time()))

    def stop(self) -> None:
        self._stop.set()


def stale_ranks(ranks: tuple[int, ...], *, wait_s: float = STALE_AFTER_S + 2,
                ) -> list[int] | None:
    """The ranks among ``ranks`` whose heartbeat is older than :data:`STALE_AFTER_S`,
    waiting up to ``wait_s`` for one to go stale; None if the store is unreachable."""
    store = _store()
    if store is None:
        return None
    deadline = time.monotonic() + wait_s
    while True:
        try:
            now = time.time()
            beats = {r: float(store.get(KEY.format(r)).decode()) for r in ranks}
        except Exception:
            return None
        stale = [r for r, t in beats.items() if now - t > STALE_AFTER_S]
        if stale or time.monotonic() > deadline:
            return stale
        time.sleep(0.5)


@contextlib.contextmanager
def guard(group: AxisGroup, op: str) -> Iterator[None]:
    """Re-raise a failed collective over ``group`` naming the op and the dead ranks."""
    try:
        yield
    except RuntimeError as exc:
        if isinstance(exc, CollectiveError) or not dist.is_initialized():
            raise
        me = dist.get_rank()
        dead = stale_ranks(tuple(r for r in group.ranks if r != me))
        who = ("the rendezvous store could not be reached (rank 0 or the launcher is gone)"
               if dead is None else f"unresponsive ranks: {dead}" if dead else
               "every peer still beats (a hang or an error elsewhere)")
        raise CollectiveError(
            f"{op} over {'x'.join(group.axes) or 'the world'} (ranks {list(group.ranks)}) "
            f"failed on rank {me}: {who}. Cause: {str(exc).splitlines()[0][:300]}") from exc
