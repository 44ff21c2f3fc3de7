"""Entry point of paraxis-moe-ep in the ``paraxis`` plugin group."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from paraxis.config.errors import Problem
from paraxis.parallel.hookspecs import hookimpl
from paraxis.parallel.strategy import Strategy


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


@hookimpl
def paraxis_summarize_run(ctx: Any, history: list[dict[str, float]]) -> Any:
    """The most and least loaded expert over the run (load over the mean load), from the
    per-expert ``assigned`` metrics."""
    from paraxis_moe.stats import expert_load_report

    return expert_load_report(history)
