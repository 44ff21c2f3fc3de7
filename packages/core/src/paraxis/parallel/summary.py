"""What an axis adds to the end of a run (the ``paraxis_summarize_run`` hook): numbers
for the summary, rows for its table, pictures for the logger and lines to print. The
trainer shows them; it does not know which axis made them."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["RunReport"]


@dataclass
class RunReport:
    # Summary values (also handed to the sinks' ``end``), e.g. moe/most_loaded_vs_mean.
    values: dict[str, float] = field(default_factory=dict)
    # (name, text) rows of the summary table, e.g. the most loaded expert.
    rows: list[tuple[str, str]] = field(default_factory=list)
    # (name, SVG document): written in the run's directory and given to the sinks.
    figures: list[tuple[str, str]] = field(default_factory=list)
    # Lines printed on the logging rank (a pipeline's measured bubble).
    text: list[str] = field(default_factory=list)
