"""Pipeline stages that run the model's own code.

A stage is the model itself with what it does not own taken out, so that masks, rotary
positions, NoPE and sliding-window layers, softcapping and embedding scales all stay the
model's (a stage that re-implements a family's forward is right on the families it was
written for and silently wrong on the next):

* layers of other stages become :class:`SkipLayer` (returns its hidden-state input), so
  the model's own loop, and any per-layer index it keeps, run unchanged;
* on stages after the first the token embedding becomes :class:`Absent` and the stage is
  fed the previous stage's hidden states as ``inputs_embeds``, which the model accepts
  in place of ids; other modules the plan puts before the layers (embedding dropout)
  become Identity, since they already ran on the first stage;
* on stages before the last, the modules after the layers (final norm) become Identity,
  the head :class:`Absent`, and the stage returns the base model's hidden states.

How to call a model for its logits and for its hidden states is the one thing an
integration supplies (a :class:`StageCalls`, from the ``paraxis_stage_calls`` hook).
:func:`check_stages` composes every stage on one rank, with no communication, and
compares the result with the whole model's logits: a family whose forward computes
something across layers that a stage cannot see is refused before training, with the
reason, instead of trained wrongly.
"""

from __future__ import annotations

import contextlib
import copy
import types
import warnings
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from paraxis.parallel.anatomy import Anatomy
from paraxis.parallel.model_plan import PlanError
from paraxis.parallel.standins import Absent, SkipLayer

__all__ = [
    "PipelineChunks",
    "StageCalls",
    "StageParityError",
    "build_stage",
    "check_stages",
    "chunks_of",
    "tied_parameters",
]


class StageParityError(PlanError):
    """The stage check found the stages doing something else than the model (a crash,
    other logits): a defect nobody diagnosed, not a feature a plan declines. The
    coverage matrix counts it as a failure; a known cause belongs in the plan's
    ``unsupported`` (refused at preflight with the cause in words)."""


class StageCalls(Protocol):
    """How to run a model: for logits (the last stage) and for the hidden states after
    its layers (the others). Keyword arguments are the model's: ``input_ids`` or
    ``inputs_embeds``, ``position_ids``, and the plan's forward kwargs."""

    def logits(self, model: nn.Module, **kwargs: Any) -> torch.Tensor: ...

    def hidden(self, model: nn.Module, **kwargs: Any) -> torch.Tensor: ...


def _shallow(module: nn.Module) -> nn.Module:
    """A new module object sharing parameters and children with ``module``, whose child
    table and hooks are its own (so replacing a child or adding a hook touches only it)."""
    new = copy.copy(module)
    for key, value in list(vars(module).items()):
        if key.startswith("_") and isinstance(value, dict):
            setattr(new, key, type(value)(value))
    return new


def _replace(root: nn.Module, name: str, new: nn.Module, copied: dict[str, nn.Module],
             in_place: bool) -> None:
    """Set the submodule ``name`` of ``root`` to ``new``, copying its ancestors first
    unless ``in_place`` (``copied`` remembers the copies, by path)."""
    parts = name.split(".")
    parent, path = root, ""
    for part in parts[:-1]:
        path = f"{path}.{part}" if path else part
        if not in_place and path not in copied:
            copied[path] = _shallow(getattr(parent, part))
            setattr(parent, part, copied[path])
        parent = copied.get(path) or getattr(parent, part)
    setattr(parent, parts[-1], new)


@dataclass(frozen=True)
class _StageInfo:
    first: bool
    last: bool
    layers: tuple[int, int]
    calls: StageCalls


