"""The ZeRO axis' configuration rules, checked before any process group exists
(through the ``paraxis_validate_config`` hook)."""

from __future__ import annotations

from paraxis.config.errors import Problem
from paraxis.config.parallel import ParallelConfig
from paraxis.config.shape import ModelShape

__all__ = ["check_zero"]


def check_zero(config: ParallelConfig, model: ModelShape | None) -> list[Problem]:
    par = config.parallelism
    problems = _zero_shard_problems(config)
    if par.zero == 0:
        return problems
    if config.token_replicas == 1:
        problems.append(Problem(
            "parallelism.zero", par.zero,
            "shards over data-parallel replicas, and data = expert = context = 1 leaves "
            "none: it would be a silent no-op",
            "set parallelism.data > 1, or parallelism.zero: 0"))
    return problems


def _zero_shard_problems(config: ParallelConfig) -> list[Problem]:
    """``zero_shard`` (HSDP) cuts the data axis into groups of that many ranks."""
    par, n = config.parallelism, config.parallelism.zero_shard
    if n is None:
        return []
    if par.zero == 0:
        return [Problem("parallelism.zero_shard", n,
                        "sets the size of ZeRO's shard groups, and zero is 0: nothing is "
                        "sharded", "set parallelism.zero: 1, 2 or 3, or drop zero_shard")]
    if par.data % n:
        return [Problem("parallelism.zero_shard", n,
                        f"must divide parallelism.data ({par.data}): ZeRO shards over "
                        f"groups of {n} data ranks and replicates across the groups",
                        f"use one of {[d for d in range(2, par.data + 1) if par.data % d == 0]}"
                        ", or drop zero_shard to shard over every data rank")]
    if n == 1:
        return [Problem("parallelism.zero_shard", n,
                        "groups of one data rank shard nothing (every rank holds the "
                        "whole state, as plain data parallelism does)",
                        "use zero_shard >= 2, or parallelism.zero: 0")]
    return []
