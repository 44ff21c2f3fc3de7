"""Cross-field rules, checked before any process group exists (DESIGN section 2).

:func:`check` returns every problem; :func:`validate` raises one
:class:`~paraxis.errors.ConfigError` listing them all. Axis packages add their own rules
through the ``paraxis_validate_config`` hook.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from paraxis.config import ParallelConfig
from paraxis.errors import ConfigError, Problem

__all__ = ["ModelShape", "check", "validate"]


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a transformer that parallel degrees must divide."""

    hidden_size: int
    num_attention_heads: int
    num_layers: int
    vocab_size: int
    num_key_value_heads: int | None = None
    intermediate_size: int | None = None
    num_experts: int = 0
    seq_length: int | None = None

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @classmethod
    def from_hf_config(cls, cfg: Any, seq_length: int | None = None) -> ModelShape:
        """Read a Hugging Face config object or its ``config.json`` as a dict."""
        get = cfg.get if isinstance(cfg, Mapping) else lambda k, d=None: getattr(cfg, k, d)

        def first(*names: str, default: Any = None) -> Any:
            for name in names:
                value = get(name)
                if value is not None:
                    return value
            return default

        return cls(
            hidden_size=first("hidden_size", "n_embd", "d_model"),
            num_attention_heads=first("num_attention_heads", "n_head", "num_heads"),
            num_layers=first("num_hidden_layers", "n_layer", "num_layers"),
            vocab_size=first("vocab_size"),
            num_key_value_heads=first("num_key_value_heads"),
            intermediate_size=first("intermediate_size", "n_inner"),
            num_experts=first("num_local_experts", "num_experts", "n_routed_experts", default=0),
            seq_length=seq_length or first("max_position_embeddings", "n_positions"),
        )

    @classmethod
    def from_file(cls, path: str | Path) -> ModelShape:
        """Load a model config from JSON (``config.json``) or YAML (a ``model:`` section
        or the fields themselves)."""
        text = Path(path).read_text()
        data = json.loads(text) if str(path).endswith(".json") else yaml.safe_load(text)
        if isinstance(data, dict) and isinstance(data.get("model"), dict):
            data = data["model"]
        return cls.from_hf_config(data)


def _divides(problems: list[Problem], field: str, value: int | None, degree: int,
             axis: str) -> None:
    if value is not None and degree > 1 and value % degree:
        problems.append(Problem(
            field, value, f"must be divisible by the {axis} degree {degree}",
            f"choose {axis} among {_divisors(value)} or change {field}"))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, min(n, 64) + 1) if n % d == 0]


def check(config: ParallelConfig, *, world_size: int | None = None,
          model: ModelShape | None = None) -> list[Problem]:
    """Every rule the configuration (and, if given, the model) breaks."""
    par, sched = config.parallelism, config.schedule
    problems: list[Problem] = []
    if world_size is not None and world_size != config.world_size:
        degrees = " x ".join(f"{a}={d}" for a, d in config.degrees.items())
        problems.append(Problem(
            "world_size", world_size, f"must equal the product of degrees {degrees} = "
            f"{config.world_size}", "launch that many processes or change the degrees"))
    if par.pipeline > 1 and sched.microbatches < par.pipeline:
        problems.append(Problem(
            "schedule.microbatches", sched.microbatches,
            f"must be at least the pipeline degree {par.pipeline} or stages sit idle",
            f"set schedule.microbatches >= {par.pipeline}"))
    v = sched.virtual_stages
    if (v > 1) != (sched.pipeline_schedule == "interleaved_1f1b"):
        problems.append(Problem(
            "schedule.virtual_stages", v, "more than one model chunk per rank goes with "
            "the interleaved_1f1b schedule, and only with it",
            "set pipeline_schedule: interleaved_1f1b with virtual_stages > 1, or "
            "virtual_stages: 1"))
    if sched.pipeline_schedule == "interleaved_1f1b" and sched.microbatches % par.pipeline:
        problems.append(Problem(
            "schedule.microbatches", sched.microbatches, "interleaved 1F1B works on groups "
            f"of pipeline-degree ({par.pipeline}) microbatches",
            f"use a multiple of {par.pipeline}"))
    if v > 1 and par.tensor > 1:
        problems.append(Problem(
            "schedule.virtual_stages", v, "interleaved chunks are not supported with "
            "tensor parallelism yet", "use virtual_stages: 1 (1f1b) with tensor > 1"))
    if par.sequence_parallel and par.tensor == 1:
        problems.append(Problem(
            "parallelism.sequence_parallel", True, "shards activations over the tensor axis, "
            "which has degree 1", "set parallelism.tensor > 1 or sequence_parallel: false"))
    if par.zero >= 2 and par.pipeline > 1:
        # Sharded gradients are reduced once per step, but a pipeline produces them one
        # microbatch at a time; Megatron and DeepSpeed reject the pair for the same reason.
        problems.append(Problem(
            "parallelism.zero", par.zero, "ZeRO-2/3 is not supported with pipeline > 1",
            "use zero: 1 with pipeline parallelism"))
    if model is not None:
        problems += _check_model(config, model)
    return problems


