"""The sizes of a transformer that parallel degrees divide, read from any config.

Hugging Face families spell the same size several ways (``hidden_size``, ``n_embd``,
``d_model``...); :data:`SIZE_SPELLINGS` is the one list of them and :func:`config_size`
the one reader, used by :class:`ModelShape` and by every axis that needs a size from a
model's config.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from paraxis.config.errors import ConfigError, Problem

__all__ = ["SIZE_SPELLINGS", "ModelShape", "config_size", "read_model_config"]

# Each size, by the name ModelShape uses, and its spellings in transformers' configs, in
# order of preference.
SIZE_SPELLINGS: dict[str, tuple[str, ...]] = {
    "hidden_size": ("hidden_size", "n_embd", "d_model"),
    "num_attention_heads": ("num_attention_heads", "n_head", "num_heads"),
    "num_layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "vocab_size": ("vocab_size",),
    "num_key_value_heads": ("num_key_value_heads",),
    "intermediate_size": ("intermediate_size", "n_inner"),
    "num_experts": ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts"),
    "seq_length": ("max_position_embeddings", "n_positions", "seq_length"),
    # The router's top-k (every family surveyed uses the first; moe-ep reads it here).
    "experts_per_token": ("num_experts_per_tok", "moe_topk", "num_experts_per_token",
                          "num_selected_experts", "moe_top_k", "top_k"),
}


def config_size(cfg: Any, size: str, default: Any = None) -> Any:
    """The first spelling of ``size`` (a key of :data:`SIZE_SPELLINGS`) that ``cfg`` (a
    config object, or ``config.json`` as a mapping) sets, else ``default``."""
    get = cfg.get if isinstance(cfg, Mapping) else lambda k, d=None: getattr(cfg, k, d)
    for name in SIZE_SPELLINGS[size]:
        value = get(name)
        if value is not None:
            return value
    return default


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
        sizes = {name: config_size(cfg, name) for name in SIZE_SPELLINGS}
        sizes["num_experts"] = sizes["num_experts"] or 0
        sizes["seq_length"] = seq_length or sizes["seq_length"]
        return cls(**sizes)

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
