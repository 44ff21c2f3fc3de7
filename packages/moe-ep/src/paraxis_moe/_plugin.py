"""Entry point of paraxis-moe-ep in the ``paraxis`` plugin group."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from paraxis.errors import Problem
from paraxis.hookspecs import hookimpl
from paraxis.strategy import Strategy


@hookimpl
def paraxis_register_strategies(register: Callable[[type[Strategy]], None]) -> None:
    from paraxis_moe.strategy import ExpertParallelStrategy

    register(ExpertParallelStrategy)


@hookimpl
def paraxis_validate_config(config: Any, model: Any, problems: list[Problem]) -> None:
    """Expert degree on a dense model or not dividing the experts, top-k above the
    expert count, sequence parallelism with experts, a non-positive capacity factor."""
    from paraxis_moe.config import moe_problems

    problems.extend(moe_problems(config, model, problems))
