"""An error one rank meets in a phase every rank runs together, agreed on by all ranks.

Some phases read what only one rank reads: loading a checkpoint (each rank its own
slices, from the files that hold them) and materializing a pretrained model (each rank
its own slices of the weights). A rank that failed there used to leave its peers
waiting in the phase's next collective, which then failed on each of them with a
:class:`~paraxis.runtime.liveness.CollectiveError` and C++ frames from the store, about
200 lines before the one that said what happened (issue 38, item 5).

:func:`agreed` runs the phase, then every rank says in one exchange whether it failed
and how (the status exchange is the phase's closing barrier). When any did, every rank
raises, so the run ends at once with one error: the lowest failing rank's message. A
rank that met that error raises its own exception; the others raise
:class:`AgreedError` with the same message. Both carry ``ranks``, the ranks that met it,
which the launcher names (:mod:`paraxis.train.failures`). A rank whose error is not
among the caller's ``known`` types (a bug, not a bad input) re-raises it with its
traceback, and its peers' :class:`AgreedError` says where to look.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from paraxis.runtime.collectives import all_gather_object
from paraxis.runtime.group import AxisGroup

__all__ = ["AgreedError", "agreed"]


class AgreedError(RuntimeError):
    """Another rank failed in a phase this rank ran with it; ``ranks`` met the error."""

    def __init__(self, message: str, ranks: list[int]):
        super().__init__(message)
        self.ranks = ranks


@contextlib.contextmanager
def agreed(group: AxisGroup, phase: str,
           known: tuple[type[BaseException], ...] = ()) -> Iterator[None]:
    """Run the body on every rank of ``group`` (the world, for a phase every rank runs),
    then agree on its outcome (see the module docstring). ``phase`` says what the ranks
    were doing, for the message about a rank's unknown error. Collective: every rank of
    ``group`` must enter and leave it, which the exchange ensures once the body returns
    or raises."""
    failure: Exception | None = None
    try:
        yield
    except Exception as exc:  # every error here is shared, then raised again
        failure = exc
    if group.size == 1:
        if failure is not None:
            raise failure
        return
    mine = None if failure is None else (
        type(failure).__name__, str(failure), isinstance(failure, known))
    reports = all_gather_object(mine, group)
    failed = [(group.ranks[i], r) for i, r in enumerate(reports) if r is not None]
    if not failed:
        return
    first, (kind, message, is_known) = failed[0]
    if not is_known:
        line = message.strip().splitlines()[0] if message.strip() else ""
        message = (f"rank {first} failed while {phase} ({kind}: {line}); its traceback "
                   "is above")
    ranks = [rank for rank, r in failed if r[1] == failed[0][1][1]]
    if failure is not None and (not isinstance(failure, known) or str(failure) == message):
        failure.ranks = ranks  # type: ignore[attr-defined]  # for the launcher's line
        raise failure
    raise AgreedError(message, ranks)
