"""paraxis data parallel: replicate the model, average gradients over replicas."""

from paraxis_dp.strategy import DataParallelStrategy
from paraxis_dp.sync import DataParallel

__all__ = ["DataParallel", "DataParallelStrategy"]
