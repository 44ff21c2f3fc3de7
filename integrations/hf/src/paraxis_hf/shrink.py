"""Shrink any transformers config to a tiny one, as data plus a few rules.

~200 families spell the same few sizes ~400 ways (``hidden_size``, ``n_embd``,
``d_model``...). :data:`ROLES` maps each spelling to a role and each role to its tiny
value; five rules do the rest:

1. *Derived fields are left to the config.* A field whose declared default is ``None``
   (``head_dim``, ``layer_types``, ``num_key_value_heads``...) is computed by the
   config's ``__post_init__`` from the sizes given, so it stays consistent; only roles in
   :data:`FORCED` (2 kv heads) are set anyway.
2. *Per-layer structure keeps its variety.* Lists with one entry per layer
   (``layer_types``, ``no_rope_layers``, per-layer rope thetas), lists of layer indices
   (``full_attn_idxs``, ``moe_layers``) and per-layer dicts (``per_layer_config``) are cut
   to the same :func:`choose_layers` selection of 4 layers, chosen so every kind of layer
   the family has (sliding and full, NoPE and RoPE, dense and MoE) is still there.
3. *Periods and offsets fit in 4 layers* (a global layer every 2, a dense prefix of 1).
4. *Token ids stay in the vocabulary*: special ids beyond the tiny vocabulary are mapped
   to distinct ids at its top (equal ids stay equal).
5. *No randomness*: every dropout and router jitter is 0, so a parallel run is compared
   with one process on the same arithmetic.

Nested configs (``ffn_config``, ``rope_parameters``) are shrunk by the same rules.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

__all__ = ["HEAD_DIM", "HIDDEN", "LADDER", "LAYERS", "RELAXATIONS", "ROLES", "SEQ", "VOCAB",
           "TinyConfig", "choose_layers", "first_line", "shrink_values", "tiny_config"]

from paraxis_hf.sizes import (
    FIXED,
    FORCED,
    HEAD_DIM,
    HEADS,
    HIDDEN,
    LAYER_INDEX_KEYS,
    LAYER_MARKS,
    LAYERS,
    PER_LAYER_DICT_KEYS,
    ROLES,
    SEQ,
    TIES,
    VOCAB,
)

_ROLE_OF = {key: role for role, (_, keys) in ROLES.items() for key in keys}


def _is_token_key(key: str) -> bool:
    return key.endswith(("_token_id", "_token_index")) or key in (
        "eos_token_id", "bos_token_id", "pad_token_id", "unk_index", "mask_index")


def _is_random(key: str) -> bool:
    return "drop" in key or "jitter" in key


def choose_layers(features: Sequence[Sequence[Any]], total: int, n: int = LAYERS) -> list[int]:
    """``n`` of ``total`` layer indices, the first ones unless a kind of layer would be
    lost: for each per-layer feature, every distinct value keeps at least one layer
    (its first), replacing the latest chosen layer whose values are all duplicated."""
    chosen = list(range(min(n, total)))
    for feature in features:
        for value in dict.fromkeys(feature):
            if any(feature[i] == value for i in chosen):
                continue
            first = next(i for i, v in enumerate(feature) if v == value)
            for j in reversed(range(len(chosen))):
                if all(sum(f[c] == f[chosen[j]] for c in chosen) > 1 for f in features):
                    chosen[j] = first
                    break
            chosen.sort()
    return chosen


RELAXATIONS = {
    # Fields the config would derive, given (shrunk) instead: for defaults it derives
    # without looking at the sizes given (a hard-coded layer pattern, 512 experts).
    "explicit": "derived fields given explicitly",
    # Routers that send each token to one expert only.
    "top1": "one expert per token",
    # Attention that assumes one key/value head per query head (latent attention).
    "mha": "one key/value head per query head",
    # Defaults that leave a size unset that the model needs (experts: None).
    "fill": "sizes the defaults leave unset set to their tiny values",
}
# Relaxations of the shrinker, fewest first: the matrix's tiny configs and the probe's
# twins try them in this order until one builds.
LADDER = [frozenset(c) for n in range(len(RELAXATIONS) + 1)
          for c in itertools.combinations(RELAXATIONS, n)]
_FILLABLE = ("experts", "top_k", "expert_intermediate", "intermediate", "shared_experts")


@dataclasses.dataclass
class _Context:
    layers: int  # the (sub-)config's own depth
    positions: int  # its own max positions
    chosen: list[int]  # the layers kept (rule 2)
    relax: frozenset[str]
    token_map: dict[int, int]  # shared by nested configs: equal ids stay equal

    @classmethod
    def of(cls, values: dict[str, Any], relax: frozenset[str],
           token_map: dict[int, int], keep: int = LAYERS) -> _Context:
        """``keep``: how many layers the tiny config has (:data:`LAYERS` by default)."""
        layers = _first(values, "layers")
        chosen = (choose_layers(_per_layer_features(values, layers), layers, keep)
                  if layers else [])
        return cls(layers, _first(values, "positions"), chosen, relax, token_map)


def _role_value(key: str, value: Any, ctx: _Context) -> Any:
    role = _ROLE_OF[key]
    fixed, _ = ROLES[role]
    if role == "kv_heads" and "mha" in ctx.relax:
        fixed = HEADS
    if role == "top_k" and "top1" in ctx.relax:
        fixed = 1
    if isinstance(value, list):
        return [_role_value(key, v, ctx) for v in value]
    if value is None and (role in FORCED or ("fill" in ctx.relax and role in _FILLABLE)):
        return fixed(1) if callable(fixed) else fixed
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        return value  # 0 / None mean "off" (no shared experts, no window)
    return fixed(value) if callable(fixed) else fixed


def _per_layer(key: str, value: Any, ctx: _Context) -> tuple[bool, Any]:
    """Rule 2: (applies, new value)."""
    if key in LAYER_INDEX_KEYS and isinstance(value, list):
        return True, [j for j, i in enumerate(ctx.chosen) if i in set(value)]
    if key in PER_LAYER_DICT_KEYS and isinstance(value, dict):
        width = max((len(k) for k in value), default=2)
        return True, {str(j).zfill(width): shrink_values(value[str(i).zfill(width)], ctx)
                      for j, i in enumerate(ctx.chosen) if str(i).zfill(width) in value}
    if isinstance(value, list) and ctx.layers > LAYERS and len(value) == ctx.layers:
        picked = [value[i] for i in ctx.chosen]
        return True, _role_value(key, picked, ctx) if key in _ROLE_OF else picked
    return False, value


def _rope(value: dict[str, Any], ctx: _Context) -> dict[str, Any]:
    out = dict(value)
    partial = out.get("partial_rotary_factor") or 1.0
    pairs = max(1, int(HEAD_DIM * partial) // 2)  # rotary frequencies per head
    for key, v in value.items():
        if isinstance(v, dict):  # per layer type
            out[key] = _rope(v, ctx)
        elif key.endswith("factor") and isinstance(v, list):
            out[key] = (v * pairs)[:pairs]
        elif key == "mrope_section" and isinstance(v, list) and sum(v):
            cut = [max(1, round(x * pairs / sum(v))) for x in v]
            cut[0] += pairs - sum(cut)
            out[key] = cut
        elif key == "original_max_position_embeddings" and isinstance(v, int):
            out[key] = max(SEQ, round(v * ROLES["positions"][0] / max(ctx.positions, 1)))
    return out


def _one(key: str, value: Any, ctx: _Context) -> Any:
    applies, new = _per_layer(key, value, ctx)
    if applies:
        return new
    if key in _ROLE_OF:
        return _role_value(key, value, ctx)
    if key in FIXED:
        return FIXED[key]
    if key in LAYER_MARKS and _is_int(value) and ctx.layers:
        if LAYER_MARKS[key] == "index":
            return sum(i < value for i in ctx.chosen)
        return sum(_marks(key, value, ctx.layers)[i] for i in ctx.chosen)
    if _is_token_key(key):
        return _map_tokens(value, ctx)
    if _is_random(key) and isinstance(value, float):
        return 0.0
    if key.startswith("rope") and isinstance(value, dict):
        return _rope(value, ctx)
    if _is_run_length(value) and ctx.layers:
        return [[pattern, max(1, LAYERS // len(pattern))] for pattern, _ in value[:1]]
    if isinstance(value, dict) and ("model_type" in value or key.endswith("config")):
        return _nested(value, ctx)
    return value


def _is_run_length(value: Any) -> bool:
    """Per-layer kinds written as ``[[pattern, repeats], ...]`` (GPT-Neo's attention)."""
    return isinstance(value, list) and bool(value) and all(
        isinstance(v, list) and len(v) == 2 and isinstance(v[0], list) and isinstance(v[1], int)
        for v in value)


def _map_tokens(value: Any, ctx: _Context) -> Any:
    if isinstance(value, list):
        return [_map_tokens(v, ctx) for v in value]
    if isinstance(value, int) and not isinstance(value, bool) and value >= VOCAB:
        return ctx.token_map.setdefault(value, VOCAB - 1 - len(ctx.token_map))
    return value


def shrink_values(values: dict[str, Any], ctx: _Context,
                  cls: type | None = None) -> dict[str, Any]:
    """The tiny value of every field that changes, under the name the config's
    constructor takes (``attribute_map`` aliases undone). Fields the config computes are
    left to it (rule 1): keys that are no field (computed in ``__post_init__``), and
    fields declared ``None`` unless forced or per-layer."""
    cls = cls or _config_class(values.get("model_type"))
    declared_none, computed = _declared_none(cls), _computed(cls, values)
    out = {}
    for key, value in values.items():
        role = _ROLE_OF.get(key)
        forced = role in FORCED or ("fill" in ctx.relax and role in _FILLABLE)
        # A per-layer list the config would derive is given anyway: derived from the
        # tiny sizes it would lose the kinds of layers the selection kept.
        per_layer = _per_layer(key, value, ctx)[0]
        derive = key in declared_none and "explicit" not in ctx.relax and not per_layer
        if (key in computed and not per_layer) or (
                derive and not forced and not isinstance(value, dict)):
            continue
        new = _one(key, value, ctx)
        if new != value or (key in declared_none and forced and new is not None):
            out[_aliases(cls).get(key, key)] = new
    for a, b in TIES:
        if a in out and b in out and values.get(a) == values.get(b):
            out[a] = out[b]
    return out


def _nested(value: dict[str, Any], ctx: _Context) -> dict[str, Any]:
    """A nested config whole (its class is rebuilt from the dict), minus what it
    computes, with its fields shrunk."""
    cls = _config_class(value.get("model_type"))
    kept = {k: v for k, v in value.items() if k not in _computed(cls, value)}
    return {**kept, **shrink_values(value, _Context.of(value, ctx.relax, ctx.token_map), cls)}


def _config_class(model_type: Any) -> type | None:
    from transformers import CONFIG_MAPPING

    try:
        return CONFIG_MAPPING[model_type]
    except KeyError:
        return None


def _first(values: dict[str, Any], role: str) -> int:
    for key in ROLES[role][1]:
        v = values.get(key)
        if _is_int(v):
            return v
    return 0


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _marks(key: str, value: int, layers: int) -> list[bool]:
    """Which of ``layers`` layers the scalar ``key = value`` marks (:data:`LAYER_MARKS`)."""
    kind = LAYER_MARKS[key]
    if kind == "prefix":
        return [i < value for i in range(layers)]
    if kind == "suffix":
        return [i >= layers - value for i in range(layers)]
    return [i == value for i in range(layers)]


def _per_layer_features(values: dict[str, Any], layers: int) -> list[list[Any]]:
    features = []
    for key, value in values.items():
        if key in LAYER_MARKS and _is_int(value) and 0 < value < layers:
            features.append(_marks(key, value, layers))
        if key in LAYER_INDEX_KEYS and isinstance(value, list):
            features.append([i in set(value) for i in range(layers)])
        elif key in PER_LAYER_DICT_KEYS and isinstance(value, dict):
            width = max((len(k) for k in value), default=2)
            features.append([repr(value.get(str(i).zfill(width))) for i in range(layers)])
        elif isinstance(value, list) and layers > LAYERS and len(value) == layers:
            features.append([repr(v) for v in value])
    # Types of layers first: they matter most for what a stage or a shard must keep.
    features.sort(key=lambda f: len(set(f)), reverse=True)
    return features


def _declared_none(cls: type | None) -> frozenset[str]:
    if cls is None or not dataclasses.is_dataclass(cls):
        return frozenset()
    return frozenset(f.name for f in dataclasses.fields(cls) if f.default is None)


def _computed(cls: type | None, values: dict[str, Any]) -> frozenset[str]:
    """Keys of ``values`` that are no field of ``cls`` nor an alias of one: its
    ``__post_init__`` computed them (``qk_head_dim = qk_nope_head_dim + qk_rope_head_dim``)."""
    if cls is None or not dataclasses.is_dataclass(cls):
        return frozenset()
    return frozenset(values) - {f.name for f in dataclasses.fields(cls)} - set(
        _aliases(cls))


def _aliases(cls: type | None) -> dict[str, str]:
    """Attribute name -> the field the constructor takes (``to_dict`` writes the
    attribute: Qwen3-MoE's ``num_local_experts`` is its field ``num_experts``)."""
    if cls is None or not dataclasses.is_dataclass(cls):
        return {}
    fields = {f.name for f in dataclasses.fields(cls)}
    return {real: alias for alias, real in getattr(cls, "attribute_map", {}).items()
            if alias in fields and real not in fields}


@dataclasses.dataclass
class TinyConfig:
    """A tiny config (or why none could be built) and the overrides that made it."""

    model_type: str
    config: Any = None
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict)
    relax: frozenset[str] = frozenset()
    error: str | None = None


