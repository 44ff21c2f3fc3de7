"""Asynchronous checkpoints (``checkpoint.async: true``; as torch.distributed.checkpoint's
``async_save`` and Megatron's async checkpointing).

The training step waits only for the snapshot: every rank copies what it writes to host
memory (:func:`paraxis.checkpoint._local_entries`) and one small all-gather of the
index entries runs, both on the training thread, so no collective ever runs off it. A
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
import random
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file

from paraxis.checkpoint import (
    _begin_save,
    _index,
    _local_entries,
    _publish,
    _write_atomically,
)
from paraxis.checkpoint_files import CheckpointError, file_digest
from paraxis.collectives import all_gather_object

if TYPE_CHECKING:
    from paraxis.engine import Engine

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

    def save(self, engine: Engine, directory: str) -> str:
        """Snapshot now, write in the background; returns the step directory's path
        (complete once :meth:`wait` returns on rank 0). Collective."""
        self.wait()
        root, name, tmp, filename = _begin_save(engine, directory)
        rank = engine.grid.rank
        tensors, entries = _local_entries(engine)  # host copies: the snapshot
        gathered = all_gather_object((filename, entries, random.getstate(), None),
                                     engine.grid.world)
        index = _index(engine, gathered) if rank == 0 else None
        self._thread = threading.Thread(
            target=self._write, args=(tensors, tmp, filename, index, root / name),
            name=f"paraxis-checkpoint-{name}")
        self._thread.start()
        return str(root / name)

    def _write(self, tensors: dict[str, torch.Tensor], tmp: Path, filename: str,
               index: dict[str, Any] | None, final: Path) -> None:
        try:
            save_file(tensors, str(tmp / filename))
            _write_atomically(tmp / f".done-{filename}.json",
                              json.dumps(file_digest(tmp / filename)))
            if index is not None:
                _finish(index, tmp, final)
        except BaseException as exc:  # raised on the training thread by wait()
            self._error = exc


def _finish(index: dict[str, Any], tmp: Path, final: Path) -> None:
    """Rank 0: wait for every rank's marker, then index, publish, ``latest``."""
    deadline = time.monotonic() + WAIT_S
    files: dict[str, Any] = {}
    for filename in index["files"]:
        marker = tmp / f".done-{filename}.json"
        while not marker.exists():
            if time.monotonic() > deadline:
                raise CheckpointError(f"{tmp}: no {filename} after {WAIT_S:.0f} s: that "
                                      "rank died or its disk is full; the previous "
                                      "checkpoint stays the latest")
            time.sleep(0.005)
        files[filename] = json.loads(marker.read_text())
        marker.unlink()
    index["files"] = files
    _write_atomically(tmp / "index.json", json.dumps(index, indent=1))
    _publish(tmp, final)
    _write_atomically(final.parent / "latest", final.name + "\n")
