"""Core's own plugin: the strategies that need no extra package."""

from __future__ import annotations

from collections.abc import Callable

from paraxis.hookspecs import hookimpl
from paraxis.strategy import Strategy


@hookimpl
def paraxis_register_strategies(register: Callable[[type[Strategy]], None]) -> None:
    from paraxis.recompute import ActivationCheckpointing

    register(ActivationCheckpointing)
