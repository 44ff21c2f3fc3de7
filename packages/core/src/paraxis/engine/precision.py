"""Training precision: what the forward computes in, and fp16's dynamic loss scaling.

paraxis keeps the model's parameters in fp32 under every ``train.precision``: they are
the master weights, and their gradients, accumulated over microbatches by autograd, are
the fp32 main gradients Megatron keeps beside bf16 weights. bf16 and fp16 run the
forward under ``torch.autocast``, which casts each weight to the low dtype where a
matmul uses it, so activations, and the tensor, sequence, context, expert and pipeline
traffic made of them, are bf16 (fp16). This is torchtitan's policy through FSDP2
(``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``: sharded parameters fp32,
compute copies bf16) rather than Megatron's bf16 parameters with a separate fp32 copy in
the optimizer; model state costs the same 16 bytes per parameter with Adam (4 weight, 4
gradient, 8 moments) against Megatron's 18 (2 + 4 main gradient + 12), and ZeRO shards
the same three parts. What travels on the data and ZeRO reductions is
``parallelism.reduce_dtype`` (fp32, or bf16 for half the bytes).

fp16's range is narrow (smallest normal 6e-5), so small gradients underflow unless the
loss is scaled up before backward (Micikevicius et al., arXiv:1710.03740).
:class:`LossScaler` is the dynamic scheme of torch's ``GradScaler`` and Megatron's
``DynamicGradScaler``, with one difference that matters across a grid: the inf/nan
verdict is one all-reduce over every rank, so an overflow on one tensor or pipeline
rank skips the step on all of them, and no rank's weights leave the others'.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch

from paraxis.config.errors import Problem
from paraxis.config.run import LossScaling, TrainSection
from paraxis.runtime.collectives import all_reduce_
from paraxis.runtime.grid import Grid

__all__ = ["AUTOCAST_DTYPES", "LossScaler", "autocast", "precision_problems",
           "unscale_and_check"]

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """The forward's autocast region for ``precision`` (none for fp32)."""
    dtype = AUTOCAST_DTYPES.get(precision)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def precision_problems(train: TrainSection, optimizer: Any = None) -> list[Problem]:
    """What this machine or ``optimizer`` (one passed to ``parallelize``) cannot do with
    ``train.precision``, found before any process group."""
    problems = []
    if (train.precision == "bf16" and torch.cuda.is_available()
            and not torch.cuda.is_bf16_supported()):
        problems.append(Problem("train.precision", "bf16",
                                f"{torch.cuda.get_device_name()} has no bf16 arithmetic",
                                "use precision: fp16 (with loss scaling) or fp32"))
    if train.precision == "fp16" and getattr(optimizer, "clips_in_step", False) and \
            not getattr(optimizer, "scales_loss", False):
        problems.append(Problem(
            "train.precision", "fp16",
            f"the optimizer given ({type(optimizer).__name__}) runs its own step, so the "
            "engine cannot skip an overflowed step, and it scales no loss itself",
            "let paraxis build the optimizer, or use precision: bf16"))
    return problems


@torch.no_grad()
def unscale_and_check(params: list[torch.Tensor], inv_scale: float, grid: Grid) -> bool:
    """Multiply every gradient of ``params`` by ``inv_scale`` and return whether any
    rank of ``grid`` holds an inf or nan among its gradients (one MAX all-reduce over the
    whole grid, so every rank returns the same verdict). Collective."""
    grads = [p.grad for p in params if p.grad is not None]
    device = grads[0].device if grads else torch.device("cpu")
    found = torch.zeros(1, dtype=torch.float32, device=device)
    if grads:
        # torch's fused kernel (the one GradScaler uses): scales in place and sets
        # ``found`` where an element is not finite.
        torch._amp_foreach_non_finite_check_and_unscale_(
            grads, found, torch.full((1,), inv_scale, dtype=torch.float32, device=device))
    all_reduce_(found, grid.world, op=torch.distributed.ReduceOp.MAX)
    return bool(found.item() > 0)


class LossScaler:
    """The current fp16 loss scale and its schedule (:class:`LossScaling`); its state
    (scale, clean steps in a row, steps skipped) goes into checkpoints."""

    def __init__(self, cfg: LossScaling):
        self.cfg = cfg
        self.scale = float(cfg.initial)
        self.clean_steps = 0  # since the last overflow or growth
        self.skipped = 0  # over the whole run

    def update(self, overflow: bool) -> None:
        """After a step: back off (and count a skip) on overflow, else maybe grow."""
        if overflow:
            self.scale = max(self.cfg.min_scale, self.scale * self.cfg.backoff_factor)
            self.clean_steps = 0
            self.skipped += 1
            return
        self.clean_steps += 1
        if self.clean_steps >= self.cfg.growth_interval:
            grown = self.scale * self.cfg.growth_factor
            if math.isfinite(grown):
                self.scale = grown
            self.clean_steps = 0

    def metrics(self) -> dict[str, float]:
        return {"loss_scale": self.scale, "skipped_steps": float(self.skipped)}

    def state_dict(self) -> dict[str, float]:
        return {"scale": self.scale, "clean_steps": self.clean_steps,
                "skipped": self.skipped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
        self.skipped = int(state["skipped"])
