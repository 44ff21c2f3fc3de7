"""The files of a checkpoint, checked before they are trusted.

Every file's size and SHA-256 go into the index when it is written, and since format 4
the SHA-256 of its safetensors header and of each tensor's data in blocks of
:data:`BLOCK` bytes from the tensor's first byte (a smaller tensor: one digest). Reading
a checkpoint checks, before safetensors sees a byte: that the index is one (and of a
format this paraxis reads), that each file it needs exists, has the recorded size and,
unless told not to, the recorded checksums of what is read: the header, then the blocks
of each tensor that the ranges this rank reads touch (a rank restoring its slices on
another grid hashes about what it reads, not every whole file it opens; a block is
hashed once). A checkpoint of format 2 or 3 has no such digests: each file it opens is
hashed whole, as before. Each failure is a :class:`CheckpointError` naming the file and
the problem, never a traceback from inside safetensors. Nothing is ever unpickled: the
index is JSON, tensors are safetensors.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from paraxis.version import __version__

__all__ = ["BLOCK", "FORMAT_VERSION", "CheckedFiles", "CheckpointError", "file_digest",
           "is_plain_name", "read_index"]

# 2: files carry size and sha256 (version 1 is still read, without those checks).
# 3: the model's persistent buffers are saved (``buffer/<name>``) and a checkpoint must
#    hold every one the model has; 1 and 2 are still read, the model keeping its own
#    buffers (paraxis.checkpoint.buffers). Bumped although a version-2 reader could parse
#    the index: it would resume without the buffers, silently training another run, so
#    it is told to upgrade instead.
# 4: files also carry the SHA-256 of their header and of each tensor's blocks
#    (``header_sha256``, ``block_bytes``, ``blocks``: key -> digests), so a reader checks
#    only what it reads; 2 and 3 are still read, hashing whole files.
FORMAT_VERSION = 4
BLOCK = 1 << 20  # bytes per digested block of a tensor: an index of ~70 bytes per MiB
_RUNS = 1 << 12  # contiguous runs listed per slice before its whole span is checked


class CheckpointError(ValueError):
    """A checkpoint (or one of its files) cannot be used; the message says which and why."""


def _safetensors_header(f: Any, size: int) -> tuple[bytes, int]:
    """The header's bytes (length prefix included) and where the data starts."""
    raw = f.read(8)
    length = int.from_bytes(raw, "little") if len(raw) == 8 else 0
    length = min(length, max(size - 8, 0))  # a damaged length: its digest fails
    return raw + f.read(length), 8 + length


def file_digest(path: Path) -> dict[str, Any]:
    """Size and SHA-256 of a safetensors file, with its header's and every tensor's
    per-block SHA-256, as the index records them (one pass over the file)."""
    whole, size, blocks = hashlib.sha256(), path.stat().st_size, {}
    with open(path, "rb") as f:
        header, start = _safetensors_header(f, size)
        whole.update(header)
        tensors = sorted((v["data_offsets"], k) for k, v in json.loads(header[8:]).items()
                         if k != "__metadata__")
        at = start
        for (begin, end), key in tensors:
            if start + begin < at:
                raise ValueError(f"{path}: {key} overlaps the tensor before it")
            whole.update(f.read(start + begin - at))  # a gap (safetensors leaves none)
            digests = []
            for a in range(begin, max(end, begin + 1), BLOCK):
                data = f.read(min(BLOCK, end - a))
                whole.update(data)
                digests.append(hashlib.sha256(data).hexdigest())
            blocks[key], at = digests, start + end
        while rest := f.read(BLOCK):
            whole.update(rest)
    return {"bytes": size, "sha256": whole.hexdigest(),
            "header_sha256": hashlib.sha256(header).hexdigest(), "block_bytes": BLOCK,
            "blocks": blocks}


def _byte_runs(shape: list[int], block: tuple[slice, ...], elem: int) -> list[tuple[int, int]]:
    """The contiguous byte ranges (from the tensor's first byte) that ``block`` (a slice
    per leading dim) of a row-major tensor of ``shape`` spans; past :data:`_RUNS` of
    them, their whole span."""
    bounds = [s.indices(n)[:2] for s, n in zip(block, shape, strict=False)]
    src = [*bounds, *((0, n) for n in shape[len(bounds):])]
    if any(a >= b for a, b in src):
        return []
    inner = len(shape)  # the dims from ``inner`` on are read whole
    while inner > 0 and src[inner - 1] == (0, shape[inner - 1]):
        inner -= 1
    if inner == 0:
        return [(0, math.prod(shape) * elem)]
    stride = [math.prod(shape[d + 1:]) * elem for d in range(len(shape))]
    run = (src[inner - 1][1] - src[inner - 1][0]) * stride[inner - 1]
    outer = [range(a, b) for a, b in src[:inner - 1]]
    count = math.prod(len(r) for r in outer)
    if count > _RUNS:
        first = sum(a * st for (a, _), st in zip(src, stride, strict=False))
        last = sum((b - 1) * st for (_, b), st in zip(src, stride, strict=False))
        return [(first, last + stride[-1])]
    out, base = [], src[inner - 1][0] * stride[inner - 1]
    for combo in itertools.product(*outer):
        start = base + sum(i * st for i, st in zip(combo, stride, strict=False))
        out.append((start, start + run))
    return out


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
    try:
        names = _named_files(index)
    except (AttributeError, KeyError, TypeError):
        raise CheckpointError(f"{path} is damaged: its file and tensor tables are not "
                              "what paraxis writes") from None
    for name in names:
        if not is_plain_name(name):  # ../rank00000.safetensors would read outside it
            raise CheckpointError(
                f"{path} names the file {name!r}, outside its directory: an index may "
                "name only files beside it, so it is refused; restore the checkpoint "
                "from a copy you trust")
    return index


