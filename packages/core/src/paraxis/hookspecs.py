"""The hook specifications: the only coupling between paraxis packages (DESIGN section 4).

Every plugin is a module named by an entry point in the ``paraxis`` group; it implements
some of these hooks with :data:`hookimpl`. A test fails when a spec here has no docstring.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from paraxis.config import ParallelConfig
    from paraxis.errors import Problem
    from paraxis.strategy import Strategy
    from paraxis.validation import ModelShape

__all__ = ["hookimpl", "hookspec"]

PROJECT = "paraxis"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def paraxis_register_strategies(register: Callable[[type[Strategy]], None]) -> None:
    """Hand this plugin's strategy classes to ``register``.

    Called once by :func:`paraxis.plugins.collect_strategies` when a run resolves its
    axes. ``register`` takes a :class:`paraxis.strategy.Strategy` subclass; registering
    two classes for the same axis is an error. Plugins must register here, never as a
    side effect of being imported. Not firstresult: every plugin is called.
    """


@hookspec
def paraxis_validate_config(
    config: ParallelConfig, model: ModelShape | None, problems: list[Problem]
) -> None:
    """Append the plugin's own rules' :class:`paraxis.errors.Problem` items to ``problems``.

    Called by :func:`paraxis.validation.validate` after core's rules and before any
    process group exists. ``model`` is None when no model shape is known. Append every
    problem found (do not raise), so the user sees all of them at once. Not firstresult.
    """


@hookspec(firstresult=True)
def paraxis_model_plan(model: Any) -> Any:
    """Return the parallel plan for ``model``, or None if this plugin does not know it.

    Called by core when an axis that rewrites modules (tensor, pipeline, expert) needs a
    plan and the user gave none. firstresult: the first non-None answer wins.
    """
