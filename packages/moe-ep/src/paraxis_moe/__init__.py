"""paraxis expert parallelism: the model's own MoE blocks, their experts sharded over
the ``expert`` axis and reached by all-to-all; routing logged per layer and expert."""

from paraxis_moe.capacity import expert_capacity, keep_mask
from paraxis_moe.config import MoEConfig, aux_coef, experts_per_token, moe_config
from paraxis_moe.dispatcher import AllToAllDispatcher
from paraxis_moe.experts import ExpertParallelExperts, UnsupportedMoELayout, shard_experts
from paraxis_moe.layer import ExpertParallel
from paraxis_moe.router import RouterLosses
from paraxis_moe.stats import LayerStats, MoEStats
from paraxis_moe.strategy import ExpertParallelStrategy

__all__ = [
    "AllToAllDispatcher",
    "ExpertParallel",
    "ExpertParallelExperts",
    "ExpertParallelStrategy",
    "LayerStats",
    "MoEConfig",
    "MoEStats",
    "RouterLosses",
    "UnsupportedMoELayout",
    "aux_coef",
    "expert_capacity",
    "experts_per_token",
    "keep_mask",
    "moe_config",
    "shard_experts",
]