def is_plain_name(name: object) -> bool:
    """A file name with no directory part: no separator, not ``.`` or ``..``, not empty."""
    return (isinstance(name, str) and name not in ("", ".", "..")
            and "/" not in name and "\\" not in name and "\0" not in name)


def _named_files(index: dict[str, Any]) -> list[Any]:
    """Every file name ``index`` names: the recorded files and each shard's file."""
    names = list(index.get("files") or {})
    for entry in index["tensors"].values():
        names += [shard.get("file") for shard in entry.get("shards", ())]
    return list(dict.fromkeys(names))


class CheckedFiles:
    """Opens a checkpoint's safetensors files, each checked on first use, and reads
    their tensors after checking the blocks that hold them (see the module docstring).
    ``hashed_bytes`` counts the bytes this reader hashed."""

    def __init__(self, ckpt: Path, index: dict[str, Any], *, verify: bool = True):
        self.ckpt, self.verify = ckpt, verify
        self.records: dict[str, Any] = index.get("files", {})
        self._open: dict[str, Any] = {}
        self._headers: dict[str, tuple[int, dict[str, Any]]] = {}
        self._checked: dict[tuple[str, str], set[int]] = {}
        self.hashed_bytes = 0

    def check(self, name: str, *, whole: bool = False) -> Path:
        """``name`` exists and has its recorded size; with ``verify``, its checksum
        (``whole``, or a record without blocks: the whole file's SHA-256; else its
        header's)."""
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
        if self.verify and (whole or "blocks" not in record):
            self.hashed_bytes += size
            if file_digest(path)["sha256"] != record["sha256"]:
                raise CheckpointError(f"{path} is corrupted: its SHA-256 differs from the "
                                      "one recorded when it was written")
        elif self.verify:
            self._header(name)
        return path

    def _header(self, name: str) -> tuple[int, dict[str, Any]]:
        """(first data byte, the safetensors header), its digest checked."""
        if name not in self._headers:
            path, record = self.ckpt / name, self.records[name]
            with open(path, "rb") as f:
                header, start = _safetensors_header(f, record["bytes"])
            self.hashed_bytes += len(header)
            if hashlib.sha256(header).hexdigest() != record["header_sha256"]:
                raise CheckpointError(f"{path} is corrupted: its SHA-256 differs from the "
                                      "one recorded when it was written (its header)")
            self._headers[name] = (start, json.loads(header[8:]))
        return self._headers[name]

    def _check_read(self, name: str, key: str, src: tuple[slice, ...] | None) -> None:
        """The blocks of tensor ``key`` that ``src`` (None: all of it) touches match."""
        record = self.records.get(name, {})
        if not self.verify or "blocks" not in record:
            return  # hashed whole when opened, or nothing recorded
        start, header = self._header(name)
        path, entry, digests = self.ckpt / name, header.get(key), record["blocks"].get(key)
        if entry is None:
            return  # safetensors names a missing key itself
        if digests is None:
            raise CheckpointError(f"{path}: the index records no digest of {key}")
        begin, end = entry["data_offsets"]
        shape, size = list(entry["shape"]), record["block_bytes"]
        elem = (end - begin) // max(math.prod(shape), 1)
        runs = [(0, end - begin)] if src is None else _byte_runs(shape, src, elem)
        done = self._checked.setdefault((name, key), set())
        todo = sorted({b for a, z in runs for b in range(a // size, (z - 1) // size + 1)}
                      - done)
        with open(path, "rb") as f:
            for b in todo:
                f.seek(start + begin + b * size)
                data = f.read(min(size, end - begin - b * size))
                self.hashed_bytes += len(data)
                if b >= len(digests) or hashlib.sha256(data).hexdigest() != digests[b]:
                    raise CheckpointError(
                        f"{path} is corrupted: its SHA-256 differs from the one recorded "
                        f"when it was written (block {b} of {key}, bytes "
                        f"{b * size}-{b * size + len(data)} of its data)")
                done.add(b)

    def tensor(self, name: str, key: str) -> torch.Tensor:
        """Tensor ``key`` of file ``name``, whole, its bytes checked."""
        handle = self.open(name)
        self._check_read(name, key, None)
        return handle.get_tensor(key)

    def slice(self, name: str, key: str, src: tuple[slice, ...]) -> torch.Tensor:
        """Block ``src`` of tensor ``key`` of file ``name``, the bytes it spans checked."""
        handle = self.open(name)
        self._check_read(name, key, src)
        return handle.get_slice(key)[src]

    def open(self, name: str) -> Any:
        if name not in self._open:
            path = self.check(name)
            try:
                self._open[name] = safe_open(str(path), framework="pt")
            except (SafetensorError, OSError) as exc:
                raise CheckpointError(f"{path} cannot be read as safetensors: {exc}") from None
        return self._open[name]
