"""Entry point of paraxis-zero-shard in the ``paraxis`` plugin group."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from paraxis.parallel.hookspecs import hookimpl
from paraxis.parallel.strategy import Strategy


@hookimpl
def paraxis_validate_config(config: Any, model: Any, problems: list[Any]) -> None:
    from paraxis_zero.rules import check_zero

    problems.extend(check_zero(config, model))


@hookimpl
def paraxis_register_strategies(register: Callable[[type[Strategy]], None]) -> None:
    from paraxis_zero.strategy import ZeroStrategy

    register(ZeroStrategy)
