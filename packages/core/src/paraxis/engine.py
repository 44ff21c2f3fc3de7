"""The engine: one object that owns a parallelized model's training step.

``train_step`` takes this rank's share of a global batch and does microbatching,
gradient accumulation (synchronizing only on the last microbatch), the loss, global
gradient-norm clipping, the optimizer and LR-schedule step, and returns metrics that
are identical on every rank.

The loss is the mean next-token cross-entropy over every non-ignored label of the
*global* batch: each rank divides its summed loss by the global token count (one scalar
all-reduce per step), so ranks with different numbers of ``-100`` labels still average
exactly as a single process would.
"""

from __future__ import annotations

import contextlib
import gc
import math
import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from paraxis.config import ParallelConfig
from paraxis.grid import DENSE_REPLICA_AXES, Grid
from paraxis.metrics import Tracer, flops_per_token, memory_stats, mfu
from paraxis.optim import WarmupCosine, clip_grad_norm
from paraxis.placement import placement_of
from paraxis.plan import ModelPlan
from paraxis.run_config import TrainSection
from paraxis.strategy import ApplyContext
from paraxis.validation import ModelShape

__all__ = ["IGNORE_INDEX", "Engine", "causal_lm_loss_sum"]

IGNORE_INDEX = -100


def causal_lm_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Summed shifted cross-entropy (position i predicts label i + 1, ``-100`` ignored)
    and the number of tokens it covers. Sum / count equals transformers' ``labels=`` loss."""
    shift_logits = logits[:, :-1].reshape(-1, logits.shape[-1]).float()
    shift_labels = labels[:, 1:].reshape(-1).to(shift_logits.device)
    loss = F.cross_entropy(shift_logits, shift_labels, ignore_index=IGNORE_INDEX,
                           reduction="sum")
    return loss, int((shift_labels != IGNORE_INDEX).sum())


