"""The model's own side of the parity probe (:mod:`paraxis.engine.probe`): its loss on the
probe batch, the norm of every parameter's gradient, and its own router loss per global
microbatch where it has one, computed on the whole model in one process before any axis
applies; and the rules for when that run may be in train mode."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from paraxis.engine.loss import causal_lm_loss_sum
from paraxis.parallel.batch import shift_labels

if TYPE_CHECKING:
    from paraxis.config.parallel import ParallelConfig

__all__ = ["OwnObjective", "dropout_free", "global_microbatches", "own_router_coef",
           "probe_rng", "whole_norm"]

@contextmanager
def probe_rng(fork: bool) -> Iterator[None]:
    """Fork (and afterwards restore) the random generators if ``fork``: a train-mode
    probe must leave the training stream where it was."""
    if not fork:
        yield
        return
    with torch.random.fork_rng(devices=[]):
        yield


def dropout_free(model: nn.Module) -> bool:
    """Every dropout probability of ``model`` is 0: its ``nn.Dropout`` modules and its
    config's numbers named ``*dropout*`` or ``*_prob`` (functional dropouts read them)."""
    if any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p for m in model.modules()):
        return False
    config = getattr(model, "config", None)
    values = config.to_dict() if hasattr(config, "to_dict") else {}
    return not any(isinstance(v, float) and v and ("dropout" in k or k.endswith("_prob"))
                   for k, v in values.items())


def global_microbatches(rows: int, shards: int, microbatches: int) -> list[torch.Tensor]:
    """The probe batch's rows of each global microbatch: microbatch ``i`` of every one of
    the ``shards`` ranks with distinct samples (each holds ``rows / shards`` consecutive
    rows, cut into ``microbatches`` consecutive chunks by the engine)."""
    per = rows // shards
    size = per // microbatches
    return [torch.tensor([r * per + i * size + j for r in range(shards) for j in range(size)])
            for i in range(microbatches)]


def own_router_coef(model: nn.Module, config: ParallelConfig) -> tuple[float | None, str]:
    """The coefficient the reference weights the model's own router loss by, and what
    the probe says of it: ``moe.aux_loss_coef`` where the run overrides the model's,
    else the one the model's own loss multiplies by (its ``router_aux_loss_coef``,
    JetMoE's ``aux_loss_coef``). None where the reference cannot hold what the engine
    trains (a z-loss, which no model computes; no coefficient of the model's own)."""
    moe = config.moe
    if moe.z_loss_coef:
        return None, (f"router losses left out: moe.z_loss_coef={moe.z_loss_coef} and the "
                      "model computes no z-loss of its own")
    if moe.aux_loss_coef is not None:
        return float(moe.aux_loss_coef), f"router loss: the model's own at {moe.aux_loss_coef}"
    for key in ("router_aux_loss_coef", "aux_loss_coef"):
        value = getattr(model, key, None)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value), f"router loss: the model's own at {key}={value}"
    return None, "router loss left out: the model has no router_aux_loss_coef of its own"


def whole_norm(norms: dict[str, float]) -> float:
    return math.sqrt(sum(n * n for n in norms.values()))


@dataclass(frozen=True)
class OwnObjective:
    """The model's own objective on the probe batch: the mean next-token loss over the
    whole batch plus, with ``coef``, the model's router loss averaged over the global
    microbatches ``groups`` (the engine averages it over microbatches), as the model's
    own loss weights it (``output_router_logits=True``: its ``aux_loss``)."""

    forward_kwargs: dict[str, Any]
    groups: list[torch.Tensor]  # rows of each global microbatch
    coef: float

    def run(self, model: nn.Module, ids: torch.Tensor, *, train_mode: bool,
            ) -> tuple[float, dict[str, float], dict[str, float] | None, str]:
        """The mean loss; each parameter's gradient norm by name (0 for a parameter the
        loss does not reach) of the language-model loss alone, and with the model's own
        router loss added (None without ``coef``, or where the model computes none), and
        why none (""). Modes and gradients are restored after."""
        loss, bare = _loss_and_norms(model, self.forward_kwargs, [ids], 0.0,
                                     train_mode=train_mode)
        if not self.coef:
            return loss, bare, None, ""
        try:
            _, with_router = _loss_and_norms(model, self.forward_kwargs,
                                             [ids[rows] for rows in self.groups], self.coef,
                                             train_mode=train_mode)
        except _NoOwnRouterLoss as exc:
            return loss, bare, None, str(exc)
        except Exception as exc:  # the language-model half ran: compared without it
            first = (str(exc).strip().splitlines() or [""])[0][:200]
            return loss, bare, None, (f"the model's forward with output_router_logits=True "
                                      f"raised {type(exc).__name__}: {first}")
        return loss, bare, with_router, ""


class _NoOwnRouterLoss(Exception):
    """The model's forward computes no router loss to compare with."""


def _loss_and_norms(model: nn.Module, forward_kwargs: dict[str, Any],
                    forwards: list[torch.Tensor], coef: float, *,
                    train_mode: bool) -> tuple[float, dict[str, float]]:
    """One forward per tensor of token ids in ``forwards``; the mean loss over all of
    them plus ``coef`` x the mean of their ``aux_loss`` (none without ``coef``), and
    each parameter's gradient norm of that."""
    device = next(model.parameters()).device
    modes = {m: m.training for m in model.modules()}
    model.train(train_mode)
    kwargs = {**forward_kwargs, **({"output_router_logits": True} if coef else {})}
    try:
        with probe_rng(train_mode):
            loss_sum, count, aux = torch.zeros((), device=device), 0, []
            for part in forwards:
                out = _forward(model, part.to(device), kwargs)
                logits = out.logits if hasattr(out, "logits") else out
                s, n = causal_lm_loss_sum(logits, shift_labels(part).to(device))
                loss_sum, count = loss_sum + s, count + n
                if coef:
                    aux.append(_own_aux_loss(out))
            loss = loss_sum / max(count, 1)
            objective = loss + coef * torch.stack(aux).mean() if aux else loss
            objective.backward()
        norms = {name: float(p.grad.double().norm()) if p.grad is not None else 0.0
                 for name, p in model.named_parameters() if p.requires_grad}
    finally:
        model.zero_grad(set_to_none=True)
        for m, mode in modes.items():
            m.train(mode)
    return float(loss.detach()), norms


def _forward(model: nn.Module, ids: torch.Tensor, kwargs: dict[str, Any]) -> Any:
    try:
        return model(ids, **kwargs)
    except TypeError as exc:
        if "output_router_logits" in kwargs and "output_router_logits" in str(exc):
            raise _NoOwnRouterLoss("the model's forward takes no output_router_logits") \
                from exc
        raise


def _own_aux_loss(out: Any) -> torch.Tensor:
    aux = getattr(out, "aux_loss", None)
    if not torch.is_tensor(aux):
        raise _NoOwnRouterLoss("the model returns no aux_loss with output_router_logits=True")
    return aux
