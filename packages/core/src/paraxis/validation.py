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

__all__ = ["ModelShape", "check", "divides", "divisors", "read_model_config", "validate"]


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
    experts_per_token: int | None = None  # the router's top-k

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
            experts_per_token=first("num_experts_per_tok", "moe_topk", "top_k"),
        )

    @classmethod
    def from_file(cls, path: str | Path) -> ModelShape:
        """Load a model's shape from a Hugging Face model directory (its ``config.json``),
        a ``config.json`` itself, or YAML (a ``model:`` section with ``config:``, or the
        fields themselves). Anything else is a :class:`ConfigError` saying what was
        expected, never a raw OS error."""
        data = read_model_config(path)
        shape = cls.from_hf_config(data)
        missing = [f for f in ("hidden_size", "num_attention_heads", "num_layers", "vocab_size")
                   if getattr(shape, f) is None]
        if missing:
            raise ConfigError([Problem(
                "--model", str(path), f"has no {', '.join(missing)} (read as a model config)",
                "pass a Hugging Face model directory or its config.json")])
        return shape


def read_model_config(path: str | Path) -> dict[str, Any]:
    """The model config mapping in ``path`` (see :meth:`ModelShape.from_file`)."""
    where = Path(path)
    expected = "a model directory holding config.json, a config.json, or a YAML run config"
    if where.is_dir():
        where = where / "config.json"
        if not where.is_file():
            raise ConfigError([Problem("--model", str(path), "is a directory without "
                                       "config.json", f"pass {expected}")])
    try:
        text = where.read_text()
        data = json.loads(text) if where.suffix == ".json" else yaml.safe_load(text)
    except FileNotFoundError:
        raise ConfigError([Problem("--model", str(path), "does not exist",
                                   f"pass {expected}")]) from None
    except (OSError, UnicodeDecodeError, ValueError, yaml.YAMLError) as exc:
        raise ConfigError([Problem("--model", str(path), f"cannot be read as a model "
                                   f"config ({type(exc).__name__})", f"pass {expected}")]
                          ) from None
    if isinstance(data, dict) and isinstance(data.get("model"), dict):
        data = data["model"]
        data = {**data.get("config", {}), **({"model_type": data["family"]}
                                             if "family" in data else {})}
    if not isinstance(data, dict):
        raise ConfigError([Problem("--model", str(path), "does not hold a mapping",
                                   f"pass {expected}")])
    return data


def divides(problems: list[Problem], field: str, value: int | None, degree: int,
            axis: str) -> None:
    """Append a problem unless ``value`` is divisible by ``degree`` (the rule every axis
    that splits a dimension shares); a per-layer list (Gemma-3n's intermediate sizes)
    is checked value by value."""
    if isinstance(value, Sequence) and not isinstance(value, str):  # one per layer
        for v in dict.fromkeys(value):
            divides(problems, field, v, degree, axis)
        return
    if value is not None and degree > 1 and value % degree:
        problems.append(Problem(
            field, value, f"must be divisible by the {axis} degree {degree}",
            f"choose {axis} among {divisors(value)} or change {field}"))


def divisors(n: int) -> list[int]:
    return [d for d in range(1, min(n, 64) + 1) if n % d == 0]


def check(config: ParallelConfig, *, world_size: int | None = None,
          model: ModelShape | None = None) -> list[Problem]:
    """Every grid-wide rule the configuration breaks. Each axis checks its own rules
    (divisibility of what it splits, the combinations it supports) in its package,
    through the ``paraxis_validate_config`` hook, so they travel with the axis."""
    problems: list[Problem] = []
    if world_size is not None and world_size != config.world_size:
        degrees = " x ".join(f"{a}={d}" for a, d in config.degrees.items())
        problems.append(Problem(
            "world_size", world_size, f"must equal the product of degrees {degrees} = "
            f"{config.world_size}", "launch that many processes or change the degrees"))
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
