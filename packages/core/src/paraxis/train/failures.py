"""How ``paraxis train`` reports a failed run: in lines a user can act on, once.

The launcher (:func:`paraxis.train.launcher.run_workers`) names a directory in
``PARAXIS_REPORT_DIR`` for its workers. Each worker keeps a small record there
(:class:`RankRecord`): its step and peak resident memory after every step, and, if it
fails, the error. The launcher reads them when torchrun's agent says ranks failed:

* an error every rank can meet alike and that names its cause (a configuration
  problem, a damaged checkpoint, a refused layout: :data:`KNOWN`) is printed once, as
  one line with the ranks that raised it, and the workers print no traceback; an error
  one rank met in a phase all ranks agree on (:mod:`paraxis.runtime.agreement`: a
  checkpoint file only that rank reads) names the ranks that met it, not every rank
  that stopped with it;
* a rank killed by SIGKILL printed nothing (it could not): it is named as killed, most
  likely by the kernel's out-of-memory killer, with its last recorded memory and step;
* any other error keeps the worker's traceback, which is above.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

from paraxis.checkpoint.files import CheckpointError
from paraxis.config.errors import ConfigError
from paraxis.engine.metrics import peak_rss_bytes
from paraxis.parallel.model_plan import PlanError
from paraxis.runtime.agreement import AgreedError

__all__ = ["KNOWN", "REPORT_ENV", "RankRecord", "explain"]

REPORT_ENV = "PARAXIS_REPORT_DIR"
# Errors that name their cause and that every rank meets alike: one line says it all.
# AgreedError: a peer's error in an agreed phase, which that peer reports itself.
KNOWN = (ConfigError, CheckpointError, PlanError, AgreedError)


def _write(path: Path, record: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)  # a reader never sees half a record


class RankRecord:
    """This worker's record in the launcher's report directory (none outside it)."""

    # A step's record is written when the peak grew or this long after the last one:
    # a file write per step would sit on the training loop for nothing.
    EVERY_S = 5.0

    def __init__(self) -> None:
        where = os.environ.get(REPORT_ENV)
        self.rank = int(os.environ.get("RANK", "0"))
        self.dir = Path(where) if where else None
        self._peak, self._written = -1, -math.inf

    def alive(self, step: int) -> None:
        """After each step: the step and this process's peak resident memory so far."""
        if self.dir is None:
            return
        peak, now = peak_rss_bytes(), time.monotonic()
        if peak > self._peak or now - self._written >= self.EVERY_S:
            _write(self.dir / f"rank{self.rank}.state", {"step": step, "peak_rss_bytes": peak})
            self._peak, self._written = peak, now

    def failed(self, exc: BaseException) -> bool:
        """Record the error; True when the launcher will say it (the caller then prints
        no traceback)."""
        known = isinstance(exc, KNOWN)
        if self.dir is None:
            return False
        _write(self.dir / f"rank{self.rank}.error",
               {"type": type(exc).__name__, "message": str(exc), "known": known,
                "ranks": getattr(exc, "ranks", None)})  # who met an agreed error
        return known


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def explain(report_dir: str, failed: dict[int, str | None]) -> list[str]:
    """Lines for the ranks torchrun reported failed (rank -> the signal that killed it,
    or None for an exit code)."""
    where = Path(report_dir)
    known: dict[str, list[int]] = {}
    lines = []
    for rank in sorted(failed):
        error = _read(where / f"rank{rank}.error")
        if error is not None and error["known"]:
            met = known.setdefault(error["message"], [])
            met += [r for r in error.get("ranks") or [rank] if r not in met]
        elif failed[rank] == "SIGKILL":
            state = _read(where / f"rank{rank}.state")
            last = ("" if state is None else
                    f"; its peak resident memory was {state['peak_rss_bytes'] / 2**30:.2f} GiB"
                    f" after step {state['step']}")
            lines.append(f"rank {rank} was killed by SIGKILL, most likely by the kernel's "
                         f"out-of-memory killer (a killed process prints nothing){last}")
        elif failed[rank] is not None:
            lines.append(f"rank {rank} was killed by {failed[rank]}")
        elif error is not None:
            lines.append(f"rank {rank} failed ({error['type']}); its traceback is above")
        else:
            lines.append(f"rank {rank} exited with an error but no Python exception")
    for message, ranks in known.items():
        ranks.sort()
        who = f"rank {ranks[0]}" if len(ranks) == 1 else \
            f"ranks {', '.join(map(str, ranks))}"
        lines.insert(0, f"{message} ({who})")
    return lines
