"""What a checkpoint holds, without loading a tensor: grid, step, versions, data
position, and every global tensor with its shards, sizes and dtypes (``paraxis
checkpoint inspect``, :mod:`paraxis.cli.checkpoint`)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

__all__ = ["describe"]


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:,.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"


_SIZES = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2, "int64": 8,
          "int32": 4, "uint8": 1, "bool": 1}


def describe(ckpt: Path, index: dict[str, Any]) -> list[str]:
    grid = index["grid"]
    degrees = " x ".join(f"{a} {d}" for a, d in grid["degrees"].items() if d > 1) or "one rank"
    lines = [f"checkpoint {ckpt}",
             f"step {index['step']}, format {index['format_version']}, "
             + ", ".join(f"{k} {v}" for k, v in index.get("versions", {}).items()),
             f"grid: {degrees} ({grid['world_size']} ranks)",
             f"data position: {index.get('data') or 'not recorded'}",
             "", f"{'tensor':<52} {'global shape':<16} {'dtype':<9} {'shards':>6} {'size':>10}"]
    for key, entry in sorted(index["tensors"].items()):
        if key.startswith("rng/"):
            continue
        shape = entry["shape"]
        size = math.prod(shape) * _SIZES.get(entry["dtype"], 4)
        lines.append(f"{key:<52} {'x'.join(map(str, shape)):<16} {entry['dtype']:<9} "
                     f"{len(entry['shards']):>6} {_bytes(size):>10}")
    names = {s["file"] for e in index["tensors"].values() for s in e["shards"]}
    total = sum((ckpt / n).stat().st_size for n in names if (ckpt / n).exists())
    checked = "with" if index.get("files") else "without (format 1)"
    lines.append(f"\n{len(names)} files, {_bytes(total)}, {checked} recorded checksums")
    return lines
