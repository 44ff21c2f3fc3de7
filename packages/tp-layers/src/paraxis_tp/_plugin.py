"""Entry point of paraxis-tp-layers in the ``paraxis`` plugin group."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from paraxis.parallel.hookspecs import hookimpl
from paraxis.parallel.strategy import Strategy


@hookimpl
def paraxis_validate_config(config: Any, model: Any, problems: list[Any]) -> None:
    from paraxis_tp.rules import check_tensor

    problems.extend(check_tensor(config, model))


@hookimpl
def paraxis_register_strategies(register: Callable[[type[Strategy]], None]) -> None:
    from paraxis_tp.strategy import TensorParallelStrategy

    register(TensorParallelStrategy)
