"""What ``paraxis validate`` and ``paraxis train`` check of the model before any rank
starts (issue 38, item 5).

A run that starts from ``model.pretrained`` or resumes from ``train.checkpoint_dir``
builds its model here once, on the meta device as a rank builds it, and holds it
against what the ranks would load it from: the pretrained directory's weights (its
loader's own :meth:`problems`, paraxis-hf's) and the checkpoint's index
(:func:`paraxis.checkpoint.read.check_model`, the check a rank makes when it loads).
Each failure is a :class:`~paraxis.config.errors.Problem` on the field that named the
source, reported with the configuration's others; before this, an empty pretrained
directory passed ``validate`` and a checkpoint of another model was found only once
every rank had started. A run with neither builds nothing here.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from paraxis.checkpoint.files import CheckpointError, read_index
from paraxis.checkpoint.format import resolve
from paraxis.checkpoint.read import check_model
from paraxis.config.errors import ConfigError, Problem
from paraxis.config.run import RunConfig
from paraxis.parallel.placement import record_replicated
from paraxis.parallel.strategy import MATERIALIZE_ATTR

__all__ = ["meta_model", "model_problems", "resume_dir", "saved_model_config",
           "warm_workers"]


def resume_dir(cfg: RunConfig) -> Path | None:
    """The checkpoint directory the run resumes from, or None (the rule ``train.loop``
    follows: ``train.resume`` and a ``latest`` in ``train.checkpoint_dir``)."""
    ckpt = cfg.train.checkpoint_dir
    if ckpt and cfg.train.resume and (Path(ckpt) / "latest").exists():
        return Path(ckpt)
    return None


def saved_model_config(cfg: RunConfig) -> dict[str, Any]:
    """``model.pretrained``'s ``config.json`` as plain JSON (the model's shape, checked
    with the layout's rules before anything is built), or {} when there is none."""
    path = Path(cfg.model.pretrained or "") / "config.json"
    if not cfg.model.pretrained or not path.is_file():
        return {}
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # the loader names it (model_problems)
    return saved if isinstance(saved, dict) else {}


def meta_model(cfg: RunConfig, plugin_manager: Any, vocab_size: int,
               lora: Any = None) -> nn.Module:
    """The run's model as a rank builds it (:func:`paraxis.train.build.build_model`,
    deferred; with ``lora``, the run's ``lora`` section, wrapped as it is), every
    parameter on the meta device, each with its replicated placement record (the global
    names and shapes a checkpoint holds)."""
    from paraxis.train.build import build_model, model_spec

    with torch.device("meta"):  # a family built whole allocates nothing either
        model = build_model(model_spec(cfg, vocab_size), plugin_manager,
                            seed=cfg.train.seed, deferred=True, lora=lora)
    record_replicated(model, cfg.axis_table)
    return model


def model_problems(cfg: RunConfig, plugin_manager: Any, vocab_size: Callable[[], int]
                   ) -> list[Problem]:
    """Every problem of ``model.pretrained`` and of the checkpoint the run would resume
    from, found on the meta-device model (nothing is built without either; ``vocab_size``
    is asked only then: the tokenizer's, for a ``tiny`` model)."""
    pretrained, ckpt = cfg.model.pretrained, resume_dir(cfg)
    if not pretrained and ckpt is None:
        return []
    if pretrained and not Path(pretrained).is_dir():
        return [Problem("model.pretrained", pretrained, "is not a directory",
                        "give the directory save_pretrained wrote")]
    index, step = None, None
    if ckpt is not None:
        try:
            step = resolve(ckpt)
            index = read_index(step)
        except CheckpointError as exc:
            return [_checkpoint_problem(cfg, f"cannot be resumed from: {exc}")]
    try:
        model = meta_model(cfg, plugin_manager, vocab_size())
    except ConfigError as exc:  # paraxis-hf's refusals of a pretrained directory
        return exc.problems
    except Exception as exc:  # what every rank would raise when it builds the model
        return [Problem("model" if not pretrained else "model.pretrained",
                        pretrained or cfg.model.family, f"cannot be built "
                        f"({type(exc).__name__}: {_first_line(exc)})",
                        "correct the model section (a rank would fail the same way)")]
    problems = []
    check = getattr(getattr(model, MATERIALIZE_ATTR, None), "problems", None)
    if pretrained and check is not None:
        wrong = check(model)
        if wrong:
            more = f" (and {len(wrong) - 4} more)" if len(wrong) > 4 else ""
            problems.append(Problem(
                "model.pretrained", pretrained, "holds the weights of another model: "
                f"{'; '.join(wrong[:4])}{more}", "give this model's weights, or set "
                "model.config to the saved model's shape"))
    if index is not None and step is not None:
        try:  # a LoRA run's checkpoint holds the names peft gives (issue 34)
            if cfg.lora is not None:
                model = meta_model(cfg, plugin_manager, vocab_size(), cfg.lora)
            check_model(index, model, step)
        except CheckpointError as exc:
            problems.append(_checkpoint_problem(cfg, str(exc)))
        except ConfigError:  # a lora section that cannot apply: lora_problems says why
            pass
    return problems


def _checkpoint_problem(cfg: RunConfig, why: str) -> Problem:
    return Problem("train.checkpoint_dir", cfg.train.checkpoint_dir, why,
                   "point train.checkpoint_dir at this run's checkpoints or at a new "
                   "directory (train.resume=false starts over without reading it)")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def warm_workers(cfg: RunConfig, plugin_manager: Any) -> None:
    """What every rank does alike before it trains, done once in the launcher before
    the workers are forked from it (:mod:`paraxis.train.forked`): the plugins' own
    (``paraxis_before_workers``: W&B's service), the model's modules imported (its
    meta-device build, discarded), the tokenizer loaded, and an in-memory corpus
    tokenized and packed (:func:`paraxis.train.data.prepack`)."""
    from paraxis.train.data import load_tokenizer, prepack

    plugin_manager.hook.paraxis_before_workers(config=cfg)
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    meta_model(cfg, plugin_manager, tokenizer.vocab_size)
    data, seq = cfg.data, cfg.train.seq_length
    if data.packing and not data.streaming:  # what paraxis.train.sources packs
        prepack(data, seq, tokenizer)
    if data.eval.source:
        prepack(data.model_copy(update={"source": data.eval.source}), seq, tokenizer)
