"""The lines a run says about itself (issue 38): each warning once, as one line; what a
resume took over; how a stopped run resumes.

* :class:`WarningLines`: in a ``paraxis train`` worker every Python warning, paraxis's
  or a library's, is shown as ``warning: <Category>: <message>`` on one line, without
  the source path and code line Python's default format adds, and once per run: the
  ranks agree through the rendezvous store (``add`` on a key of the text: the first
  rank to count it prints it), so a warning every rank meets is not printed once per
  rank. Warnings before the store exists wait for it. Python's filters still decide
  what is shown at all (``-W error`` stays an error).
* :func:`resume_line`: the checkpoint, its step, the layout it was written on and the
  one it is read onto, the data position, and what the lr schedule does (the
  scheduler's ``resume_note`` since issue 32), in one line.
* :func:`stop_line`: a run stopped before ``train.steps`` by a signal or by
  ``train.exit_after_steps`` names its checkpoint and the command that resumes it.
"""

from __future__ import annotations

import hashlib
import os
import sys
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["WarningLines", "default_store", "layout_words", "resume_line", "stop_line"]

STORE_KEY = "paraxis/warned/{}"


class WarningLines:
    """Show warnings as single lines, once per run (see the module docstring)."""

    def __init__(self, stream: Any = None):
        self.stream = stream
        self.store: Any = None
        self.seen: set[str] = set()
        self.pending: list[str] = []
        self._previous: Any = None

    def install(self) -> WarningLines:
        self._previous = warnings.showwarning
        warnings.showwarning = self.show
        return self

    def attach(self, store: Any) -> None:
        """The run's store exists: agree on what was held back and on what follows."""
        self.store = store
        held, self.pending = self.pending, []
        for text in held:
            self._emit(text)

    def show(self, message: Warning | str, category: type[Warning], filename: str,
             lineno: int, file: Any = None, line: str | None = None) -> None:
        text = f"{category.__name__}: {' '.join(str(message).split())}"
        if text in self.seen:
            return
        self.seen.add(text)
        if self.store is None and "RANK" in os.environ:
            self.pending.append(text)  # every rank may meet it: wait for the store
            return
        self._emit(text)

    def _emit(self, text: str) -> None:
        if self.store is not None:
            key = STORE_KEY.format(hashlib.sha1(text.encode()).hexdigest()[:20])
            try:
                if self.store.add(key, 1) > 1:
                    return  # another rank said it
            except Exception:  # a store gone (a dying job): say it here
                pass
        print(f"warning: {text}", file=self.stream or sys.stderr, flush=True)

    def uninstall(self) -> None:
        held, self.pending, self.store = self.pending, [], None
        for text in held:
            self._emit(text)
        if self._previous is not None:
            warnings.showwarning = self._previous
            self._previous = None


def default_store() -> Any:
    """The default process group's store (torchrun's rendezvous store), or None."""
    import torch.distributed as dist

    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None


def layout_words(degrees: Mapping[str, int], zero: int = 0) -> str:
    """``pipeline 2 x data 2`` (axes of degree one left out), ``one rank``, with the
    ZeRO stage when there is one."""
    text = " x ".join(f"{axis} {d}" for axis, d in degrees.items() if d > 1) or "one rank"
    return f"{text} (ZeRO-{zero})" if zero else text


def _data_words(state: Mapping[str, Any], stream: Any) -> str:
    if "position" in state:  # a BatchStream: samples consumed by the whole run
        position = int(state["position"])
        batch = getattr(stream, "global_batch", 0)
        per_epoch = getattr(stream, "batches_per_epoch", 0) * batch
        if not per_epoch:
            return f"data at sample {position:,}"
        epoch, offset = divmod(position, per_epoch)
        return (f"data at sample {position:,} (epoch {epoch + 1}, batch "
                f"{offset // batch + 1} of {per_epoch // batch})")
    if state.get("kind") == "stream":
        return (f"data stream at batch {state.get('batches', 0):,} over "
                f"{len(state.get('positions', {}))} shards")
    return "no data position saved (the data order starts over)"


def _schedule_words(scheduler: Any, step: int) -> str:
    if scheduler is None:
        return "no lr schedule"
    note = getattr(scheduler, "resume_note", None)
    if note:  # the horizon changed: kept or re-spread (train.reschedule)
        return note
    total = getattr(scheduler, "total", None)
    lr = getattr(scheduler, "lr", None)
    if total is None or lr is None:
        return "lr schedule as saved"
    return f"lr schedule as saved (cosine to step {total}): lr {lr:.2e} at step {step}"


def resume_line(checkpoint: str | os.PathLike[str], index: Mapping[str, Any],
                layout_now: str, stream: Any, scheduler: Any) -> str:
    """One line for a resumed run (see the module docstring); ``index`` is the
    checkpoint's, ``layout_now`` :func:`layout_words` of this run."""
    step = int(index["step"])
    zero = int(index.get("parallel_config", {}).get("parallelism", {}).get("zero", 0) or 0)
    written = layout_words(index["grid"]["degrees"], zero)
    where = (f"written and read on {written}" if written == layout_now else
             f"written on {written}, read onto {layout_now}")
    return (f"resumed from {Path(checkpoint)} at step {step}: {where}; "
            f"{_data_words(index.get('data') or {}, stream)}; "
            f"{_schedule_words(scheduler, step)}")


def stop_line(step: int, why: str, checkpoint_dir: str | None) -> str:
    """``stopped by a signal after step 12: checkpoint D/step-00000012 written; resume
    with: paraxis train ...`` (the launcher's command, ``PARAXIS_COMMAND``)."""
    command = os.environ.get("PARAXIS_COMMAND", "the same command")
    where = (f"checkpoint {checkpoint_dir}/step-{step:08d} written; resume with: {command}"
             if checkpoint_dir else "no checkpoint written (train.checkpoint_dir is not set)")
    return f"stopped {why} after step {step}: {where}"
