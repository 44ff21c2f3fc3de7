"""The run's sinks (DESIGN section 10): core's console and ``metrics.jsonl``, then every
plugin's answer to ``paraxis_metric_sinks`` (:mod:`paraxis.parallel.sink`), driven
alike by :class:`Sinks` on the logging rank.

``metrics.jsonl`` is always written, in the run's directory (:func:`run_directory`), so
a run without W&B keeps its history a script can read: one JSON object per logged step
with every metric, ``step`` first; a value that is not finite is written as the string
``"nan"``, ``"inf"`` or ``"-inf"`` (strict JSON has no such numbers). A resumed run keeps
the lines up to its checkpoint's step and drops those after it (they are trained
again); a run that starts afresh starts the file afresh.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from paraxis.config.errors import ConfigError, Problem
from paraxis.config.run import RunConfig
from paraxis.parallel.sink import MetricSink
from paraxis.train.summary import ConsoleSink

__all__ = ["METRICS_FILE", "JsonlSink", "Sinks", "check_sinks", "open_sinks",
           "run_directory"]

METRICS_FILE = "metrics.jsonl"


def run_directory(cfg: RunConfig) -> Path:
    """Where a run's files go: ``logging.dir``, else ``train.checkpoint_dir``, else
    ``runs/<logging.run_name or "paraxis">`` (as torchtitan's dump folder, a run always
    has one)."""
    return Path(cfg.logging.dir or cfg.train.checkpoint_dir or
                Path("runs") / (cfg.logging.run_name or "paraxis"))


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


class JsonlSink(MetricSink):
    """``metrics.jsonl``: one object per logged step, flushed as it is written."""

    name = METRICS_FILE

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self._file: Any = None

    def start(self, config: Any, grid: dict[str, Any], first_step: int) -> None:
        kept = [line for line in self._lines() if _step_of(line) <= first_step] \
            if first_step else []
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text("".join(kept))
        os.replace(tmp, self.path)  # the kept history, whole, or the previous file
        self._file = self.path.open("a", encoding="utf-8")

    def _lines(self) -> list[str]:
        try:
            return self.path.read_text(encoding="utf-8").splitlines(keepends=True)
        except FileNotFoundError:
            return []

    def metrics(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step, **{k: _jsonable(v) for k, v in metrics.items() if k != "step"}}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def end(self, summary: dict[str, float] | None,
            rows: Sequence[tuple[str, str]] = ()) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _step_of(line: str) -> float:
    try:
        return float(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return math.inf  # a torn last line (a killed run) is dropped


class Sinks:
    """Every sink of the run, called alike; a sink that raises is switched off with one
    warning naming it, and the others go on (a sink never stops training)."""

    def __init__(self, sinks: Iterable[MetricSink]):
        self.sinks = list(sinks)
        self._ended = False

    def _each(self, method: str, *args: Any) -> None:
        for sink in list(self.sinks):
            try:
                getattr(sink, method)(*args)
            except Exception as exc:  # any failure of a logger: report, go on without it
                self.sinks.remove(sink)
                warnings.warn(f"metric sink {sink.name!r} failed in {method}() "
                              f"({type(exc).__name__}: {exc}); it is off for the rest of "
                              "this run, training continues", RuntimeWarning, stacklevel=2)

    def start(self, config: Any, grid: dict[str, Any], first_step: int) -> None:
        self._each("start", config, grid, first_step)

    def step(self, metrics: dict[str, float]) -> None:
        self._each("step", metrics)

    def metrics(self, step: int, metrics: dict[str, float]) -> None:
        self._each("metrics", step, metrics)

    def figure(self, name: str, svg: str, step: int) -> None:
        self._each("figure", name, svg, step)

    def end(self, summary: dict[str, float] | None,
            rows: Sequence[tuple[str, str]] = ()) -> None:
        if not self._ended:  # once: the run's end, or its failure
            self._ended = True
            self._each("end", summary, rows)


def open_sinks(cfg: RunConfig, pm: Any) -> Sinks:
    """Core's sinks, then the plugins' (``paraxis_metric_sinks``), for the logging rank."""
    directory = run_directory(cfg)
    sinks: list[MetricSink] = [ConsoleSink(cfg.train.steps, progress=cfg.logging.progress),
                               JsonlSink(directory / METRICS_FILE)]
    for answer in pm.hook.paraxis_metric_sinks(config=cfg, directory=str(directory)):
        if answer:
            sinks += answer if isinstance(answer, list | tuple) else [answer]
    return Sinks(sinks)


# A logging field that names an integration, and the plugin (entry point) that serves it.
SINK_PLUGINS = {"tensorboard": ("tensorboard", "paraxis-tensorboard")}


def check_sinks(cfg: RunConfig, pm: Any) -> None:
    """Refuse, on every rank and before any process group, a logging field whose
    integration is not installed (a silent run without the asked-for files would be
    found out only at its end)."""
    problems = []
    for field, (plugin, dist) in SINK_PLUGINS.items():
        value = getattr(cfg.logging, field)
        if value and pm.get_plugin(plugin) is None:
            problems.append(Problem(f"logging.{field}", value, f"needs {dist}, which is "
                                    "not installed", f"pip install {dist}"))
    if problems:
        raise ConfigError(problems)
