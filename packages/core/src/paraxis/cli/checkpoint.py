"""``paraxis checkpoint inspect DIR [--verify]`` and the verbs plugins add under
``paraxis checkpoint`` (``paraxis_checkpoint_commands``: paraxis-hf's ``export-hf``)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from paraxis.checkpoint.files import CheckedFiles, CheckpointError, read_index
from paraxis.checkpoint.format import resolve
from paraxis.checkpoint.inspect import describe

__all__ = ["add_checkpoint_commands"]


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
                files.check(name, whole=True)
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
