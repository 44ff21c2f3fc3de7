"""paraxis tensor parallelism: Megatron-LM layers, vocab-parallel loss, sequence parallel."""

from paraxis_tp.cross_entropy import VocabParallelLoss, vocab_parallel_cross_entropy
from paraxis_tp.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from paraxis_tp.rng import TensorParallelRNG
from paraxis_tp.strategy import TensorParallelStrategy

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "TensorParallelRNG",
    "TensorParallelStrategy",
    "VocabParallelEmbedding",
    "VocabParallelLoss",
    "vocab_parallel_cross_entropy",
]