def _check_model(config: ParallelConfig, model: ModelShape) -> list[Problem]:
    par = config.parallelism
    problems: list[Problem] = []
    t = par.tensor
    _divides(problems, "model.hidden_size", model.hidden_size, t, "tensor")
    _divides(problems, "model.num_attention_heads", model.num_attention_heads, t, "tensor")
    _divides(problems, "model.intermediate_size", model.intermediate_size, t, "tensor")
    if t > 1 and model.kv_heads % t:
        # Replicating kv heads over tensor ranks would make their gradients partial sums
        # over sub-groups of the tensor group; paraxis rejects it instead (documented).
        problems.append(Problem(
            "model.num_key_value_heads", model.kv_heads,
            f"must be divisible by the tensor degree {t} (kv heads are split, never "
            "replicated)", f"choose tensor among {_divisors(model.kv_heads)}"))
    if t > 1 and model.vocab_size < t:
        problems.append(Problem(
            "model.vocab_size", model.vocab_size,
            f"must be at least the tensor degree {t} (it is padded to a multiple of it)",
            "lower parallelism.tensor"))
    stages = par.pipeline * config.schedule.virtual_stages
    if stages > model.num_layers:
        problems.append(Problem(
            "parallelism.pipeline", par.pipeline,
            f"each of the {stages} stages needs at least one of the {model.num_layers} "
            "layers", f"set pipeline x virtual_stages <= {model.num_layers}"))
    split = config.schedule.pipeline_split
    if split is not None and par.pipeline > 1 and (
            len(split) != stages - 1 or sorted(set(split)) != split
            or split[0] <= 0 or split[-1] >= model.num_layers):
        problems.append(Problem(
            "schedule.pipeline_split", split,
            f"needs {stages - 1} increasing layer indices in (0, {model.num_layers}), one "
            "per stage boundary, so every layer lands on exactly one stage",
            "list the first layer of every stage after the first, or drop it to balance"))
    if par.expert > 1:
        if model.num_experts == 0:
            problems.append(Problem(
                "parallelism.expert", par.expert, "the model has no experts",
                "set expert: 1 or use a mixture-of-experts model"))
        else:
            _divides(problems, "model.num_experts", model.num_experts, par.expert, "expert")
    seq = model.seq_length
    _divides(problems, "model.seq_length", seq, par.context, "context")
    if par.sequence_parallel:
        _divides(problems, "model.seq_length", seq, t * par.context, "tensor x context")
    return problems


def validate(config: ParallelConfig, *, world_size: int | None = None,
             model: ModelShape | None = None, plugin_manager: Any = None,
             extra: Sequence[Problem] = ()) -> None:
    """Raise :class:`ConfigError` listing every problem: core's, the plugins', and any
    ``extra`` the caller found (run rules, missing axis packages)."""
    problems = [*extra, *check(config, world_size=world_size, model=model)]
    if plugin_manager is not None:
        plugin_manager.hook.paraxis_validate_config(config=config, model=model,
                                                    problems=problems)
    if problems:
        raise ConfigError(problems)