def _split_batch(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(batch, Mapping):
        ids = batch["input_ids"]
        return ids, batch.get("labels", ids)
    return batch, batch


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
        self.replicas = grid.group(DENSE_REPLICA_AXES)  # ranks with distinct tokens
        # Tensor ranks hold the same loss sum; counting those at tensor coordinate 0
        # counts every replica (and, under a pipeline, the last stage's) once.
        layout = grid.layout
        self._loss_ranks = [r for r in range(layout.size) if layout.coords(r)["tensor"] == 0]
        self.tracer = Tracer(grid.rank)
        self.step = 0
        self.data_state: dict[str, Any] = {}  # e.g. a BatchStream's position
        self.forward_kwargs = dict(plan.extra.get("forward_kwargs", {}))
        self.loss_fn = ctx.loss_fn or causal_lm_loss_sum
        self._flops_per_token = self._model_flops()

    # ---- steps -----------------------------------------------------------------------

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if not self.train_cfg.bf16:
            return contextlib.nullcontext()
        # Parameters stay fp32 (the master weights); matmuls run in bf16.
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    def _logits(self, ids: torch.Tensor) -> torch.Tensor:
        with self._autocast():
            out = self.model(ids.to(self.device), **self.forward_kwargs)
        return out.logits if hasattr(out, "logits") else out

    def _global_tokens(self, labels: torch.Tensor) -> torch.Tensor:
        count = (labels[:, 1:] != IGNORE_INDEX).sum().to(self.device, torch.float64)
        if self.replicas.size > 1:
            with self.tracer.span("token_count", "comm"):
                dist.all_reduce(count, group=self.replicas.pg)
        return count

    def train_step(self, batch: Any) -> dict[str, float]:
        """One optimizer step on this rank's share of a global batch."""
        ids, labels = _split_batch(batch)
        mbs = self.config.schedule.microbatches
        if ids.shape[0] % mbs:
            raise ValueError(f"local batch of {ids.shape[0]} does not split into {mbs} "
                             "microbatches (schedule.microbatches)")
        self.model.train()
        if len(self.tracer.spans) > 20_000:
            self.tracer.clear()
        mark, start = len(self.tracer.spans), time.perf_counter()
        tokens = self._global_tokens(labels)
        # Gradients are averaged over the replicas; scaling by their number makes the
        # average a sum over all tokens divided by the global count.
        scale = self.replicas.size / tokens.clamp(min=1)
        microbatches = list(zip(ids.chunk(mbs), labels.chunk(mbs), strict=True))
        if self.ctx.forward_backward is not None:  # a pipeline runs its own schedule
            with self.ctx.no_sync(), self.tracer.span("pipeline_schedule"):
                total = self.ctx.forward_backward(microbatches, self.loss_fn, scale, True)
        else:
            total = self._forward_backward(microbatches, scale)
        self.tracer.add("grad_sync_wait", "comm", self.ctx.finish_grad_sync())
        with self.tracer.span("clip_grad_norm"):
            norm = clip_grad_norm(self.params, self.train_cfg.grad_clip, self.grid)
        with self.tracer.span("optimizer"):
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            lr = self.optimizer.param_groups[0]["lr"]
            if self.scheduler is not None:
                self.scheduler.step()
        step_time = time.perf_counter() - start
        self.step += 1
        loss_sum, fastest, slowest = self._reduce_step(total, step_time)
        return self._metrics(loss_sum / tokens.clamp(min=1).item(), norm, lr,
                             (fastest, slowest), ids.numel() * self.replicas.size, mark)

    def _reduce_step(self, total: torch.Tensor, step_time: float) -> tuple[float, float, float]:
        """One all-gather over the grid for the step's loss and the ranks' step times.

        The global loss sum is the sum over ranks with tensor coordinate 0 (tensor ranks
        hold the same sum; stages other than the last hold zero); step time is the
        slowest rank's, and their spread shows stragglers."""
        mine = torch.tensor([float(total), step_time], dtype=torch.float64, device=self.device)
        if self.grid.world_size == 1:
            return float(total), step_time, step_time
        every = [torch.empty_like(mine) for _ in range(self.grid.world_size)]
        with self.tracer.span("metrics_gather", "comm"):
            dist.all_gather(every, mine)
        loss_sum = sum(float(every[r][0]) for r in self._loss_ranks)
        times = [float(v[1]) for v in every]
        return loss_sum, min(times), max(times)

    def _forward_backward(self, microbatches: list[tuple[torch.Tensor, torch.Tensor]],
                          scale: torch.Tensor) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for i, (mb_ids, mb_labels) in enumerate(microbatches):
            last = i == len(microbatches) - 1
            with contextlib.nullcontext() if last else self.ctx.no_sync():
                with self.tracer.span("forward"):
                    loss_sum, _ = self.loss_fn(self._logits(mb_ids), mb_labels)
                with self.tracer.span("backward"):
                    (loss_sum * scale.to(loss_sum.dtype)).backward()
            total += loss_sum.detach().double()
        return total

    @torch.no_grad()
    def eval_step(self, batch: Any) -> float:
        """Mean loss over this global batch's non-ignored tokens (no parameter update)."""
        ids, labels = _split_batch(batch)
        self.model.eval()
        tokens = self._global_tokens(labels)
        if self.ctx.forward_backward is not None:
            loss_sum = self.ctx.forward_backward([(ids, labels)], self.loss_fn, None, False)
        else:
            loss_sum, _ = self.loss_fn(self._logits(ids), labels)
        return self._reduce_step(loss_sum, 0.0)[0] / tokens.clamp(min=1).item()

    # ---- metrics ---------------------------------------------------------------------

    def _model_flops(self) -> float | None:
        shape = self.model_shape
        if shape is None:
            return None
        embeddings = {id(p) for m in self.model.modules() if isinstance(m, nn.Embedding)
                      for p in m.parameters()}
        n = sum(math.prod(placement_of(p).global_shape) for p in self.model.parameters()
                if id(p) not in embeddings)
        head_dim = shape.hidden_size // shape.num_attention_heads
        return flops_per_token(n, shape.num_layers, shape.num_attention_heads, head_dim,
                               shape.seq_length or 0)

    def _metrics(self, loss: float, norm: float, lr: float, times: tuple[float, float],
                 tokens: int, mark: int) -> dict[str, float]:
        fastest, slowest = times
        out = {
            "step": float(self.step),
            "loss": float(loss),
            "grad_norm": norm,
            "lr": float(lr),
            "step_time_s": slowest,
            "tokens_per_s": tokens / slowest,
            "exposed_comm_s": self.tracer.comm_seconds(mark),
            "straggler_spread_s": slowest - fastest,
        }
        peak = self.train_cfg.peak_flops
        if peak and self._flops_per_token:
            out["mfu"] = mfu(out["tokens_per_s"], self._flops_per_token, peak,
                             self.grid.world_size)
        out.update(memory_stats(self.model, self.optimizer, self.device))
        return out

    # ---- state -----------------------------------------------------------------------

    def close(self) -> None:
        """Release the model, optimizer and grid groups (collective). The default group
        stays; :func:`paraxis.shutdown` leaves it."""
        for sync in self.ctx.grad_syncs:
            remove = getattr(sync, "remove_hooks", None)
            if remove is not None:
                remove()
        self.ctx.grad_syncs.clear()
        self.model = self.optimizer = self.scheduler = None  # type: ignore[assignment]
        self.params = []
        gc.collect()
        dist.barrier()
        self.grid.destroy()

    def save(self, directory: str) -> str:
        """Write a checkpoint (DESIGN section 6) under ``directory``; returns its path."""
        from paraxis.checkpoint import save_checkpoint

        return save_checkpoint(self, directory)

    def load(self, directory: str) -> None:
        """Restore from ``directory`` (its ``latest`` pointer, or a step directory)."""
        from paraxis.checkpoint import load_checkpoint

        load_checkpoint(self, directory)
