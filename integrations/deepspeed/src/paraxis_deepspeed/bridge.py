"""What the engine holds under offload: the user's model run through DeepSpeed's engine
(:class:`OffloadedModel`) and DeepSpeed's optimizer behind paraxis's optimizer contract
(:class:`DeepSpeedOptimizer`).

DeepSpeed owns backward and the step (ZeRO-Offload, Ren et al., arXiv:2101.06840;
ZeRO-Infinity, Rajbhandari et al., arXiv:2104.07857): ``engine.backward`` reduces and
partitions gradients (moving them to the offload device), ``engine.step`` computes the
global norm, clips, steps the offloaded optimizer and counts its own accumulation
boundary. The paraxis engine calls ``ctx.backward`` (:meth:`DeepSpeedOptimizer.backward`)
for every microbatch and ``step()`` once per optimizer step, which returns the norm
(``clips_in_step``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from paraxis.parallel.placement import placement_of

__all__ = ["ADAM_STATES", "DeepSpeedOptimizer", "OffloadedModel", "full_weights"]

ADAM_STATES = ("exp_avg", "exp_avg_sq")


class OffloadedModel(nn.Module):
    """The user's model (``module``), called through DeepSpeed's engine, whose forward
    registers the hooks its backward needs. The engine is not a registered submodule,
    so parameters are the user's, under ``module.``."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        self.__dict__["deepspeed"] = None  # set by DeepSpeedOptimizer

    @property
    def config(self) -> Any:  # the user's model config (checkpoint index, model shape)
        return getattr(self.module, "config", None)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.deepspeed is None:
            raise RuntimeError("paraxis-deepspeed: the model has no DeepSpeed engine; the "
                               "bridge builds it with its optimizer, so parallelize(optimizer="
                               "...) cannot be used with offload: leave optimizer unset")
        return self.deepspeed(*args, **kwargs)

    def train(self, mode: bool = True) -> OffloadedModel:
        super().train(mode)
        if self.deepspeed is not None:
            self.deepspeed.train(mode)
        return self


