"""The TensorBoard sink: torch's ``SummaryWriter`` on the logging rank."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from paraxis.parallel.metric_names import moe_arrays, moe_total
from paraxis.parallel.sink import MetricSink
from paraxis_tensorboard.pictures import load_heatmap, svg_picture

__all__ = ["TensorBoardSink"]


class TensorBoardSink(MetricSink):
    """Scalars every logged step, the MoE load heatmap as an image, the axes' figures
    (the pipeline timeline) as images, the configuration and the summary as text."""

    name = "tensorboard"

    def __init__(self, log_dir: str | Path):
        self.log_dir = Path(log_dir)
        self.writer: Any = None
        self.last_step = 0

    def start(self, config: Any, grid: dict[str, Any], first_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: events at or past it left by an earlier attempt are discarded, so
        # a resumed run's curves show each step once.
        self.writer = SummaryWriter(str(self.log_dir),
                                    purge_step=first_step + 1 if first_step else None)
        dump = getattr(config, "model_dump", None)
        payload = {"run": dump(mode="json") if dump else {}, "grid": grid}
        self.writer.add_text("config", "```\n" + json.dumps(payload, indent=2) + "\n```",
                             first_step)

    def metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.last_step = step
        scalars, arrays = moe_arrays(metrics)
        for key, value in scalars.items():
            if key != "step" and isinstance(value, int | float):
                self.writer.add_scalar(key, value, step)
        if arrays:
            self.writer.add_image(moe_total("load_heatmap"), load_heatmap(arrays), step,
                                  dataformats="HWC")
        self.writer.flush()  # readable while the run goes on

    def figure(self, name: str, svg: str, step: int) -> None:
        self.last_step = max(self.last_step, step)
        picture = svg_picture(svg)
        if picture is not None:
            self.writer.add_image(name, picture, step, dataformats="HWC")
            self.writer.flush()

    def end(self, summary: dict[str, float] | None,
            rows: Sequence[tuple[str, str]] = ()) -> None:
        if self.writer is None:
            return
        if summary is not None:
            table = ["| metric | value |", "| --- | --- |"]
            table += [f"| {k} | {v:.6g} |" for k, v in summary.items()
                      if isinstance(v, int | float) and math.isfinite(v)]
            table += [f"| {k} | {text} |" for k, text in rows]
            self.writer.add_text("summary", "\n".join(table), self.last_step)
        self.writer.close()
        self.writer = None
