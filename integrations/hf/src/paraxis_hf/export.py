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

The run's tokenizer goes with it (issue 34): when the checkpoint's run config names a
tokenizer directory (``data.tokenizer``, or ``--tokenizer``), it is saved into ``out``
and the config's and generation config's ``bos/eos/pad_token_id`` are set from it, so
``generate`` stops at the EOS the run trained on (a config built from Llama's defaults
says 1 and 2 whatever the tokenizer). A run on ``bytes`` has no tokenizer to copy; its
documents ended with byte 0, which becomes the EOS (no BOS, no pad). The tokenizer step
(:func:`token_source`, :func:`set_token_ids`, :func:`write_tokenizer`) is shared by any
other writer of a run's weights (a LoRA adapter directory, ``--adapter``).
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from paraxis.checkpoint.files import CheckpointError
from paraxis.checkpoint.read import read_model_tensors

__all__ = ["TokenSource", "add_export_command", "export_hf", "set_token_ids", "token_source",
           "write_tokenizer"]

_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")

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


@dataclass(frozen=True)
class TokenSource:
    """The tokenizer an export writes: its directory (None: nothing to copy), the token
    ids the model's configs take from it, and a note when it could not be found."""

    directory: Path | None
    ids: dict[str, int | None] | None
    note: str | None = None


def token_source(index: dict[str, Any], tokenizer: str | None = None) -> TokenSource:
    """What the run tokenized with: ``tokenizer`` when given, else the checkpoint's
    ``data.tokenizer`` (absent from checkpoints of ``paraxis.parallelize`` calls)."""
    name = tokenizer or (index.get("parallel_config") or {}).get("data", {}).get("tokenizer")
    if name is None:
        return TokenSource(None, None)
    if name == "bytes":  # documents were joined by byte 0 (paraxis.train.tokenize)
        return TokenSource(None, {"bos_token_id": None, "eos_token_id": 0,
                                  "pad_token_id": None})
    if not Path(name).is_dir():
        return TokenSource(None, None, f"the run's tokenizer {name} is not a directory "
                           "here: no tokenizer written and the token ids are the model "
                           "config's (give --tokenizer DIR)")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(name, local_files_only=True)
    return TokenSource(Path(name), {key: getattr(tok, key) for key in _IDS})


def set_token_ids(model: nn.Module, source: TokenSource) -> None:
    """The tokenizer's ids into the model's config and generation config."""
    for key, value in (source.ids or {}).items():
        setattr(model.config, key, value)
        if getattr(model, "generation_config", None) is not None:
            setattr(model.generation_config, key, value)


def write_tokenizer(source: TokenSource, out: str | Path) -> None:
    if source.directory is not None:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(str(source.directory),
                                      local_files_only=True).save_pretrained(str(out))


def export_hf(ckpt: str | Path, out: str | Path, *, max_shard_size: str | int = "2GB",
              verify: bool = True, tokenizer: str | None = None,
              adapter: bool = False) -> tuple[Path, TokenSource]:
    """Write checkpoint ``ckpt`` (a step directory, or its parent with ``latest``) as a
    ``save_pretrained`` directory ``out`` with the run's tokenizer (``tokenizer``
    overrides the one the run named); returns ``out`` and what was written of it.

    A LoRA run's checkpoint (peft's adapters, :mod:`paraxis_hf.lora`) is written with the
    adapters merged into the base weights (``merge_and_unload``: a plain model), or, with
    ``adapter``, as peft's adapter directory (``adapter_config.json`` and
    ``adapter_model.safetensors``) that ``PeftModel.from_pretrained(base, out)`` loads on
    the base model the run started from."""
    index, tensors = read_model_tensors(ckpt, verify=verify)
    model = _model_from(index, str(ckpt))
    peft = index.get("peft_config")
    if peft:
        model = _peft_model(model, peft, index)
    elif adapter:
        raise CheckpointError(f"{ckpt} holds no LoRA adapters (no peft_config in its "
                              "index): export it without --adapter")
    _load(model, tensors, str(ckpt))
    source = token_source(index, tokenizer)
    if peft and not adapter:  # B A * scaling added into each base weight
        model = model.merge_and_unload()
    set_token_ids(model.get_base_model() if adapter else model, source)
    model.save_pretrained(str(out), **({} if adapter else {"max_shard_size": max_shard_size}))
    write_tokenizer(source, out)
    return Path(out), source


def _load(model: nn.Module, tensors: dict[str, torch.Tensor], ckpt: str) -> None:
    """Every tensor of the checkpoint into ``model``'s parameter of that name."""
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


def _peft_model(model: nn.Module, configs: dict[str, Any], index: dict[str, Any]) -> Any:
    """``model`` wrapped by peft as the run's was (its adapter configs, recorded in the
    checkpoint's index), its base recorded as the run's ``model.pretrained``."""
    try:
        from peft import PeftConfig, get_peft_model
    except ImportError:
        raise CheckpointError("the checkpoint holds LoRA adapters; exporting them needs "
                              "peft: pip install 'paraxis-hf[peft]'") from None
    (name, found), = configs.items()
    config = PeftConfig.from_peft_type(**found)
    config.inference_mode = False
    pretrained = (index.get("parallel_config") or {}).get("model", {}).get("pretrained")
    config.base_model_name_or_path = pretrained or config.base_model_name_or_path
    return get_peft_model(model, config, adapter_name=name)


def _cmd(args: argparse.Namespace) -> int:
    """Write a checkpoint as a Hugging Face save_pretrained directory."""
    try:
        path, source = export_hf(args.ckpt, args.out, max_shard_size=args.max_shard_size,
                                 verify=not args.no_verify, tokenizer=args.tokenizer,
                                 adapter=args.adapter)
    except (CheckpointError, OSError) as exc:
        print(f"paraxis checkpoint export-hf: {exc}", file=sys.stderr)
        return 1
    if source.note:
        print(f"paraxis checkpoint export-hf: warning: {source.note}", file=sys.stderr)
    ids = ", ".join(f"{k.removesuffix('_token_id')} {v}" for k, v in (source.ids or {}).items())
    with_tok = f" with its tokenizer ({ids})" if source.directory else \
        f" (token ids: {ids})" if ids else ""
    load = (f"PeftModel.from_pretrained(base, {str(path)!r})" if args.adapter
            else f"AutoModelForCausalLM.from_pretrained({str(path)!r})")
    print(f"wrote {path}{with_tok} ({load})")
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
    cmd.add_argument("--tokenizer", default=None,
                     help="the tokenizer directory to write with it (default: the run's "
                          "data.tokenizer, when it is a directory)")
    cmd.add_argument("--adapter", action="store_true",
                     help="a LoRA run: write its adapters as a peft adapter directory "
                          "(adapter_config.json, adapter_model.safetensors) instead of "
                          "the model with the adapters merged")
    cmd.set_defaults(func=_cmd)
