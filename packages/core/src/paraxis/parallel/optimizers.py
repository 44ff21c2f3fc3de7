"""The optimizer ``train.optimizer`` names, built over whatever parameters an axis owns.

Core builds it over the model's parameters; ZeRO builds the same class over its shards
(the ``build_optimizer`` hook of :class:`~paraxis.parallel.strategy.Strategy`), so the
choice reaches every layout through one function, :func:`make_optimizer`. Matrices decay
and vectors (norms, biases) do not, as in GPT-3 and Megatron.

A sharded layout (tensor parallelism, ZeRO) hands the optimizer slices: a row block of a
matrix, or a flat range of elements across several. An optimizer whose update of an
element reads only that element's gradient and state (SGD, Adam and their kin) steps a
slice exactly as it would step the whole; one that needs the whole matrix (Shampoo's
preconditioners, Muon's orthogonalization, Adafactor's row and column statistics) would
silently compute something else, so :func:`optimizer_problems` refuses it under those
layouts. A class of one's own declares ``paraxis_elementwise = True`` to be allowed.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from paraxis.config.errors import Problem
from paraxis.config.parallel import ParallelConfig
from paraxis.config.run import TrainSection

__all__ = ["ELEMENTWISE", "decay_groups", "make_optimizer", "optimizer_class",
           "optimizer_kwargs", "optimizer_params", "optimizer_problems", "optimizer_state_bytes"]

NAMED: dict[str, type[torch.optim.Optimizer]] = {
    "adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}
ELEMENTWISE: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax,
    torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adagrad, torch.optim.Adadelta,
    torch.optim.RMSprop, torch.optim.Rprop, torch.optim.ASGD)
SGD_MOMENTUM = 0.9  # "sgd" means SGD with momentum unless optimizer_kwargs says otherwise


def optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    """``adamw``, ``sgd``, or a class by import path (``torch.optim.RAdam``,
    ``package.module:Class``); ValueError saying what is wrong."""
    if name.lower() in NAMED:
        return NAMED[name.lower()]
    module, sep, attr = name.partition(":") if ":" in name else name.rpartition(".")
    if not sep or not module or not attr:
        raise ValueError(f"{name!r} is neither adamw, sgd nor an import path "
                         "(module.Class or module:Class)")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot import {name!r}: {exc}") from None
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ValueError(f"{name!r} is {cls!r}, not a torch.optim.Optimizer class")
    return cls


def optimizer_kwargs(cls: type[torch.optim.Optimizer], train: TrainSection) -> dict[str, Any]:
    """The constructor's keyword arguments: ``lr``, ``betas`` where the class takes them,
    SGD's momentum, then ``train.optimizer_kwargs`` (which win)."""
    accepted = inspect.signature(cls.__init__).parameters
    kwargs: dict[str, Any] = {"lr": train.lr}
    if "betas" in accepted:
        kwargs["betas"] = tuple(train.betas)
    if issubclass(cls, torch.optim.SGD):
        kwargs["momentum"] = SGD_MOMENTUM
    kwargs.update(train.optimizer_kwargs)
    return kwargs


def decay_groups(params: Iterable[nn.Parameter], weight_decay: float) -> list[dict[str, Any]]:
    """Matrices decay, vectors do not; empty groups left out."""
    decay, no_decay = [], []
    for p in params:
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def make_optimizer(params: Iterable[nn.Parameter], train: TrainSection,
                   cls: type[torch.optim.Optimizer] | None = None) -> torch.optim.Optimizer:
    """``train.optimizer`` (or ``cls``, a subclass an axis adds behaviour to) over
    ``params``, with decay for matrices only."""
    base = optimizer_class(train.optimizer)
    return (cls or base)(decay_groups(params, train.weight_decay),
                         **optimizer_kwargs(base, train))


def optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's parameters, each once, in group order."""
    seen: dict[int, torch.Tensor] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            seen.setdefault(id(p), p)
    return list(seen.values())


def optimizer_state_bytes(train: TrainSection) -> float:
    """Bytes of optimizer state per parameter element ``train.optimizer`` keeps (Adam 8,
    SGD with momentum 4), measured: one step of it on a small fp32 matrix, counting the
    state tensors shaped like the parameter (a step counter is not per element)."""
    p = nn.Parameter(torch.zeros(8, 8))
    p.grad = torch.ones_like(p)
    optimizer = make_optimizer([p], train)
    optimizer.step()
    state = optimizer.state.get(p, {})
    return sum(t.numel() * t.element_size() for t in state.values()
               if isinstance(t, torch.Tensor) and t.numel() == p.numel()) / p.numel()


def optimizer_problems(train: TrainSection, config: ParallelConfig) -> list[Problem]:
    """What is wrong with ``train.optimizer`` for this layout, found before any process
    group: a class that cannot be imported, keyword arguments it does not take, and an
    optimizer that needs whole matrices under a layout that hands it slices."""
    field = "train.optimizer"
    try:
        cls = optimizer_class(train.optimizer)
    except ValueError as exc:
        return [Problem(field, train.optimizer, str(exc),
                        "use adamw, sgd, or a torch.optim class by import path")]
    accepted = inspect.signature(cls.__init__).parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in accepted.values())
    unknown = sorted(k for k in optimizer_kwargs(cls, train)
                     if k not in accepted and not takes_any)
    problems = []
    if unknown:
        problems.append(Problem("train.optimizer_kwargs", train.optimizer_kwargs,
                                f"{cls.__name__} takes no {', '.join(unknown)}",
                                f"use arguments of {cls.__name__}.__init__"))
    sharded = [f"{axis} {d}" for axis, d in (("tensor", config.parallelism.tensor),)
               if d > 1] + ([f"ZeRO-{config.parallelism.zero}"]
                            if config.parallelism.zero else [])
    elementwise = issubclass(cls, ELEMENTWISE) or getattr(cls, "paraxis_elementwise", False)
    if sharded and not elementwise:
        problems.append(Problem(
            field, train.optimizer,
            f"{cls.__name__} is not known to update each element from that element "
            f"alone, and {' and '.join(sharded)} hand it slices of matrices: an optimizer "
            "that needs whole matrices (Shampoo, Muon, Adafactor) would compute "
            "something else on them",
            "train without tensor parallelism and ZeRO, or set paraxis_elementwise = True "
            "on a class whose update is elementwise"))
    return problems
