"""``paraxis checkpoint inspect DIR [--verify]``: what a checkpoint holds, without
loading a tensor: grid, step, versions, data position, and every global tensor with its
shards, sizes and dtypes. ``--verify`` checks every file's size and SHA-256."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

from paraxis.checkpoint import resolve
from paraxis.checkpoint_files import CheckedFiles, CheckpointError, read_index

__all__ = ["add_checkpoint_commands", "describe"]


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


def _inspect(args: argparse.Namespace) -> int:
    """Show a checkpoint's grid, step, data position and tensors (--verify: checksums)."""
    try:
        ckpt = resolve(args.dir)
        index = read_index(ckpt)
        print("\n".join(describe(ckpt, index)))
        if args.verify:
            if not index.get("files"):
                raise CheckpointError(f"{ckpt} is format {index['format_version']}: it "
                                      "recorded no checksums to verify against")
            files = CheckedFiles(ckpt, index, verify=True)
            for name in sorted(index["files"]):
                files.check(name)
            print(f"verified: every file has its recorded size and SHA-256 "
                  f"({len(index['files'])} files)")
    except CheckpointError as exc:
        print(f"paraxis checkpoint inspect: {exc}", file=sys.stderr)
        return 1
    return 0


def add_checkpoint_commands(subparsers: Any, plugin_manager: Any = None) -> None:
    """``paraxis checkpoint inspect``, and the verbs plugins add
    (``paraxis_checkpoint_commands``: paraxis-hf's ``export-hf``)."""
    ckpt = subparsers.add_parser("checkpoint", help="inspect or convert checkpoints")
    verbs = ckpt.add_subparsers(dest="verb", required=True)
    if plugin_manager is not None:
        plugin_manager.hook.paraxis_checkpoint_commands(verbs=verbs)
    inspect = verbs.add_parser("inspect", help=_inspect.__doc__)
    inspect.add_argument("dir", help="a checkpoint directory (or its parent with latest)")
    inspect.add_argument("--verify", action="store_true",
                         help="check every file's size and SHA-256")
    inspect.set_defaults(func=_inspect)
