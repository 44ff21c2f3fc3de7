"""``paraxis checkpoint export-hf CKPT OUT``: a paraxis checkpoint of a transformers model,
written on any grid, as a ``save_pretrained`` directory.

Core assembles every model tensor whole from its shards
(:func:`paraxis.checkpoint.read.read_model_tensors`: tensor shards and padded vocabularies,
pipeline stages, experts on their ranks, ZeRO shards); the blocks of a packed dimension
(``#partK``) are joined along the dimension where the model's parameter is ``K`` times
their size. The model is rebuilt from the config the checkpoint recorded, loaded (a word
embedding tied to the head is stored once and tied again by the model) and written by
transformers' own ``save_pretrained``: config, generation config, safetensors, and a
sharded index above ``max_shard_size``.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from paraxis.checkpoint.files import CheckpointError
from paraxis.checkpoint.read import read_model_tensors

__all__ = ["add_export_command", "export_hf"]

_PART = re.compile(r"^(.*)#part(\d+)$")


def _join_parts(tensors: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]],
                ) -> dict[str, torch.Tensor]:
    parts: dict[str, dict[int, torch.Tensor]] = {}
    out = {}
    for key, t in tensors.items():
        m = _PART.match(key)
        if m:
            parts.setdefault(m.group(1), {})[int(m.group(2))] = t
        else:
            out[key] = t
    for name, blocks in parts.items():
        ordered = [blocks[k] for k in sorted(blocks)]
        want = shapes.get(name)
        dims = [d for d, n in enumerate(ordered[0].shape)
                if want is not None and n * len(ordered) == want[d]]
        if want is None or not dims:
            raise CheckpointError(f"{name}: {len(ordered)} packed blocks of shape "
                                  f"{list(ordered[0].shape)} do not make the model's "
                                  f"{list(want) if want else 'parameter (none)'}")
        out[name] = torch.cat(ordered, dim=dims[0])
    return out


def _model_from(index: dict[str, Any], ckpt: str) -> nn.Module:
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    cfg = dict(index.get("model_config") or {})
    model_type = cfg.get("model_type")
    if model_type not in CONFIG_MAPPING:
        raise CheckpointError(f"{ckpt} holds a model of type {model_type!r}, not a "
                              "transformers causal LM: export-hf has no config to write")
    config = CONFIG_MAPPING[model_type].from_dict(cfg)
    return AutoModelForCausalLM.from_config(config)


def export_hf(ckpt: str | Path, out: str | Path, *, max_shard_size: str | int = "2GB",
              verify: bool = True) -> Path:
    """Write checkpoint ``ckpt`` (a step directory, or its parent with ``latest``) as a
    ``save_pretrained`` directory ``out``; returns ``out``."""
    index, tensors = read_model_tensors(ckpt, verify=verify)
    model = _model_from(index, str(ckpt))
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    tensors = _join_parts(tensors, shapes)
    with torch.no_grad():
        unknown = sorted(set(tensors) - set(shapes))
        missing = sorted(set(shapes) - set(tensors))  # named_parameters: tied ones once
        if unknown or missing:
            raise CheckpointError(f"{ckpt} does not match the model its config builds: "
                                  f"unknown {unknown[:3]}, missing {missing[:3]}")
        params = dict(model.named_parameters())
        for name, t in tensors.items():
            if tuple(t.shape) != shapes[name]:
                raise CheckpointError(f"{ckpt}: {name} has shape {list(t.shape)}, the "
                                      f"model's is {list(shapes[name])}")
            params[name].copy_(t)
    model.save_pretrained(str(out), max_shard_size=max_shard_size)
    return Path(out)


def _cmd(args: argparse.Namespace) -> int:
    """Write a checkpoint as a Hugging Face save_pretrained directory."""
    try:
        path = export_hf(args.ckpt, args.out, max_shard_size=args.max_shard_size,
                         verify=not args.no_verify)
    except CheckpointError as exc:
        print(f"paraxis checkpoint export-hf: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {path} (AutoModelForCausalLM.from_pretrained({str(path)!r}))")
    return 0


def add_export_command(verbs: Any) -> None:
    cmd = verbs.add_parser("export-hf", help=_cmd.__doc__)
    cmd.add_argument("ckpt", help="a checkpoint directory (or its parent with latest)")
    cmd.add_argument("out", help="the directory to write")
    cmd.add_argument("--max-shard-size", default="2GB",
                     help="safetensors files above this are split, with an index "
                          "(default 2GB)")
    cmd.add_argument("--no-verify", action="store_true",
                     help="skip the SHA-256 check of the checkpoint's files")
    cmd.set_defaults(func=_cmd)
