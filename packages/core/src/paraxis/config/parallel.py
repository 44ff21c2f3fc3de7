"""The parallel configuration: degrees per axis, schedule and checkpoint options.

Loaded from keyword arguments (``ParallelConfig.from_kwargs(data=2, tensor=2)``) or from
YAML in the seed format::

    parallelism: {data: ${DATA_PARALLEL_DEGREE}, tensor: 2, pipeline: 1, expert: 1}
    schedule: {microbatches: 4, activation_checkpointing: selective}
    checkpoint: {format: distributed, save_rng_state: true, save_data_position: true}

pydantic checks types and ranges; the cross-field rules (world size, divisibility by the
model's shape) live in :mod:`paraxis.config.rules`, so both report through one
:class:`~paraxis.config.errors.ConfigError` listing every problem at once.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeInt,
    PositiveInt,
    PrivateAttr,
    ValidationError,
)

from paraxis.config.axes import BUILTIN_AXES, AxisTable
from paraxis.config.errors import ConfigError, Problem
from paraxis.config.text import nearest, problem_from_pydantic, read_config

__all__ = [
    "AXES",
    "PIPELINE_SCHEDULES",
    "SAMPLE_AXES",
    "SPLIT_BACKWARD_SCHEDULES",
    "TOKEN_AXES",
    "V_SCHEDULES",
    "CheckpointConfig",
    "MoEConfig",
    "Offload",
    "ParallelConfig",
    "Parallelism",
    "ScheduleConfig",
]

# The built-in axes (paraxis.config.axes: the table a package may extend), in mesh order,
# outermost first (DESIGN section 2): tensor ranks are the most local.
AXES: tuple[str, ...] = BUILTIN_AXES.names
# Ranks that hold distinct tokens: samples are split over data x expert and each sequence
# over context. Dense parameters are replicated over these axes and their gradients
# averaged there; every rank's loss is scaled by their product (the token replicas).
TOKEN_AXES: tuple[str, ...] = BUILTIN_AXES.token_axes
# Ranks that hold distinct samples (tensor, context and pipeline ranks share them).
SAMPLE_AXES: tuple[str, ...] = BUILTIN_AXES.sample_axes
# The pipeline schedules paraxis-pp-schedules builds (its registry is checked against
# this list in its tests; the planner and the config read it from here).
PIPELINE_SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble_h1",
                                       "zbv", "dualpipev")
# Those placing two chunks per rank in a V (rank r: stages r and 2p-1-r), and those
# splitting a backward into input and weight gradients (an axis whose backward cannot
# run in two passes refuses these); paraxis-pp-schedules' tests check both.
V_SCHEDULES: tuple[str, ...] = ("zbv", "dualpipev")
SPLIT_BACKWARD_SCHEDULES: tuple[str, ...] = ("zero_bubble_h1", "zbv", "dualpipev")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Offload(_Section):
    """Where ZeRO keeps optimizer state and parameters between uses (ZeRO-Offload,
    ZeRO-Infinity; the DeepSpeed bridge, paraxis-deepspeed, does the moving)."""

    optimizer: Literal["none", "cpu", "nvme"] = "none"
    parameters: Literal["none", "cpu", "nvme"] = "none"
    nvme_path: str | None = None

    @property
    def enabled(self) -> bool:
        return self.optimizer != "none" or self.parameters != "none"


class Parallelism(_Section):
    """Degree of every grid axis, the ZeRO stage and data-parallel bucket size."""

    data: PositiveInt = 1
    tensor: PositiveInt = 1
    pipeline: PositiveInt = 1
    expert: PositiveInt = 1
    context: PositiveInt = 1
    zero: Literal[0, 1, 2, 3] = 0
    sequence_parallel: bool = False
    # Sequence parallel's all-gathers and reduce-scatters cut into ring steps that
    # overlap the tensor-parallel GEMMs (paraxis_tp.overlap). auto: off on gloo (no
    # step-time gain measured on CPU) and off on NCCL until a GPU run validates it
    # (paraxis.runtime.cuda_paths, "tensor_overlap"); on forces it, with a warning
    # on NCCL while unvalidated.
    tensor_overlap: Literal["auto", "on", "off"] = "auto"
    # On CUDA, read blocked and compute seconds (exposed_comm_s, the moe/ timers) from
    # CUDA events on the compute stream (paraxis.runtime.clock) instead of the host
    # clock, which there measures launches. auto: off until a GPU run validates it
    # (paraxis.runtime.cuda_paths, "stream_timing"); nothing changes on CPU.
    stream_timing: Literal["auto", "on", "off"] = "auto"
    # Expert tensor parallelism (Megatron-Core's expert_tensor_parallel_size): each
    # expert's FFN split column/row-wise over this many tensor ranks. 1 (the default)
    # keeps experts whole on every tensor rank, as before it existed; the other value
    # supported is the tensor degree (paraxis-moe-ep, docs/architecture.md).
    expert_tensor: PositiveInt = 1
    # How the context axis splits attention: ring (K/V circulate) or Ulysses (heads).
    context_mode: Literal["ring", "ulysses"] = "ring"
    bucket_mb: float = Field(default=25.0, gt=0)
    # ZeRO-3: units (layers) gathered ahead of the running one in forward and behind it
    # in backward, and units' reduce-scatters left in flight (this + 1); 0 gathers each
    # unit only when it runs: the least memory. Each adds a unit's bytes both ways.
    zero_prefetch: int = Field(default=1, ge=0)
    # Hybrid sharding (HSDP, issue 36): ZeRO over groups of this many data ranks, the
    # data/zero_shard groups holding replicas of the same shards (reduce-scatter and
    # gathers inside a group, the shards' gradients all-reduced across groups). None
    # shards over every data rank. It must divide data.
    zero_shard: PositiveInt | None = None
    # The dtype gradients travel in on the data and ZeRO reductions: fp32 (gradients
    # are fp32 under every precision, see train.precision), or bf16 to halve the bytes
    # (each rank's gradient rounded to bf16 before the sum, the sum rounded once more).
    reduce_dtype: Literal["fp32", "bf16"] = "fp32"
    offload: Offload = Offload()
    # Degrees of the axes an installed package adds to the grid (its name -> degree;
    # paraxis.config.axes, docs/architecture.md "Adding an axis").
    axes: dict[str, PositiveInt] = Field(default_factory=dict)


class ScheduleConfig(_Section):
    """How one optimizer step is cut into microbatches, how a pipeline orders them, and
    what is recomputed."""

    microbatches: PositiveInt = 1
    activation_checkpointing: Literal["none", "selective", "full"] = "none"
    pipeline_schedule: Literal[PIPELINE_SCHEDULES] = "1f1b"  # type: ignore[valid-type]
    virtual_stages: PositiveInt = 1  # model chunks per pipeline rank (interleaved; V: 2)
    # First layer of each stage after the first; None: balance by estimated cost.
    pipeline_split: list[int] | None = None


class MoEConfig(_Section):
    """Mixture-of-experts routing under expert parallelism (paraxis-moe-ep).

    ``capacity_factor`` None is dropless (the Hugging Face model's own behaviour);
    otherwise each expert keeps at most ``max(min_capacity, ceil(factor x tokens x top_k
    / experts))`` of a rank's assignments, chosen by ``drop_policy``, before the
    exchange. ``aux_loss_coef`` None takes the model's ``router_aux_loss_coef``.
    ``bias_update_rate`` > 0 turns on DeepSeek-V3's auxiliary-loss-free balancing for
    routers holding an ``e_score_correction_bias`` (its paper used 0.001); 0 leaves
    the bias as loaded. ``dispatch_chunks`` > 1 cuts each block's routed tokens into
    that many chunks whose all-to-alls overlap the other chunks' expert compute (off by
    default; on NCCL a CUDA path no GPU has validated yet, which warns when set:
    paraxis.runtime.cuda_paths, "moe_dispatch_chunks").
    """

    capacity_factor: float | None = Field(default=None, gt=0)
    drop_policy: Literal["probs", "position"] = "probs"
    min_capacity: NonNegativeInt = 4
    aux_loss_coef: float | None = Field(default=None, ge=0)
    z_loss_coef: float = Field(default=0.0, ge=0)
    bias_update_rate: float = Field(default=0.0, ge=0)
    dispatch_chunks: PositiveInt = 1


class CheckpointConfig(_Section):
    """What a checkpoint holds (DESIGN section 6)."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    format: Literal["distributed"] = "distributed"
    save_rng_state: bool = True
    save_data_position: bool = True
    # ``async: true``: snapshot to host memory, write in a background thread
    # (paraxis.checkpoint.background); the step waits only for the snapshot.
    async_save: bool = Field(default=False, alias="async")


