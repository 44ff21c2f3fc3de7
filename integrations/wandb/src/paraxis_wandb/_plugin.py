"""Entry point of paraxis-wandb in the ``paraxis`` plugin group: a W&B run as one of
the run's metric sinks (``paraxis_metric_sinks``).

The trainer asks on the logging rank only; the other ranks never open a W&B run.
"""

from __future__ import annotations

from typing import Any

from paraxis.parallel.hookspecs import hookimpl
from paraxis_wandb.logger import WandbLogger


@hookimpl
def paraxis_metric_sinks(config: Any, directory: str) -> list[WandbLogger] | None:
    section = getattr(config, "logging", None)
    if section is not None and not section.wandb:
        return None
    return [WandbLogger(background=True)]


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
