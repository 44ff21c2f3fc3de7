"""The W&B sink: opens a run on the logging rank, never lets W&B stop training."""

from __future__ import annotations

import logging
import os
import secrets
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from paraxis.parallel.metric_names import moe_arrays, moe_total
from paraxis.parallel.sink import MetricSink
from paraxis_wandb.moe import heatmap_svg, table_rows

__all__ = ["WandbLogger"]

log = logging.getLogger(__name__)


RUN_ID_FILE = "wandb-run-id"


def _resumable(config: Any) -> dict[str, Any]:
    """With a checkpoint directory, the W&B run's id lives beside the checkpoints
    (``wandb-run-id``), so a run that resumes from them continues the same W&B run
    (``resume="allow"``: the same id, the steps after the checkpoint's); a run that
    starts afresh (``train.resume: false``) writes a new id."""
    train = getattr(config, "train", None)
    where = getattr(train, "checkpoint_dir", None)
    if not where:
        return {}
    path = Path(where) / RUN_ID_FILE
    try:
        run_id = path.read_text().strip() if train.resume and path.exists() else ""
        if not run_id:
            run_id = secrets.token_hex(6)  # W&B ids: letters and digits
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(run_id + "\n")
    except OSError as exc:  # never let logging stop training
        log.warning("W&B run id not kept in %s (%s): a resume starts a new run", where, exc)
        return {}
    return {"id": run_id, "resume": "allow"}


class WandbLogger(MetricSink):
    """One W&B run per training run, a metric sink (:class:`paraxis.parallel.sink.MetricSink`).
    Every call swallows W&B's failures: a run that cannot log keeps training and says so
    once."""

    name = "wandb"

    def __init__(self, init_timeout_s: float = 30.0, *, background: bool = False):
        self._run: Any = None
        self.init_timeout_s = init_timeout_s
        self.background = background  # open the run in a thread (the trainer's sink)
        self._opening: threading.Thread | None = None

    @property
    def run(self) -> Any:
        """The W&B run, once :meth:`start`'s opening finished (None when W&B is off)."""
        if self._opening is not None:
            self._opening.join()
            self._opening = None
        return self._run

    @run.setter
    def run(self, value: Any) -> None:
        self._run = value

    def start(self, config: Any, grid: dict[str, Any], first_step: int = 0) -> None:
        section = getattr(config, "logging", None)
        if section is not None and not section.wandb:
            return
        try:
            import wandb
        except ImportError:
            return
        payload = {"run": config.model_dump(mode="json"), "grid": grid}
        kwargs = {"project": getattr(section, "project", "paraxis"),
                  "name": getattr(section, "run_name", None), "config": payload,
                  "dir": os.environ.get("WANDB_DIR"), **_resumable(config)}
        if not self.background:
            self._open(wandb, kwargs)
            return
        # Opened beside the rank's first steps: wandb.init waits on W&B's service for
        # most of its 0.6-0.9 s, which every rank otherwise waited out before its first
        # step (issue 38, start-up). Reading ``run`` (the first log) joins it.
        self._opening = threading.Thread(target=self._open, args=(wandb, kwargs),
                                         name="paraxis-wandb-init", daemon=True)
        self._opening.start()

    def _open(self, wandb: Any, kwargs: dict[str, Any]) -> None:
        for mode in (None, "offline"):  # as configured (WANDB_MODE), then offline
            try:
                settings = wandb.Settings(init_timeout=self.init_timeout_s, silent=True)
                self._run = wandb.init(mode=mode, settings=settings, **kwargs)
                return
            except Exception as exc:  # W&B raises many types when unreachable
                log.warning("W&B init failed (%s mode): %s", mode or "configured", exc)
        log.warning("W&B logging disabled for this run; training continues")

    def metrics(self, step: int, metrics: dict[str, float]) -> None:
        """Scalars as they are; the per-layer, per-expert MoE arrays (paraxis-moe-ep's
        ``moe/<block>/<kind>/<expert>``) as the table ``moe/experts`` and the heatmap
        picture ``moe/load_heatmap`` (:mod:`paraxis_wandb.moe`)."""
        if self.run is None:
            return
        scalars, arrays = moe_arrays(metrics)
        try:
            payload: dict[str, Any] = dict(scalars)
            if arrays:
                payload.update(self._moe_panels(arrays, step))
            self.run.log(payload, step=step)
        except Exception as exc:
            log.warning("W&B log failed, logging disabled for this run: %s", exc)
            self.run = None

    @staticmethod
    def _moe_panels(arrays: dict[str, Any], step: int) -> dict[str, Any]:
        import wandb

        columns, rows = table_rows(arrays)
        return {moe_total("experts"): wandb.Table(columns=columns, data=rows),
                moe_total("load_heatmap"): wandb.Html(heatmap_svg(
                    arrays, title=f"step {step}: tokens assigned"))}

    def figure(self, name: str, svg: str, step: int) -> None:
        if self.run is None:
            return
        try:
            import wandb

            self.run.log({name: wandb.Html(svg)}, step=step)
        except Exception as exc:
            log.warning("W&B figure %s not logged: %s", name, exc)

    def end(self, summary: dict[str, float] | None,
            rows: Sequence[tuple[str, str]] = ()) -> None:
        """The summary into the run's summary, then finish; a failed run (no summary)
        finishes with exit code 1, so W&B shows it failed."""
        if self.run is None:
            return
        try:
            if summary is None:
                self.run.finish(exit_code=1)
            else:
                self.run.summary.update(dict(summary))
                self.run.finish()
        except Exception as exc:
            log.warning("W&B finish failed: %s", exc)
        self.run = None
