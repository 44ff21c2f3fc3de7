"""Entry point of paraxis-deepspeed in the ``paraxis`` plugin group."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from paraxis.parallel.hookspecs import hookimpl
from paraxis.parallel.strategy import Strategy


@hookimpl
def paraxis_register_strategies(register: Callable[[type[Strategy]], None]) -> None:
    from paraxis_deepspeed.strategy import OffloadStrategy

    register(OffloadStrategy)


@hookimpl
def paraxis_validate_config(config: Any, model: Any, problems: list) -> None:
    from paraxis_deepspeed.rules import check_offload

    check_offload(config, problems)


@hookimpl
def paraxis_model_context(config: Any) -> Any:
    from paraxis_deepspeed.construct import partitioned_construction

    return partitioned_construction(config)


@hookimpl
def paraxis_cli_commands(subparsers: Any) -> None:
    from paraxis_deepspeed.cli import add_show_deepspeed

    add_show_deepspeed(subparsers)
