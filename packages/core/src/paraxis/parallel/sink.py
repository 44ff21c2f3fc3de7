"""Where a run's metrics go: a :class:`MetricSink` (DESIGN section 10, "Sinks").

Metrics leave the trainer through one hook, ``paraxis_metric_sinks``: every plugin may
answer with sinks for the run (paraxis-wandb a W&B run, paraxis-tensorboard an event
file), and core adds its own two, the console and ``metrics.jsonl``
(:mod:`paraxis.train.sinks`). The trainer drives them all alike on the logging rank (the
first rank of the last pipeline stage), in this order: :meth:`~MetricSink.start` once,
:meth:`~MetricSink.step` after every step, :meth:`~MetricSink.metrics` every
``train.log_every`` steps (and at evaluations and the last step),
:meth:`~MetricSink.figure` for each picture an axis reports, :meth:`~MetricSink.end`
once. A sink that raises is switched off with one warning naming it: a sink never stops
training.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["MetricSink"]


class MetricSink:
    """A sink implements what it needs of these; each default does nothing."""

    name = "sink"  # for the warning that says a sink failed

    def start(self, config: Any, grid: dict[str, Any], first_step: int) -> None:
        """The run starts at ``first_step`` (0, or the resumed checkpoint's step): the
        :class:`paraxis.config.run.RunConfig` and the grid's ``describe()``. A sink that
        keeps a history drops what it holds past ``first_step`` (those steps are redone)."""

    def step(self, metrics: dict[str, float]) -> None:
        """Every step's metrics (the console's progress bar); must return at once."""

    def metrics(self, step: int, metrics: dict[str, float]) -> None:
        """A logged step's metrics: every metric the engine and the axes reported (loss,
        lr, tokens_per_s, step_time_s, exposed_comm_s, comm/<group>_..., moe/...), and
        eval_loss / eval_ppl after an evaluation."""

    def figure(self, name: str, svg: str, step: int) -> None:
        """A picture an axis reports at the end (an SVG document: the pipeline's
        measured timeline)."""

    def end(self, summary: dict[str, float] | None,
            rows: Sequence[tuple[str, str]] = ()) -> None:
        """The run ended: its summary and the axes' table rows, or None when it
        failed. A sink closes its files or service here."""
