"""Entry point of paraxis-wandb in the ``paraxis`` plugin group.

The logger is per process; the trainer calls these hooks on the logging rank only.
"""

from __future__ import annotations

from typing import Any

from paraxis.parallel.hookspecs import hookimpl
from paraxis_wandb.logger import WandbLogger

_logger = WandbLogger(background=True)


@hookimpl
def paraxis_log_start(config: Any, grid: dict[str, Any]) -> None:
    _logger.start(config, grid)


@hookimpl
def paraxis_log_metrics(step: int, metrics: dict[str, float]) -> None:
    _logger.metrics(step, metrics)


@hookimpl
def paraxis_log_figure(name: str, svg: str, step: int) -> None:
    _logger.figure(name, svg, step)


@hookimpl
def paraxis_log_end(summary: dict[str, float]) -> None:
    _logger.end(summary)


@hookimpl
def paraxis_before_workers(config: Any) -> None:
    """W&B imported and its service started in the launcher: the logging rank, forked
    from it, opens its run on that service (W&B's ``wandb.setup()`` for multiprocess
    training) instead of paying both before its first step."""
    section = getattr(config, "logging", None)
    if section is None or not section.wandb:
        return
    try:
        import wandb

        wandb.setup()
    except Exception:  # never let logging stop training: the rank sets W&B up itself
        return
