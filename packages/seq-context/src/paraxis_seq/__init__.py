"""paraxis context parallelism: the sequence split over the ``context`` axis, attention
by ring (zigzag-balanced) or by DeepSpeed-Ulysses all-to-all."""

from paraxis_seq.ring import ring_attention
from paraxis_seq.rules import check_context, check_module
from paraxis_seq.strategy import ContextParallelStrategy, SequenceSplit
from paraxis_seq.ulysses import (
    kv_replication,
    local_attention,
    sdpa_attention,
    ulysses_attention,
)
from paraxis_seq.variant import Variant
from paraxis_seq.zigzag import LAYOUTS, positions, shard, shard_order, unshard

__all__ = [
    "LAYOUTS",
    "ContextParallelStrategy",
    "SequenceSplit",
    "Variant",
    "check_context",
    "check_module",
    "kv_replication",
    "local_attention",
    "positions",
    "ring_attention",
    "sdpa_attention",
    "shard",
    "shard_order",
    "ulysses_attention",
    "unshard",
]
