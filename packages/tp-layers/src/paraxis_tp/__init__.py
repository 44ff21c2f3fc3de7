"""paraxis tensor parallelism: Megatron-LM sharding of a model's own modules, vocab-parallel
loss, sequence parallel."""

from paraxis_tp.cross_entropy import VocabParallelLoss, vocab_parallel_cross_entropy
from paraxis_tp.layers import shard_column, shard_embedding, shard_row
from paraxis_tp.rng import TensorParallelRNG
from paraxis_tp.strategy import PartialGradSync, TensorParallelStrategy

__all__ = [
    "PartialGradSync",
    "TensorParallelRNG",
    "TensorParallelStrategy",
    "VocabParallelLoss",
    "shard_column",
    "shard_embedding",
    "shard_row",
    "vocab_parallel_cross_entropy",
]