def tiny_config(model_type: str, relax: frozenset[str] = frozenset()) -> TinyConfig:
    """Shrink ``model_type``'s default config (see the module docstring); ``relax``
    names :data:`RELAXATIONS` to apply. A config still holding lists of its old depth
    (a default pattern the config hard-codes) is an error: ``explicit`` may fix it."""
    cls = _config_class(model_type)
    try:
        values = cls().to_dict()
    except Exception as exc:  # a config that cannot be built from its own defaults
        return TinyConfig(model_type, relax=relax,
                          error=f"its default config fails: {first_line(exc)}")
    ctx = _Context.of(values, relax, {})
    overrides = shrink_values(values, ctx, cls)
    if "is_decoder" in values:  # a causal LM's config is a decoder's (BERT-likes: causal mask)
        overrides["is_decoder"] = True
    config, error = _construct(cls, overrides)
    if error is None and _old_depth_lists(config.to_dict(), ctx):
        error = (f"per-layer lists keep the default depth {ctx.layers}: "
                 f"{sorted(_old_depth_lists(config.to_dict(), ctx))}")
    return TinyConfig(model_type, config=None if error else config, overrides=overrides,
                      relax=relax, error=error and f"the tiny config fails: {error}")


def _construct(cls: Any, overrides: dict[str, Any]) -> tuple[Any, str | None]:
    try:
        return cls(**overrides), None
    except Exception as exc:
        return None, first_line(exc)


def _old_depth_lists(values: dict[str, Any], ctx: _Context) -> list[str]:
    if ctx.layers <= LAYERS:
        return []
    return [k for k, v in values.items() if isinstance(v, list) and len(v) == ctx.layers]


def first_line(exc: BaseException) -> str:
    """``Type: first line of the message``, short enough for a table cell."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:240]
