"""Entry point of paraxis-seq-context in the ``paraxis`` plugin group."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from paraxis.hookspecs import hookimpl
from paraxis.strategy import Strategy


@hookimpl
def paraxis_register_strategies(register: Callable[[type[Strategy]], None]) -> None:
    from paraxis_seq.strategy import ContextParallelStrategy

    register(ContextParallelStrategy)


@hookimpl
def paraxis_validate_config(config: Any, model: Any, problems: list[Any]) -> None:
    """Zigzag sharding cuts the sequence into 2 x context chunks."""
    from paraxis.errors import Problem

    context = config.parallelism.context
    seq = getattr(model, "seq_length", None)
    if context > 1 and seq is not None and seq % (2 * context):
        problems.append(Problem("model.seq_length", seq,
                                f"must divide into 2 x context = {2 * context} equal chunks "
                                "(zigzag sharding balances causal attention over context "
                                "ranks)", f"use a multiple of {2 * context}"))
