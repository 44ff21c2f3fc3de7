"""Entry point of paraxis-seq-context in the ``paraxis`` plugin group."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from paraxis.parallel.hookspecs import hookimpl
from paraxis.parallel.strategy import Strategy


@hookimpl
def paraxis_register_strategies(register: Callable[[type[Strategy]], None]) -> None:
    from paraxis_seq.strategy import ContextParallelStrategy

    register(ContextParallelStrategy)


@hookimpl
def paraxis_validate_config(config: Any, model: Any, problems: list[Any]) -> None:
    """Sequence divisible into 2 x context zigzag chunks; in Ulysses mode heads divisible
    by tensor x context (:mod:`paraxis_seq.rules`)."""
    from paraxis_seq.rules import check_context

    problems.extend(check_context(config, model))
