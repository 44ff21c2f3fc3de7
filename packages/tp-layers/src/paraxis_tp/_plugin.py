"""Entry point of paraxis-tp-layers in the ``paraxis`` plugin group."""

from __future__ import annotations

from collections.abc import Callable

from paraxis.hookspecs import hookimpl
from paraxis.strategy import Strategy


@hookimpl
def paraxis_register_strategies(register: Callable[[type[Strategy]], None]) -> None:
    from paraxis_tp.strategy import TensorParallelStrategy

    register(TensorParallelStrategy)
