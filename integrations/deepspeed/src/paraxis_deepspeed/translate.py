"""A paraxis configuration, translated into a DeepSpeed configuration dict.

The dict is generated, never written by the user: everything in it follows from the
paraxis config (ZeRO stage, offload targets, microbatches, reduction dtype), the
``train`` section (clipping, precision and fp16's loss scaling, AdamW) and the model's
hidden size; what DeepSpeed cannot express is refused (:func:`train_problems`). Bucket
and prefetch sizes follow the "auto" rules of transformers' DeepSpeed integration
(``transformers/integrations/deepspeed.py``, ``trainer_config_finalize``):

* ``reduce_bucket_size = hidden²``
* ``stage3_prefetch_bucket_size = 0.9 · hidden²``
* ``stage3_param_persistence_threshold = 10 · hidden`` (parameters smaller than this,
  norms and biases, stay whole under ZeRO-3)

The learning-rate schedule is not DeepSpeed's: paraxis's ``WarmupCosine`` sets the rate
on DeepSpeed's optimizer every step, so a run with and without the bridge follow the
same curve. Nothing here imports DeepSpeed.
"""

from __future__ import annotations

import math
from typing import Any

from paraxis.config.errors import Problem
from paraxis.config.parallel import Offload, ParallelConfig
from paraxis.config.run import TrainSection

__all__ = ["ADAM_EPS", "bucket_sizes", "deepspeed_config", "offload_section",
           "precision_sections", "train_problems"]

ADAM_EPS = 1e-8  # torch.optim.AdamW's default, which core's AdamW uses
QUIET = 2**31 - 1  # DeepSpeed prints every `steps_per_print` steps; paraxis reports itself


def bucket_sizes(hidden_size: int, stage: int) -> dict[str, int]:
    """transformers' "auto" values for a model of ``hidden_size``."""
    sizes = {"reduce_bucket_size": hidden_size * hidden_size}
    if stage == 3:
        sizes["stage3_prefetch_bucket_size"] = int(0.9 * hidden_size * hidden_size)
        sizes["stage3_param_persistence_threshold"] = 10 * hidden_size
    return sizes


def offload_section(device: str, nvme_path: str | None, *, pin_memory: bool) -> dict[str, Any]:
    """One ``offload_optimizer`` / ``offload_param`` entry."""
    section: dict[str, Any] = {"device": device, "pin_memory": pin_memory}
    if device == "nvme":
        section["nvme_path"] = nvme_path
    return section


def train_problems(train: TrainSection) -> list[Problem]:
    """What of ``train`` DeepSpeed's engine cannot do as paraxis would: another optimizer
    than AdamW (the bridge builds DeepSpeed's), and an fp16 loss-scale schedule other than
    its dynamic scaler's (start at a power of two, double after a window of clean steps,
    halve on overflow)."""
    problems = []
    if train.optimizer.lower() != "adamw":
        problems.append(Problem("train.optimizer", train.optimizer,
                                "the DeepSpeed bridge (offload) steps DeepSpeed's AdamW",
                                "use train.optimizer: adamw with offload"))
    scaling = train.loss_scale
    power = math.log2(scaling.initial)
    if train.precision == "fp16" and (scaling.growth_factor != 2.0 or
                                      scaling.backoff_factor != 0.5 or power != int(power)):
        problems.append(Problem(
            "train.loss_scale", scaling.model_dump(), "DeepSpeed's dynamic loss scaler starts "
            "at a power of two, doubles and halves", "keep growth_factor 2, backoff_factor "
            "0.5 and a power-of-two initial scale with offload"))
    return problems


def precision_sections(train: TrainSection, reduce_dtype: str) -> dict[str, Any]:
    """DeepSpeed's ``bf16``/``fp16`` sections and the gradient reduction dtype."""
    scaling = train.loss_scale
    out: dict[str, Any] = {"bf16": {"enabled": train.precision == "bf16"}}
    if train.precision == "fp16":
        out["fp16"] = {"enabled": True, "loss_scale": 0,  # 0: dynamic
                       "initial_scale_power": int(math.log2(scaling.initial)),
                       "loss_scale_window": scaling.growth_interval, "hysteresis": 1,
                       "min_loss_scale": scaling.min_scale}
    if reduce_dtype == "bf16":
        out["communication_data_type"] = "bf16"
    return out


def _zero_section(offload: Offload, stage: int, hidden_size: int | None,
                  pin_memory: bool) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage, "contiguous_gradients": True,
                            "overlap_comm": False}
    if offload.optimizer != "none":
        zero["offload_optimizer"] = offload_section(offload.optimizer, offload.nvme_path,
                                                    pin_memory=pin_memory)
    if offload.parameters != "none":
        zero["offload_param"] = offload_section(offload.parameters, offload.nvme_path,
                                                pin_memory=pin_memory)
    if hidden_size:
        zero.update(bucket_sizes(hidden_size, stage))
    return zero


def deepspeed_config(config: ParallelConfig, train: TrainSection, *,
                     hidden_size: int | None = None, pin_memory: bool = False
                     ) -> dict[str, Any]:
    """The DeepSpeed config dict for ``config`` (a :class:`ParallelConfig` or a whole
    :class:`RunConfig`) and ``train``.

    Batch sizes satisfy DeepSpeed's identity ``train_batch_size = micro x accumulation x
    data-parallel size``, where DeepSpeed's data-parallel group is paraxis's dense
    replica group (data x expert x context): the ranks that average gradients.
    ``hidden_size`` None (no model known) leaves bucket sizes at DeepSpeed's defaults.
    ``pin_memory`` pins offloaded buffers (worth it on CUDA only)."""
    par, mbs = config.parallelism, config.schedule.microbatches
    replicas = config.token_replicas
    micro = max(1, train.global_batch // (config.sample_shards * mbs))
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": mbs,
        "train_batch_size": micro * mbs * replicas,
        "gradient_clipping": float(train.grad_clip),
        **precision_sections(train, par.reduce_dtype),
        "optimizer": {"type": "AdamW", "params": {
            "lr": float(train.lr), "betas": [float(b) for b in train.betas],
            "eps": ADAM_EPS, "weight_decay": float(train.weight_decay)}},
        "zero_optimization": _zero_section(par.offload, par.zero, hidden_size, pin_memory),
        "steps_per_print": QUIET,
        "wall_clock_breakdown": False,
    }
