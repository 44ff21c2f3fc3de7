"""Several asynchronous works waited for as one: a batch of sends and receives
(``dist.batch_isend_irecv``) or the collectives one logical op is made of
(:mod:`.host_collectives`), then an optional ``finish`` (a copy out). What a
:class:`~.collectives.Pending` waits on."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["Works"]


class Works:
    def __init__(self, works: list[Any], finish: Callable[[], Any] | None = None):
        self.works, self.finish = works, finish

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        self.works = []
        if self.finish is not None:
            self.finish()
            self.finish = None
