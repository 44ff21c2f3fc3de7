"""Asynchronous checkpoints (``checkpoint.async: true``; as torch.distributed.checkpoint's
``async_save`` and Megatron's async checkpointing).

The training step waits only for the snapshot: every rank copies what it writes to host
memory (:func:`paraxis.checkpoint.write.snapshot`) and one small all-gather of the
index entries runs, both on the training thread, so no collective ever runs off it. The
stages are the synchronous save's (:mod:`paraxis.checkpoint.write`). A
background thread then writes the rank's safetensors file, its size and SHA-256, and a
``.done-<file>.json`` marker beside it in the temporary directory. On rank 0 the thread
then waits for every rank's marker, removes them, writes the index and publishes the
directory and ``latest`` exactly as a synchronous save does, so a process killed at any
point still leaves the previous checkpoint loadable.

The next save, ``Engine.load``, ``Engine.close`` and the end of ``paraxis train`` wait for
the pending write first (:meth:`AsyncSaver.wait`), and an error in the thread is raised
there. Rank 0 gives up after :data:`WAIT_S` without a rank's marker, naming the rank.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

from paraxis.checkpoint.files import CheckpointError
from paraxis.checkpoint.format import build_index
from paraxis.checkpoint.state import TrainState
from paraxis.checkpoint.write import (
    SaveTarget,
    Snapshot,
    begin_save,
    gather_entries,
    publish,
    snapshot,
    write_atomically,
    write_rank_file,
)

__all__ = ["WAIT_S", "AsyncSaver"]

WAIT_S = 600.0


class AsyncSaver:
    """One engine's pending background write (at most one at a time)."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def wait(self) -> None:
        """Block until the pending write (if any) finished; raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise CheckpointError(f"the background checkpoint write failed: {error}"
                                  ) from error

    def save(self, state: TrainState, directory: str) -> str:
        """Snapshot now, write in the background; returns the step directory's path
        (complete once :meth:`wait` returns on rank 0). Collective."""
        self.wait()
        target = begin_save(state, directory)
        snap = snapshot(state)  # host copies: the snapshot
        gathered = gather_entries(state, target, snap, None)
        index = build_index(state, gathered) if state.grid.rank == 0 else None
        self._thread = threading.Thread(target=self._write, args=(target, snap, index),
                                        name=f"paraxis-checkpoint-{target.name}")
        self._thread.start()
        return str(target.final)

    def _write(self, target: SaveTarget, snap: Snapshot, index: dict[str, Any] | None) -> None:
        try:
            digest = write_rank_file(target, snap)
            write_atomically(target.tmp / f".done-{target.filename}.json", json.dumps(digest))
            if index is not None:
                _finish(index, target)
        except BaseException as exc:  # raised on the training thread by wait()
            self._error = exc


def _finish(index: dict[str, Any], target: SaveTarget) -> None:
    """Rank 0: wait for every rank's marker, then index, publish, ``latest``."""
    deadline = time.monotonic() + WAIT_S
    files: dict[str, Any] = {}
    for filename in index["files"]:
        marker = target.tmp / f".done-{filename}.json"
        while not marker.exists():
            if time.monotonic() > deadline:
                raise CheckpointError(f"{target.tmp}: no {filename} after {WAIT_S:.0f} s: "
                                      "that rank died or its disk is full; the previous "
                                      "checkpoint stays the latest")
            time.sleep(0.005)
        files[filename] = json.loads(marker.read_text())
        marker.unlink()
    index["files"] = files
    publish(target, index)
