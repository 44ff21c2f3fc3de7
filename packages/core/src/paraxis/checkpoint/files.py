"""The files of a checkpoint, checked before they are trusted.

Every file's size and SHA-256 go into the index when it is written. Reading a
checkpoint checks, before safetensors sees a byte: that the index is one (and of a
format this paraxis reads), that each file it needs exists, has the recorded size and,
unless told not to, the recorded checksum. Each failure is a :class:`CheckpointError`
naming the file and the problem, never a traceback from inside safetensors. Nothing is
ever unpickled: the index is JSON, tensors are safetensors.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open

from paraxis.version import __version__

__all__ = ["FORMAT_VERSION", "CheckedFiles", "CheckpointError", "file_digest", "read_index"]

# 2: files carry size and sha256 (version 1 is still read, without those checks).
# 3: the model's persistent buffers are saved (``buffer/<name>``) and a checkpoint must
#    hold every one the model has; 1 and 2 are still read, the model keeping its own
#    buffers (paraxis.checkpoint.buffers). Bumped although a version-2 reader could parse
#    the index: it would resume without the buffers, silently training another run, so
#    it is told to upgrade instead.
FORMAT_VERSION = 3
_CHUNK = 1 << 22


class CheckpointError(ValueError):
    """A checkpoint (or one of its files) cannot be used; the message says which and why."""


def file_digest(path: Path) -> dict[str, Any]:
    """Size and SHA-256 of a file, as the index records them."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            h.update(block)
    return {"bytes": path.stat().st_size, "sha256": h.hexdigest()}


def read_index(ckpt: Path) -> dict[str, Any]:
    path = ckpt / "index.json"
    if not path.is_file():
        raise CheckpointError(f"{ckpt} holds no index.json: not a paraxis checkpoint, or a "
                              "save that never finished")
    try:
        index = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path} is corrupted ({exc.__class__.__name__}: {exc})"
                              ) from None
    if not isinstance(index, dict) or index.get("format") != "paraxis-checkpoint":
        raise CheckpointError(f"{path} is not a paraxis checkpoint index")
    version = index.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointError(
            f"{path} has format version {version}, newer than this paraxis reads "
            f"({FORMAT_VERSION}, paraxis {__version__}): upgrade paraxis to load it")
    return index


class CheckedFiles:
    """Opens a checkpoint's safetensors files, each checked once, on first use."""

    def __init__(self, ckpt: Path, index: dict[str, Any], *, verify: bool = True):
        self.ckpt, self.verify = ckpt, verify
        self.records: dict[str, Any] = index.get("files", {})
        self._open: dict[str, Any] = {}

    def check(self, name: str) -> Path:
        path = self.ckpt / name
        if not path.is_file():
            raise CheckpointError(f"{path} is missing: the checkpoint lost a rank's file")
        record = self.records.get(name)
        if record is None:
            return path  # format 1: nothing recorded to check against
        size = path.stat().st_size
        if size != record["bytes"]:
            raise CheckpointError(f"{path} is truncated or overwritten: {size} bytes, the "
                                  f"index recorded {record['bytes']}")
        if self.verify and file_digest(path)["sha256"] != record["sha256"]:
            raise CheckpointError(f"{path} is corrupted: its SHA-256 differs from the one "
                                  "recorded when it was written")
        return path

    def open(self, name: str) -> Any:
        if name not in self._open:
            path = self.check(name)
            try:
                self._open[name] = safe_open(str(path), framework="pt")
            except (SafetensorError, OSError) as exc:
                raise CheckpointError(f"{path} cannot be read as safetensors: {exc}") from None
        return self._open[name]
