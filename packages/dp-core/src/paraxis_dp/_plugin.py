"""Entry point of paraxis-dp-core in the ``paraxis`` plugin group."""

from __future__ import annotations

from collections.abc import Callable

from paraxis.parallel.hookspecs import hookimpl
from paraxis.parallel.strategy import Strategy


@hookimpl
def paraxis_register_strategies(register: Callable[[type[Strategy]], None]) -> None:
    from paraxis_dp.strategy import DataParallelStrategy

    register(DataParallelStrategy)
