"""Test support: the multi-rank harness and tiny reference models."""

from paraxis.testing.distributed import DistributedWorld, RankFailure, free_port, run_distributed

__all__ = ["DistributedWorld", "RankFailure", "free_port", "run_distributed"]