class DeepSpeedOptimizer:
    """DeepSpeed's engine behind core's optimizer contract.

    ``param_groups`` are paraxis's groups (matrices decay, vectors do not) with their
    hyper-parameters; the schedule sets ``lr`` there and :meth:`step` hands it to
    DeepSpeed's (sub)groups. ``state`` is DeepSpeed's optimizer state (this rank's
    partitions), for memory accounting. Checkpoints go through
    :meth:`checkpoint_state` / :meth:`load_checkpoint_state` (DeepSpeed's tensor-fragment
    API), so they are paraxis's format: whole tensors, no pickle.
    """

    clips_in_step = True

    def __init__(self, engine: Any, model: OffloadedModel, groups: list[dict[str, Any]]):
        self.engine = engine
        self.model = model
        model.__dict__["deepspeed"] = engine
        self.zero = engine.optimizer  # DeepSpeed's ZeRO optimizer
        self.param_groups = [{k: v for k, v in g.items() if k != "params"} for g in groups]
        # DeepSpeed's ZeRO-3 may cut a group into sub-groups; map each to its group.
        inner = self.zero.optimizer.param_groups
        mapping = getattr(self.zero, "sub_group_to_group_id", None)
        self._group_of = [mapping[i] if mapping else i for i in range(len(inner))]
        self.stage3 = hasattr(self.zero, "fp32_partitioned_groups_flat")
        dp = engine.mpu.get_data_parallel_world_size()
        rank = engine.mpu.get_data_parallel_rank()
        # Checkpoint writers: parameters spread over the data-parallel ranks in turn.
        self._writes = {id(p): i % dp == rank for i, p in enumerate(model.parameters())}

    # ---- the engine's contract ------------------------------------------------------

    @property
    def state(self) -> dict[Any, dict[str, Any]]:
        return self.zero.optimizer.state

    def backward(self, loss: torch.Tensor) -> None:
        """One microbatch's backward (``ctx.backward``): paraxis already scaled the loss
        to a share of the global token mean, so DeepSpeed must not divide it again by the
        accumulation steps. Before the boundary, DeepSpeed's ``step`` only counts the
        microbatch."""
        self.engine.backward(loss, scale_wrt_gas=False)
        if not self.engine.is_gradient_accumulation_boundary():
            self.engine.step()

    def step(self) -> float:
        """DeepSpeed's step at its accumulation boundary: norm, clipping, the offloaded
        AdamW. Returns the global gradient norm before clipping."""
        engine = self.engine
        if not engine.is_gradient_accumulation_boundary():
            raise RuntimeError(
                f"paraxis-deepspeed: DeepSpeed counted {engine.micro_steps} microbatches, not "
                f"a multiple of gradient_accumulation_steps="
                f"{engine.gradient_accumulation_steps()}: each train_step must split its "
                "batch into schedule.microbatches microbatches (at least one row each)")
        for inner, group in zip(self.zero.optimizer.param_groups, self._group_of, strict=True):
            inner["lr"] = self.param_groups[group]["lr"]
        engine.step()
        norm = engine.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """DeepSpeed clears its gradient partitions in its own step."""

    # ---- checkpoints ----------------------------------------------------------------

    def checkpoint_state(self, param: nn.Parameter
                         ) -> tuple[torch.Tensor, dict[str, torch.Tensor]] | None:
        """The parameter's fp32 value and AdamW state, whole over DeepSpeed's
        partitions, on the rank that writes them (None elsewhere). Collective over the
        data-parallel group: every rank calls it for every parameter, in order."""
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        shape = placement_of(param).local_shape
        value = safe_get_full_fp32_param(param).reshape(shape)
        state = {k: safe_get_full_optimizer_state(param, k).reshape(shape)
                 for k in ADAM_STATES}
        if not self._writes[id(param)]:
            return None
        # torch's AdamW keeps `step` as a float tensor per parameter; so does the file.
        state["step"] = torch.tensor(float(self._adam_step()))
        return value.cpu(), {k: v.cpu() for k, v in state.items()}

    def load_checkpoint_state(self, param: nn.Parameter, value: torch.Tensor,
                              state: dict[str, torch.Tensor]) -> None:
        """Set DeepSpeed's partitions of ``param`` (fp32 master, AdamW state and the
        module's working copy) from whole tensors. Collective like
        :meth:`checkpoint_state`."""
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        self._ensure_adam_state()
        safe_set_full_fp32_param(param, value)
        for k in ADAM_STATES:
            if k in state:
                safe_set_full_optimizer_state(param, state[k], k)
        self._set_working_copy(param, value)
        if "step" in state:
            for st in self.state.values():
                st["step"] = int(state["step"])

    def _set_working_copy(self, param: nn.Parameter, value: torch.Tensor) -> None:
        if self.stage3:
            import deepspeed

            # modifier_rank: the group's first rank's copy is re-partitioned (None would
            # discard the change); every rank sets the same value.
            with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
                param.data.copy_(value.to(param.dtype))
        else:
            param.data.copy_(value.to(param.dtype))

    def _adam_step(self) -> int:
        return max((int(st.get("step", 0)) for st in self.state.values()), default=0)

    def _ensure_adam_state(self) -> None:
        """DeepSpeed's AdamW creates its state at the first step; a checkpoint loaded
        before it needs the state (and, under ZeRO-1/2, DeepSpeed's links to it) now:
        the same tensors the first step would create (step 0, zero moments)."""
        flats = (self.zero.fp32_partitioned_groups_flat if self.stage3 else
                 [p for g in self.zero.optimizer.param_groups for p in g["params"]])
        for flat in flats:
            st = self.state[flat]
            if not st:
                st["step"] = 0
                st["exp_avg"] = torch.zeros_like(flat, dtype=torch.float32)
                st["exp_avg_sq"] = torch.zeros_like(flat, dtype=torch.float32)
        if not self.stage3 and not getattr(self.zero, "_hp_optimizer_states_linked", True):
            self.zero._lazy_init_hp_params_optimizer_state()


def full_weights(model: nn.Module, optimizer: Any) -> dict[str, torch.Tensor]:
    """Every parameter's fp32 value by global name, whole over DeepSpeed's partitions
    (tensor-parallel shards stay this rank's). Collective; for tests and export."""
    from deepspeed.utils import safe_get_full_fp32_param

    out = {}
    for p in model.parameters():
        rec = placement_of(p)
        if isinstance(optimizer, DeepSpeedOptimizer):
            out[rec.name] = safe_get_full_fp32_param(p).reshape(rec.local_shape).cpu()
        else:
            out[rec.name] = p.detach().cpu().clone()
    return out
