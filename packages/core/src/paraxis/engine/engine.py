"""The engine: one object that owns a parallelized model's training step.

``train_step`` takes this rank's share of a global batch and does microbatching,
gradient accumulation (synchronizing only on the last microbatch), the loss, global
gradient-norm clipping, the optimizer and LR-schedule step, and returns metrics that
are identical on every rank.

The loss is the mean next-token cross-entropy over every non-ignored target of the
*global* batch: each rank divides its summed loss by the global token count (one scalar
all-reduce per step, counted after the batch transforms, so an axis that splits the
sequence does not multiply it), so ranks with different numbers of ``-100`` labels
still average exactly as a single process would. Auxiliary losses
(:mod:`paraxis.parallel.aux_losses`) are added to what is back-propagated and reported
apart. The engine is a
:class:`~paraxis.checkpoint.state.TrainState`: ``save`` and ``load`` hand it to
:mod:`paraxis.checkpoint`.
"""

from __future__ import annotations

import contextlib
import gc
import math
import time
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from paraxis.checkpoint.background import AsyncSaver
from paraxis.checkpoint.read import load_checkpoint
from paraxis.checkpoint.write import save_checkpoint
from paraxis.config.parallel import ParallelConfig
from paraxis.config.run import TrainSection
from paraxis.config.shape import ModelShape
from paraxis.engine.gradient_check import fp32_backward
from paraxis.engine.loss import causal_lm_loss_sum
from paraxis.engine.masks import MaskSupport
from paraxis.engine.metrics import Tracer, memory_stats, model_flops_per_token, step_metrics
from paraxis.engine.optim import WarmupCosine, clip_and_step
from paraxis.engine.precision import LossScaler, autocast
from paraxis.parallel.batch import Batch
from paraxis.parallel.model_plan import ModelPlan
from paraxis.parallel.strategy import ApplyContext
from paraxis.runtime.collectives import all_gather_into, all_reduce_, barrier
from paraxis.runtime.grid import Grid

__all__ = ["Engine"]