def _stage_forward(self: nn.Module, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    info: _StageInfo = self._paraxis_stage
    kwargs["input_ids" if info.first else "inputs_embeds"] = x
    return info.calls.logits(self, **kwargs) if info.last else info.calls.hidden(self, **kwargs)


def build_stage(model: nn.Module, anatomy: Anatomy, layers: tuple[int, int], *,
                first: bool, last: bool, calls: StageCalls, in_place: bool = False,
                ) -> nn.Module:
    """The stage of ``model`` running layers ``[a, b)`` (plus the embedding if ``first``
    and the final modules and head if ``last``). A shallow copy sharing the model's
    modules, unless ``in_place`` rewrites the model itself (one stage per rank: what it
    does not own is freed). Module names stay the model's, so plans still match."""
    stage = model if in_place else _shallow(model)
    copied: dict[str, nn.Module] = {}
    a, b = layers
    kept = nn.ModuleList(layer if a <= i < b else SkipLayer(i)
                         for i, layer in enumerate(anatomy.layer_list(model)))
    assert anatomy.layers is not None  # layer_list raised otherwise
    _replace(stage, anatomy.layers, kept, copied, in_place)
    if not first:
        if anatomy.embedding:
            _replace(stage, anatomy.embedding, Absent(anatomy.embedding), copied, in_place)
        for name in anatomy.before:
            _replace(stage, name, nn.Identity(), copied, in_place)
    if not last:
        for name in anatomy.after:
            _replace(stage, name, nn.Identity(), copied, in_place)
        if anatomy.head:
            _replace(stage, anatomy.head, Absent(anatomy.head), copied, in_place)
    stage._paraxis_stage = _StageInfo(first, last, layers, calls)
    stage.forward = types.MethodType(_stage_forward, stage)
    return stage


def tied_parameters(model: nn.Module, anatomy: Anatomy) -> list[nn.Parameter]:
    """Parameters the embedding and the head share (tied word embeddings)."""
    embedding, head = anatomy.embedding_of(model), anatomy.head_of(model)
    if embedding is None or head is None:
        return []
    held = {id(p) for p in embedding.parameters()}
    return [p for p in head.parameters() if id(p) in held]


@contextlib.contextmanager
def _evaluating(model: nn.Module) -> Any:
    modes = {m: m.training for m in model.modules()}
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for m, mode in modes.items():
            m.train(mode)


def check_stages(model: nn.Module, anatomy: Anatomy, ranges: list[tuple[int, int]],
                 calls: StageCalls, *, vocab: int, rtol: float,
                 forward_kwargs: dict[str, Any] | None = None) -> None:
    """Run a probe batch through every stage in turn, on this rank alone, and compare the
    logits with the whole model's; raise :class:`PlanError` with the reason if they
    differ by more than ``rtol`` (relative to the largest logit) or a stage fails."""
    kwargs = dict(forward_kwargs or {})
    if next(model.parameters()).is_meta:
        # A model still on the meta device (loaded slice by slice after the split) has
        # no values to run; its family's stages are checked in the test suite.
        warnings.warn(f"{type(model).__name__} is on the meta device: the pipeline "
                      "stages are not checked against its own forward", stacklevel=2)
        return
    ids = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(0))
    ids = ids.to(next(model.parameters()).device)
    name = type(model).__name__
    with _evaluating(model):
        want = calls.logits(model, input_ids=ids, **kwargs)
        x = ids
        try:
            for s, layers in enumerate(ranges):
                stage = build_stage(model, anatomy, layers, first=s == 0,
                                    last=s == len(ranges) - 1, calls=calls)
                x = stage(x, **kwargs)
        except Exception as exc:
            raise StageParityError(f"{name}: a pipeline stage cannot run this model's forward "
                            f"({type(exc).__name__}: {exc}); refusing pipeline parallelism "
                            "rather than training something else") from exc
    scale = float(want.abs().max()) or 1.0
    diff = float((x.float() - want.float()).abs().max())
    if x.shape != want.shape or diff > rtol * scale:
        raise StageParityError(
            f"{name}: its pipeline stages, fed hidden states as inputs_embeds, do not "
            f"reproduce the model's own logits (max |difference| {diff:.3g} against "
            f"{rtol * scale:.3g} allowed): its forward does something across layers "
            "or to inputs_embeds that a stage cannot see. Refusing pipeline parallelism "
            "for it rather than training something else")


class PipelineChunks(nn.ModuleList):
    """The model chunks one rank holds under an interleaved schedule, in chunk order.
    Each is a stage of the same model (same module names); axes applied after the split
    rewrite each chunk (see :func:`chunks_of`)."""


def chunks_of(model: nn.Module) -> list[nn.Module]:
    """The stages a rank holds: the chunks of a :class:`PipelineChunks`, else the model."""
    return list(model) if isinstance(model, PipelineChunks) else [model]



