"""The optimizer step (unscale under fp16, clip on the global norm, step) and the
warmup-cosine learning-rate schedule. Which optimizer is built is
:mod:`paraxis.parallel.optimizers`; the global norm is :mod:`paraxis.parallel.norms`."""

from __future__ import annotations

import math
from typing import Any

import torch

from paraxis.engine.precision import LossScaler, unscale_and_check
from paraxis.parallel.norms import clip_grad_norm
from paraxis.parallel.optimizers import optimizer_params
from paraxis.runtime.grid import Grid

__all__ = ["WarmupCosine", "clip_and_step"]


def clip_and_step(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], *,
                  grad_clip: float, grid: Grid, scaler: LossScaler | None,
                  tracer: Any) -> float:
    """Unscale (fp16), clip on the global norm, step; return the norm before clipping,
    or nan for an fp16 step skipped on overflow, which leaves the weights as they were.

    The norm is computed in fp32 or wider whatever the gradients' dtype. An optimizer
    whose step computes the norm and clips itself (DeepSpeed's engine: norm, clipping
    and loss scaling happen inside ``engine.step``) sets ``clips_in_step = True`` and
    returns the norm from ``step()``. An optimizer over shards (ZeRO) has its own
    ``clip_grad_norm`` over what it owns."""
    if getattr(optimizer, "clips_in_step", False):
        with tracer.span("optimizer"):
            return float(optimizer.step())
    if scaler is not None:
        with tracer.span("unscale"):
            overflow = unscale_and_check(optimizer_params(optimizer), 1.0 / scaler.scale,
                                         grid)
        scaler.update(overflow)
        if overflow:
            return math.nan
    with tracer.span("clip_grad_norm"):
        clip = getattr(optimizer, "clip_grad_norm", None)
        norm = clip(grad_clip) if clip is not None else clip_grad_norm(params, grad_clip, grid)
    with tracer.span("optimizer"):
        optimizer.step()
    return norm


class WarmupCosine:
    """Linear warmup from 0 to the peak over ``warmup`` steps, then cosine decay to
    ``min_ratio`` x peak at ``total``. A plain object whose state is the step, the peaks
    and the horizon (``warmup``, ``total``).

    A resumed run keeps the horizon its checkpoint was saved with, even when
    ``train.steps`` changed: re-spreading the cosine over a longer run raises the
    learning rate at once (1.0e-4 at step 200 to 1.58e-4 at 205, issue 32). With
    ``reschedule`` it follows the new horizon instead, the schedule a run with that
    ``train.steps`` from the start would have (the rate jumps to it). Either way
    :attr:`resume_note` says in one line what the schedule does (the trainer prints it);
    None when the horizon did not change."""

    def __init__(self, optimizer: torch.optim.Optimizer, *, warmup: int, total: int,
                 min_ratio: float = 0.1, reschedule: bool = False):
        self.optimizer, self.warmup, self.total, self.min_ratio = (
            optimizer, warmup, total, min_ratio)
        self.reschedule = reschedule
        self.peaks = [g["lr"] for g in optimizer.param_groups]
        self.step_count = 0
        self.resume_note: str | None = None
        self._apply()

    def factor(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        span = max(1, self.total - self.warmup)
        progress = min(1.0, (step - self.warmup) / span)
        return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    def _apply(self) -> None:
        f = self.factor(self.step_count)
        for group, peak in zip(self.optimizer.param_groups, self.peaks, strict=True):
            group["lr"] = peak * f

    def step(self) -> None:
        self.step_count += 1
        self._apply()

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def state_dict(self) -> dict[str, object]:
        return {"step_count": self.step_count, "peaks": self.peaks, "warmup": self.warmup,
                "total": self.total}

    def load_state_dict(self, state: dict[str, object]) -> None:
        self.step_count = int(state["step_count"])  # type: ignore[call-overload]
        self.peaks = [float(x) for x in state["peaks"]]  # type: ignore[attr-defined]
        self.resume_note = self._resume(state)
        self._apply()

    def _resume(self, state: dict[str, object]) -> str | None:
        """Take the saved horizon or the configured one (``reschedule``); the line that
        says which, or None when they are the same."""
        step, total = self.step_count, self.total
        if "total" not in state:  # saved before the horizon was part of the state
            return (f"lr schedule: the checkpoint does not record its horizon (an older "
                    f"format); resuming at step {step} on train.steps = {total} "
                    f"(warmup {self.warmup}), lr {self._lr_at(step):.2e}")
        saved = (int(state["warmup"]), int(state["total"]))  # type: ignore[call-overload]
        configured = (self.warmup, total)
        if saved == configured:
            return None
        planned = self._lr_at(step)
        self.warmup, self.total = saved
        kept = self._lr_at(step)
        if self.reschedule:
            self.warmup, self.total = configured
            return (f"lr schedule re-spread from step {step} over train.steps = {total} "
                    f"(the checkpoint's ran to {saved[1]}; train.reschedule: true): lr "
                    f"{kept:.2e} -> {planned:.2e}")
        floor = " (its floor from here on)" if step >= saved[1] else ""
        return (f"lr schedule: kept the checkpoint's horizon (warmup {saved[0]}, cosine to "
                f"step {saved[1]}) though train.steps is {total}: lr {kept:.2e} at step "
                f"{step}{floor}; train.reschedule: true re-spreads it over {total}")

    def _lr_at(self, step: int) -> float:
        return self.peaks[0] * self.factor(step)
