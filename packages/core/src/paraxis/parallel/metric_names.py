"""The grammar of metric names an axis reports, in one place: producers build names
with these functions and readers (the trainer's summary, the W&B panels) parse them
with the same module, so the two cannot drift apart.

Mixture-of-experts metrics (paraxis-moe-ep):

* ``moe/<total>``: a run-wide number (``moe/aux_loss``, ``moe/load_imbalance``...);
* ``moe/<block>/<total>``: one MoE block's (``moe/model.layers.1.mlp/router_entropy``);
* ``moe/<block>/<kind>/<i>``: one expert's (or one histogram bin's) number, ``kind`` in
  :data:`MOE_ARRAY_KINDS`.
"""

from __future__ import annotations

import re
from typing import NamedTuple

__all__ = ["MOE_ARRAY_KINDS", "MOE_PREFIX", "MoeArrayEntry", "moe_array", "moe_block",
           "moe_total", "parse_moe_array"]

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
