"""Entry point of paraxis-moe-ep in the ``paraxis`` plugin group."""

from __future__ import annotations

from typing import Any

from paraxis.errors import Problem
from paraxis.hookspecs import hookimpl


@hookimpl
def paraxis_validate_config(config: Any, model: Any, problems: list[Problem]) -> None:
    """Expert degree on a dense model or not dividing the experts, top-k above the
    expert count, and a non-positive capacity factor."""
    from paraxis_moe.config import moe_problems

    problems.extend(moe_problems(config, model, problems))