class Engine:
    """Built by :func:`paraxis.parallelize`; see the module docstring."""

    def __init__(self, model: nn.Module, *, grid: Grid, config: ParallelConfig,
                 ctx: ApplyContext, optimizer: torch.optim.Optimizer,
                 scheduler: WarmupCosine | None, train: TrainSection, plan: ModelPlan,
                 device: torch.device, model_shape: ModelShape | None = None):
        self.model, self.grid, self.config, self.ctx = model, grid, config, ctx
        self.optimizer, self.scheduler, self.train_cfg = optimizer, scheduler, train
        self.plan, self.device, self.model_shape = plan, device, model_shape
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.replicas = grid.group(grid.axes.token_axes)  # ranks with distinct tokens
        # Tensor ranks hold the same loss sum; counting those at tensor coordinate 0
        # counts every replica (and, under a pipeline, the last stage's) once.
        layout = grid.layout
        self._loss_ranks = [r for r in range(layout.size) if layout.coords(r)["tensor"] == 0]
        self.tracer = Tracer(grid.rank)
        self.step = 0
        self.stop_agreed = False  # some rank was asked to stop; all stop after this step
        self.data_state: dict[str, Any] = {}  # e.g. a BatchStream's position
        self.forward_kwargs = dict(plan.extra.get("forward_kwargs", {}))
        self.loss_fn = ctx.loss_fn or causal_lm_loss_sum
        self._flops_per_token = model_flops_per_token(model, model_shape)
        self._fp32_only = False  # the parity probe compares fp32 with fp32
        # A signal asks every rank to stop after the same step (the trainer's StopRequest;
        self.stop_request: Any = None  # the per-step all-gather carries the flag)
        self._saver: AsyncSaver | None = None  # on the first async save
        self.masks = MaskSupport(checked=False)  # what parallelize measured of the masks
        ctx.forward_context = self._precision_region  # a pipeline's forwards run in it
        # fp16's loss scale, unless the optimizer scales in its own step (DeepSpeed's).
        self.loss_scaler = LossScaler(train.loss_scale) if (
            train.precision == "fp16" and not getattr(optimizer, "clips_in_step", False)
        ) else None

    @property
    def rng_streams(self) -> Mapping[str, Any]:
        """Per-rank random streams besides torch's (the tensor-parallel dropout stream)."""
        return self.ctx.rng_streams

    # ---- steps -----------------------------------------------------------------------

    def _precision_region(self) -> contextlib.AbstractContextManager[Any]:
        # Parameters stay fp32 (the master weights); bf16/fp16 matmuls (precision.py).
        return autocast("fp32" if self._fp32_only else self.train_cfg.precision, self.device)

    def _logits(self, batch: Batch) -> torch.Tensor:
        with self._precision_region():
            out = self.model(batch.input_ids, **batch.model_kwargs(), **self.forward_kwargs)
        return out.logits if hasattr(out, "logits") else out

    def _prepare(self, batch: Any) -> tuple[Batch, torch.Tensor]:
        """This rank's Batch after every axis' transform, and the global token count."""
        batch = Batch.from_user(batch)
        self.masks.refuse(batch, self.plan.model_class)
        for transform in self.ctx.batch_transforms:
            batch = transform(batch)
        batch = batch.to(self.device)
        count = batch.tokens().to(torch.float64)
        with self.tracer.span("token_count", "comm"):
            all_reduce_(count, self.replicas)
        return batch, count

    def train_step(self, batch: Any) -> dict[str, float]:
        """One optimizer step on this rank's share of a global batch."""
        self.model.train()
        if len(self.tracer.spans) > 20_000:
            self.tracer.clear()
        comm_mark, start = self.grid.comm.mark(), time.perf_counter()
        batch, tokens = self._prepare(batch)
        microbatches = batch.chunk(self.config.schedule.microbatches)
        # Gradients are averaged over the replicas; scaling by their number makes the
        # average a sum over all tokens divided by the global count. Auxiliary parts
        # are already normalized; they are averaged over microbatches.
        # Under fp16 the whole objective is multiplied by the loss scale too.
        loss_scale = self.loss_scaler.scale if self.loss_scaler is not None else 1.0
        scale = self.replicas.size / tokens.clamp(min=1) * loss_scale
        aux_scale = self.replicas.size / len(microbatches) * loss_scale
        self.ctx.aux_losses.reset_totals()
        if self.ctx.forward_backward is not None:  # a pipeline runs its own schedule
            with self.ctx.no_sync(), self.tracer.span("pipeline_schedule"):
                total = self.ctx.forward_backward(microbatches, self.loss_fn, scale, True,
                                                  aux_scale=aux_scale)
        else:
            total = self._forward_backward(microbatches, scale, aux_scale)
        self.tracer.add("grad_sync_wait", "comm", self.ctx.finish_grad_sync())
        norm = self._clip_and_step()
        # Measured before zero_grad: gradient buffers are model state too.
        memory = memory_stats(self.model, self.optimizer, self.device,
                              tuple(self.ctx.grad_syncs))
        with self.tracer.span("optimizer"):
            self.optimizer.zero_grad(set_to_none=True)
            lr = self.optimizer.param_groups[0]["lr"]
            if self.scheduler is not None and math.isfinite(norm):  # not a skipped step
                self.scheduler.step()
        extra: dict[str, float] = {}
        for hook in self.ctx.step_hooks:
            extra.update(hook() or {})
        step_time = time.perf_counter() - start
        self.step += 1
        sums, fastest, slowest = self._reduce_step(total, step_time)
        out = step_metrics(self.grid, comm_mark, step=self.step, lr=lr, norm=norm,
                           loss=sums[0] / tokens.clamp(min=1).item(), times=(fastest, slowest),
                           tokens=batch.input_ids.numel() * self.replicas.size,
                           peak_flops=self.train_cfg.peak_flops,
                           flops_per_token=self._flops_per_token, devices=self.grid.world_size)
        out.update(memory)
        if self.loss_scaler is not None:
            out.update(self.loss_scaler.metrics())
        out.update(zip(self.ctx.aux_losses.names, sums[1:], strict=True))
        out.update(extra)
        return out

    def _clip_and_step(self) -> float:
        return clip_and_step(self.optimizer, self.params, grad_clip=self.train_cfg.grad_clip,
                             grid=self.grid, scaler=self.loss_scaler, tracer=self.tracer)

    def _reduce_step(self, total: torch.Tensor, step_time: float,
                     ) -> tuple[list[float], float, float]:
        """One all-gather over the grid for the step's loss and auxiliary-loss sums and
        the ranks' step times.

        A global sum is the sum over ranks with tensor coordinate 0 (tensor ranks hold
        the same sums; stages other than the last hold a zero loss); step time is the
        slowest rank's, and their spread shows stragglers."""
        aux = self.ctx.aux_losses
        mbs = self.config.schedule.microbatches
        stop = float(getattr(self.stop_request, "requested", None) is not None)
        mine = torch.tensor([float(total), *(aux.totals.get(n, 0.0) / mbs for n in aux.names),
                             stop, step_time], dtype=torch.float64, device=self.device)
        if self.grid.world_size == 1:
            self.stop_agreed = bool(stop)
            return mine[:-2].tolist(), step_time, step_time
        every = torch.empty((self.grid.world_size, mine.numel()), dtype=mine.dtype,
                            device=mine.device)
        with self.tracer.span("metrics_gather", "comm"):
            # Through core's collective, so its bytes and blocked time are counted too.
            all_gather_into(every.view(-1), mine, self.grid.world)
        sums = every[self._loss_ranks, :-2].sum(dim=0).tolist()
        if aux.split_over_tensor:  # every tensor rank holds its own part
            sums[1:] = every[:, 1:-2].sum(dim=0).tolist()
        self.stop_agreed = bool(every[:, -2].max() > 0)  # every rank sees the same
        times = every[:, -1].tolist()
        return sums, min(times), max(times)

    def _forward_backward(self, microbatches: list[Batch], scale: torch.Tensor,
                          aux_scale: float) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for i, mb in enumerate(microbatches):
            last = i == len(microbatches) - 1
            with contextlib.nullcontext() if last else self.ctx.no_sync():
                with self.tracer.span("forward"):
                    loss_sum, _ = self.loss_fn(self._logits(mb), mb.targets)
                    objective = self.ctx.aux_losses.objective(
                        loss_sum * scale.to(loss_sum.dtype), aux_scale)
                with self.tracer.span("backward"):
                    if self.ctx.backward is not None:
                        self.ctx.backward(objective)
                    else:
                        objective.backward()
            total += loss_sum.detach().double()
        return total

    @torch.no_grad()
    def eval_step(self, batch: Any) -> float:
        """Mean loss over this global batch's non-ignored tokens (no parameter update)."""
        self.model.eval()
        batch, tokens = self._prepare(batch)
        if self.ctx.forward_backward is not None:
            loss_sum = self.ctx.forward_backward([batch], self.loss_fn, None, False)
        else:
            loss_sum, _ = self.loss_fn(self._logits(batch), batch.targets)
        self.ctx.aux_losses.clear()  # evaluation reports the language-model loss only
        return self._reduce_step(loss_sum, 0.0)[0][0] / tokens.clamp(min=1).item()

    def probe_loss(self, ids: torch.Tensor) -> float:
        """:meth:`eval_step` in fp32 whatever the training precision (the parity probe)."""
        self._fp32_only = True
        try:
            return self.eval_step(ids)
        finally:
            self._fp32_only = False

    def fp32_backward(self, batch: Any, *, train_mode: bool = False,
                      in_precision: bool = False, aux: bool = True,
                      ) -> contextlib.AbstractContextManager[None]:
        """Within it, this global batch's gradients, synchronized, without a step:
        :func:`paraxis.engine.gradient_check.fp32_backward` (the parity probe's and the
        gradient parity checks')."""
        return fp32_backward(self, batch, train_mode=train_mode, in_precision=in_precision,
                             aux=aux)

    # ---- state -----------------------------------------------------------------------

    def close(self) -> None:
        """Release the model, optimizer and grid groups (collective); the default group
        stays (:func:`paraxis.shutdown` leaves it)."""
        self.wait_for_checkpoint()
        for sync in self.ctx.grad_syncs:
            remove = getattr(sync, "remove_hooks", None)
            if remove is not None:
                remove()
        self.ctx.grad_syncs.clear()
        self.model = self.optimizer = self.scheduler = None  # type: ignore[assignment]
        self.params = []
        gc.collect()
        barrier(self.grid.world)
        self.grid.destroy()

    def save(self, directory: str) -> str:
        """Write a checkpoint (DESIGN section 6) under ``directory``; returns its path.
        With ``checkpoint.async`` only the snapshot happens now; the files are written
        in the background (:mod:`paraxis.checkpoint.background`,
        :meth:`wait_for_checkpoint`)."""
        if self.config.checkpoint.async_save:
            if self._saver is None:
                self._saver = AsyncSaver()
            return self._saver.save(self, directory)
        return save_checkpoint(self, directory)

    def wait_for_checkpoint(self) -> None:
        """Block until a background checkpoint write finished (raises its error)."""
        if self._saver is not None:
            self._saver.wait()

    def load(self, directory: str, *, verify: bool = True) -> None:
        """Restore from ``directory`` (its ``latest`` pointer, or a step directory);
        ``verify`` checks every file's checksum first."""
        self.wait_for_checkpoint()
        restored = load_checkpoint(self, directory, verify=verify)
        self.step, self.data_state = restored.step, restored.data_state
