"""What ``paraxis train`` shows on the console (:class:`ConsoleSink`): the progress bar
on a terminal, a plain line every ``log_every`` steps anywhere else, and the summary
table at the end (with what the axes report through ``paraxis_summarize_run``)."""

from __future__ import annotations

import statistics
import sys
from collections.abc import Sequence
from typing import Any

from paraxis.parallel.metric_names import CONSOLE_MOE
from paraxis.parallel.sink import MetricSink

__all__ = ["ConsoleSink", "console_line", "summarize", "summary_table", "trainable_counts"]


def console_line(m: dict[str, float], steps: int) -> str:
    """One logged step in a line: step, loss, eval, lr, tokens/s, step time, exposed
    communication, and an MoE run's aux loss, load imbalance and dropped share."""
    held_out = (f"  eval loss {m['eval_loss']:.4f} ppl {m['eval_ppl']:.2f}"
                if "eval_loss" in m else "")
    moe = "".join(f"  {label} {fmt.format(m[key])}" for key, label, fmt in CONSOLE_MOE
                  if key in m)
    return (f"step {int(m['step']):>5}/{steps}  loss {m['loss']:.4f}  "
            f"tok/s {m['tokens_per_s']:,.0f}  step {m['step_time_s'] * 1e3:.0f} ms  "
            f"comm {m['exposed_comm_s'] * 1e3:.1f} ms  lr {m['lr']:.2e}{held_out}{moe}")


class ConsoleSink(MetricSink):
    """The console: a rich progress bar when stdout is a terminal and
    ``logging.progress`` is on; otherwise (nohup, SLURM, ``| tee``: issue 38) a plain
    line per logged step, flushed at once, so a file shows the run while it goes."""

    name = "console"

    def __init__(self, steps: int, *, progress: bool = True, stream: Any = None):
        self.steps = steps
        stream = sys.stdout if stream is None else stream
        self.bar_wanted = progress and bool(getattr(stream, "isatty", lambda: False)())
        self._bar: Any = None
        self._task: Any = None

    def start(self, config: Any, grid: dict[str, Any], first_step: int) -> None:
        if not self.bar_wanted:
            return
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        columns = [TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("loss {task.fields[loss]}  eval {task.fields[eval]}  "
                              "tok/s {task.fields[tps]}"),
                   TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn()]
        self._bar = Progress(*columns, transient=False)
        self._task = self._bar.add_task("train", total=self.steps, completed=first_step,
                                        loss="-", eval="-", tps="-")
        self._bar.start()

    def step(self, m: dict[str, float]) -> None:
        if self._bar is None:
            return
        held_out = {"eval": f"{m['eval_loss']:.4f}"} if "eval_loss" in m else {}
        self._bar.update(self._task, completed=int(m["step"]), loss=f"{m['loss']:.4f}",
                         tps=f"{m['tokens_per_s']:,.0f}", **held_out)

    def metrics(self, step: int, m: dict[str, float]) -> None:
        if self._bar is None:
            print(console_line(m, self.steps), flush=True)

    def end(self, summary: dict[str, float] | None,
            rows: Sequence[tuple[str, str]] = ()) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
        if summary is not None:
            summary_table(summary, rows)


def _fmt(key: str, value: float) -> str:
    if key.endswith("_bytes"):
        return f"{value / 2**20:,.1f} MiB"
    if key.endswith("_s") and key != "tokens_per_s":
        return f"{value * 1e3:,.2f} ms" if value < 10 else f"{value:,.1f} s"
    if key == "mfu":
        return f"{value:.2%}"
    if key in ("steps", "tokens_per_s", "trainable_params"):
        return f"{value:,.0f}"
    if key == "trainable_share":
        return f"{value:.2%}"
    return f"{value:.4f}"


def summary_table(summary: dict[str, float], rows: Sequence[tuple[str, str]] = ()) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="paraxis run summary")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in summary.items():
        table.add_row(key, _fmt(key, value))
    for key, text in rows:
        table.add_row(key, text)
    Console().print(table)


def trainable_counts(model: Any) -> dict[str, float]:
    """Parameters the optimizer steps and their share of all (a LoRA run's adapters: the
    rest frozen, issue 34), counted on the model as built, before any axis splits it; a
    tied parameter once."""
    params = {id(p): p for p in model.parameters()}.values()
    total = sum(p.numel() for p in params)
    trainable = sum(p.numel() for p in params if p.requires_grad)
    return {"trainable_params": float(trainable),
            "trainable_share": trainable / total if total else 0.0}


def summarize(history: list[dict[str, float]], wall: float, steps: int) -> dict[str, float]:
    if not history:
        return {"steps": 0.0, "wall_time_s": wall}
    steady = history[1:] or history  # the first step pays for warm-up
    out = {
        "steps": float(steps),
        "final_loss": history[-1]["loss"],
        "first_loss": history[0]["loss"],
        "tokens_per_s": statistics.median(m["tokens_per_s"] for m in steady),
        "step_time_s": statistics.median(m["step_time_s"] for m in steady),
        "exposed_comm_s": statistics.median(m["exposed_comm_s"] for m in steady),
        "straggler_spread_s": max(m["straggler_spread_s"] for m in steady),
        "wall_time_s": wall,
    }
    # Exposed communication per group (comm/<group>_exposed_s), median over steps.
    for key in sorted(k for k in history[-1] if k.startswith("comm/")
                      and k.endswith("_exposed_s")):
        out[key] = statistics.median(m.get(key, 0.0) for m in steady)
    for key in ("mfu", "peak_rss_bytes", "model_state_bytes", "peak_alloc_bytes"):
        if key in history[-1]:
            out[key] = history[-1][key]
    evaluated = [m for m in history if "eval_loss" in m]
    if evaluated:  # the last evaluation (after the last step, when there was one)
        out["eval_loss"], out["eval_ppl"] = evaluated[-1]["eval_loss"], evaluated[-1]["eval_ppl"]
    return out
