"""Core's own plugin: the strategies that need no extra package, and the plan and stage
calls of core's ``tiny`` model (so that every axis can be tested without transformers)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from paraxis.models.tiny import TINY_PLAN, TinyCalls, TinyTransformer
from paraxis.parallel.hookspecs import hookimpl
from paraxis.parallel.recompute import ActivationCheckpointing
from paraxis.parallel.strategy import Strategy


@hookimpl
def paraxis_register_strategies(register: Callable[[type[Strategy]], None]) -> None:
    register(ActivationCheckpointing)


@hookimpl(trylast=True)
def paraxis_model_plan(model: Any) -> Any:
    return TINY_PLAN if isinstance(model, TinyTransformer) else None


@hookimpl(trylast=True)
def paraxis_stage_calls(model: Any, plan: Any) -> Any:
    return TinyCalls() if isinstance(model, TinyTransformer) else None