class ParallelConfig(_Section):
    """Everything that decides how a model is laid out over the process grid."""

    parallelism: Parallelism = Parallelism()
    schedule: ScheduleConfig = ScheduleConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    moe: MoEConfig = MoEConfig()
    # The grid's axes (the built-in five unless with_axes gave the run's table).
    _axes: AxisTable = PrivateAttr(default=BUILTIN_AXES)

    @property
    def axis_table(self) -> AxisTable:
        return self._axes

    def with_axes(self, table: AxisTable) -> ParallelConfig:
        """This configuration over ``table`` (the built-in axes and those installed
        packages add: :func:`paraxis.engine.plugins.axis_table`)."""
        out = self.model_copy()
        out._axes = table
        return out

    @property
    def degrees(self) -> dict[str, int]:
        """Degree of each grid axis, in mesh order (outermost first); an axis a package
        adds reads ``parallelism.axes``."""
        par = self.parallelism
        return {axis: getattr(par, axis) if axis in AXES else par.axes.get(axis, 1)
                for axis in self._axes.names}

    @property
    def world_size(self) -> int:
        return math.prod(self.degrees.values())

    @property
    def token_replicas(self) -> int:
        """Ranks holding distinct tokens: the product over the table's token axes."""
        degrees = self.degrees
        return math.prod(degrees[a] for a in self._axes.token_axes)

    @property
    def sample_shards(self) -> int:
        """Ranks holding distinct samples: the product over the table's sample axes."""
        degrees = self.degrees
        return math.prod(degrees[a] for a in self._axes.sample_axes)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ParallelConfig:
        """Build from nested sections; every type error is reported at once."""
        try:
            return cls.model_validate(dict(data))
        except ValidationError as exc:
            raise ConfigError([problem_from_pydantic(e, cls) for e in exc.errors()]) from None

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> ParallelConfig:
        """Build from flat keywords: ``data=2, tensor=2, zero=1, microbatches=4``.

        Keys of :class:`Parallelism`, :class:`ScheduleConfig` and
        :class:`CheckpointConfig` may be given flat; a section may also be given whole
        (``schedule={...}``).
        """
        sections: dict[str, dict[str, Any]] = {
            "parallelism": {}, "schedule": {}, "checkpoint": {}, "moe": {}}
        owners = {
            name: section
            for section, model in (
                ("parallelism", Parallelism),
                ("schedule", ScheduleConfig),
                ("checkpoint", CheckpointConfig),
            )
            for name in model.model_fields
        }
        unknown = []
        for key, value in kwargs.items():
            if key in sections:
                sections[key].update(dict(value))
            elif key in owners:
                sections[owners[key]][key] = value
            else:
                near = nearest(key, [*owners, *sections])
                unknown.append(Problem(key, value, "is not a configuration option",
                                       f"write {near} (the nearest option)" if near else
                                       f"use one of {sorted(owners)}"))
        if unknown:
            raise ConfigError(unknown)
        return cls.from_dict(sections)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str],
                  env: Mapping[str, str] | None = None) -> ParallelConfig:
        """Load the seed YAML format; ``${VAR}`` expands from ``env`` (default os.environ).

        Sections other than the three above (``model``, ``train``...) are ignored here:
        they belong to the engine's own configuration.
        """
        raw = read_config(path, os.environ if env is None else env)
        return cls.from_dict({k: raw[k] for k in cls.model_fields if k in raw})
