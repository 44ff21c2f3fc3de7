"""The grammar of metric names, in one place: producers build names with these
functions and readers (the console, the summary, the sinks: W&B, TensorBoard,
metrics.jsonl) parse them with the same module, so the two cannot drift apart.

Communication per process group (core's engine):

* ``comm/<group>_bytes`` and ``comm/<group>_exposed_s``, ``<group>`` named as a user
  thinks of it (issue 38), from the grid's axis table (:func:`group_names`): ``world``
  (every axis), ``replicas`` (the ranks holding distinct tokens, data x expert x context,
  over which dense gradients are averaged), ``expert_replicas`` (data x context),
  ``sequence_shards`` (the replicas and tensor: a router's statistics under sequence
  parallelism), or one axis' name (``tensor``, ``pipeline``...). A group of one rank moves
  nothing and is left out.

Mixture-of-experts metrics (paraxis-moe-ep):

* ``moe/<total>``: a run-wide number (``moe/aux_loss``, ``moe/load_imbalance``...);
* ``moe/<block>/<total>``: one MoE block's (``moe/model.layers.1.mlp/router_entropy``);
* ``moe/<block>/<kind>/<i>``: one expert's (or one histogram bin's) number, ``kind`` in
  :data:`MOE_ARRAY_KINDS`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from paraxis.config.axes import AxisTable

__all__ = ["CONSOLE_MOE", "MOE_ARRAY_KINDS", "MOE_PREFIX", "MoeArrayEntry", "MoeArrays",
           "comm_metric", "group_names", "moe_array", "moe_arrays", "moe_block",
           "moe_total", "parse_moe_array"]

COMM_PREFIX = "comm"


def group_names(table: AxisTable, degrees: Mapping[str, int]) -> dict[str, str | None]:
    """The groups collectives are counted under (``"x".join(axes)``, as
    :class:`paraxis.runtime.comm_stats.CommStats` keys them) -> the name a metric shows,
    None for a group of one rank (left out). The names come from the table's own groups
    (its roles), not from a list of axis names, so an axis a package adds is named too; a
    group outside this table (one a plugin builds for itself) keeps its key."""
    named = [  # lowest precedence first: a later name wins for the same axes
        *(((a,), a) for a in table.names),
        (table.sequence_shard_axes, "sequence_shards"),
        (table.expert_replica_axes, "expert_replicas"),
        (table.token_axes, "replicas"),
        (table.names, "world"),
    ]
    out: dict[str, str | None] = {"self": None}
    for axes, name in named:
        if axes:
            ranks = math.prod(degrees.get(a, 1) for a in axes)
            out["x".join(axes)] = name if ranks > 1 else None
    return out


def comm_metric(group: str, kind: str) -> str:
    """``comm/<group>_<kind>``: ``kind`` is ``bytes`` or ``exposed_s``."""
    return f"{COMM_PREFIX}/{group}_{kind}"

MOE_PREFIX = "moe"
# Per-expert arrays (``prob_hist`` is per bin of routing probability over [0, 1]).
MOE_ARRAY_KINDS: tuple[str, ...] = ("assigned", "accepted", "dropped", "processed",
                                    "dispatch_bytes", "compute_s", "prob_mean", "prob_hist")
_ARRAY = re.compile(rf"^{MOE_PREFIX}/(.+)/({'|'.join(MOE_ARRAY_KINDS)})/(\d+)$")


class MoeArrayEntry(NamedTuple):
    block: str
    kind: str
    index: int


def moe_total(name: str) -> str:
    """``moe/<name>``: a run-wide MoE number."""
    return f"{MOE_PREFIX}/{name}"


def moe_block(block: str, name: str) -> str:
    """``moe/<block>/<name>``: one block's number."""
    return f"{MOE_PREFIX}/{block}/{name}"


def moe_array(block: str, kind: str, index: int) -> str:
    """``moe/<block>/<kind>/<index>``: one expert's (or bin's) number."""
    if kind not in MOE_ARRAY_KINDS:
        raise ValueError(f"unknown MoE array kind {kind!r}; known: {MOE_ARRAY_KINDS}")
    return f"{MOE_PREFIX}/{block}/{kind}/{index}"


def parse_moe_array(key: str) -> MoeArrayEntry | None:
    """The (block, kind, index) of a per-expert metric name, or None for any other."""
    hit = _ARRAY.match(key)
    return None if hit is None else MoeArrayEntry(hit[1], hit[2], int(hit[3]))


MoeArrays = dict[str, dict[str, list[float]]]


def _layer_key(name: str) -> tuple[object, ...]:
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name))


def moe_arrays(metrics: Mapping[str, float]) -> tuple[dict[str, float], MoeArrays]:
    """(the scalar metrics, {block: {kind: values by expert (or bin)}}), blocks in layer
    order: what a sink shows as numbers and what it shows as a table or picture."""
    scalars: dict[str, float] = {}
    arrays: MoeArrays = {}
    for key, value in metrics.items():
        hit = parse_moe_array(key)
        if hit is None:
            scalars[key] = value
            continue
        values = arrays.setdefault(hit.block, {}).setdefault(hit.kind, [])
        values.extend([0.0] * (hit.index + 1 - len(values)))
        values[hit.index] = float(value)
    return scalars, {b: arrays[b] for b in sorted(arrays, key=_layer_key)}


# What the console line shows of an MoE run (paraxis-moe-ep's run-wide numbers): the
# load-balancing loss, the most loaded expert over the mean, the share of dropped pairs.
CONSOLE_MOE: tuple[tuple[str, str, str], ...] = (
    (moe_total("aux_loss"), "aux", "{:.4f}"),
    (moe_total("load_imbalance"), "imbalance", "{:.2f}"),
    (moe_total("dropped_fraction"), "dropped", "{:.1%}"),
)
