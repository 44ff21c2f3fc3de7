"""Entry point of paraxis-tensorboard in the ``paraxis`` plugin group: an event file as
one of the run's metric sinks when ``logging.tensorboard`` names a directory."""

from __future__ import annotations

from typing import Any

from paraxis.parallel.hookspecs import hookimpl
from paraxis_tensorboard.sink import TensorBoardSink


@hookimpl
def paraxis_metric_sinks(config: Any, directory: str) -> list[TensorBoardSink] | None:
    where = getattr(getattr(config, "logging", None), "tensorboard", None)
    return [TensorBoardSink(where)] if where else None
