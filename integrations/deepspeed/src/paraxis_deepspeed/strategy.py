"""The offload strategy (axis ``offload``, phase DATA): DeepSpeed's engine over the
model, with paraxis's process groups, in place of paraxis's own data or ZeRO axis.

``apply`` runs after every other axis shaped the model (tensor and sequence parallel
shard it first; DeepSpeed then partitions the tensor-local pieces over the data-parallel
group). It wraps the model and declares ``ctx.backward``. ``build_optimizer`` (which
knows the ``train`` section) translates the config (:mod:`paraxis_deepspeed.translate`),
compiles DeepSpeed's extensions with a progress notice and calls
``deepspeed.initialize`` with :class:`~paraxis_deepspeed.mpu.GridMPU`.

Gradients that another axis leaves as partial sums (``placement.partial``: norms under
sequence parallelism) are summed over that axis in a gradient hook, before DeepSpeed's
own reduction sees them; sums commute, so this equals core's order (data first, then
partial), and the synchronizers that would do it after backward (``SyncOrder.PARTIAL``)
are taken out: DeepSpeed has already moved those gradients into its partitions by then.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from paraxis.config.shape import config_size
from paraxis.parallel.placement import placement_of, set_placement
from paraxis.parallel.strategy import ApplyContext, Phase, Strategy, SyncOrder
from paraxis.runtime.collectives import all_reduce_
from paraxis_deepspeed.bridge import DeepSpeedOptimizer, OffloadedModel
from paraxis_deepspeed.mpu import GridMPU

__all__ = ["OffloadStrategy"]


class _Release:
    """Left in ``ctx.grad_syncs`` so that ``Engine.close`` releases what the bridge made
    (DeepSpeed reduces during backward: there is nothing to finish)."""

    order = SyncOrder.DATA

    def __init__(self, mpu: GridMPU):
        self.mpu, self.engine = mpu, None

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        yield  # DeepSpeed counts microbatches itself (its accumulation boundary)

    def finish(self) -> float:
        return 0.0

    def remove_hooks(self) -> None:
        if self.engine is not None:
            self.engine.destroy()
            self.engine = None
        self.mpu.destroy()


class OffloadStrategy(Strategy):
    axis = "offload"
    phase = Phase.DATA
    order = 30  # one DATA strategy applies per run: data, zero or offload

    def apply(self, model: nn.Module, ctx: ApplyContext) -> nn.Module:
        for sync in ctx.grad_syncs:
            if getattr(sync, "order", SyncOrder.DATA) != SyncOrder.PARTIAL:
                raise ValueError(f"paraxis-deepspeed: DeepSpeed owns gradient reduction, but "
                                 f"{type(sync).__name__} (order {sync.order}) would reduce "
                                 "after it; this combination of axes is not supported")
        ctx.grad_syncs.clear()
        _fix_partitioned_records(model)
        for p in model.parameters():
            rec = placement_of(p)
            if "tensor" in rec.sharded_axes:
                p.tensor_model_parallel = True  # Megatron's flag: DeepSpeed's norm reads it
            for axis in rec.partial:
                p.register_hook(_summed_over(ctx.grid.group(axis)))
        self.mpu = GridMPU(ctx.grid)
        self.release = _Release(self.mpu)
        ctx.grad_syncs.append(self.release)
        self.model = OffloadedModel(model)
        return self.model

    def build_optimizer(self, model: nn.Module, ctx: ApplyContext,
                        train: Any) -> torch.optim.Optimizer | None:
        import deepspeed

        from paraxis.config.errors import ConfigError
        from paraxis_deepspeed.memory import resident_bytes
        from paraxis_deepspeed.ops import build_ops, skip_inference_comm_op
        from paraxis_deepspeed.translate import deepspeed_config, train_problems

        problems = train_problems(train)  # checked before any rank starts by the CLI too
        if problems:
            raise ConfigError(problems)
        module = self.model.module
        shape = _hidden_size(module)
        ds_config = deepspeed_config(ctx.config, train, hidden_size=shape,
                                     pin_memory=torch.cuda.is_available())
        logging = ctx.grid.rank == ctx.grid.logging_rank
        build_ops(_say if logging else None)
        skip_inference_comm_op()
        groups = _adamw_groups(module, train.weight_decay, train.lr, train.betas)
        engine, _, _, _ = deepspeed.initialize(model=module, model_parameters=groups,
                                               config=ds_config, mpu=self.mpu,
                                               dist_init_required=False)
        self.release.engine = engine
        optimizer = DeepSpeedOptimizer(engine, self.model, groups)
        ctx.backward = optimizer.backward
        ctx.step_hooks.append(lambda: resident_bytes(engine))
        ctx.extras["offload"] = {"deepspeed_config": ds_config, "engine": engine}
        return optimizer  # type: ignore[return-value]


def _say(message: str) -> None:
    print(message, flush=True)


def _summed_over(group: Any) -> Any:
    """A gradient hook summing a partial gradient over ``group`` (per microbatch)."""
    def hook(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        all_reduce_(grad, group)
        return grad
    return hook


def _fix_partitioned_records(model: nn.Module) -> None:
    """A model constructed under ``deepspeed.zero.Init`` holds empty partitions, so core
    recorded their local shape; record each parameter's real shape (``ds_shape``) while
    it is gathered, one parameter at a time."""
    import_needed = any(hasattr(p, "ds_shape") for p in model.parameters())
    if not import_needed:
        return
    import deepspeed

    for p in model.parameters():
        rec = placement_of(p)
        if hasattr(p, "ds_shape") and rec.global_shape != tuple(p.ds_shape):
            with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
                set_placement(p, dataclasses.replace(rec, global_shape=tuple(p.shape)))


def _hidden_size(module: nn.Module) -> int | None:
    value = config_size(getattr(module, "config", None), "hidden_size")
    return value if isinstance(value, int) else None


def _adamw_groups(module: nn.Module, weight_decay: float, lr: float,
                  betas: tuple[float, float]) -> list[dict[str, Any]]:
    """Core's AdamW groups (matrices decay, vectors do not: GPT-3 / Megatron), so a
    checkpoint's groups match a run without the bridge."""
    decay, no_decay = [], []
    for p in module.parameters():
        if p.requires_grad:
            shape = getattr(p, "ds_shape", p.shape)
            (decay if len(shape) >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay, "lr": lr, "betas": betas},
              {"params": no_decay, "weight_decay": 0.0, "lr": lr, "betas": betas}]
    return [g for g in groups if g["params"]]
