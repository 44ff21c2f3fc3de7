"""What ``paraxis train`` shows: the console line, the progress bar, and the summary
table at the end (with what the axes report through ``paraxis_summarize_run``)."""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Iterator, Sequence
from typing import Any

__all__ = ["console_line", "progress", "summarize", "summary_table"]


def console_line(m: dict[str, float], steps: int) -> str:
    held_out = (f"  eval loss {m['eval_loss']:.4f} ppl {m['eval_ppl']:.2f}"
                if "eval_loss" in m else "")
    return (f"step {int(m['step']):>5}/{steps}  loss {m['loss']:.4f}  "
            f"tok/s {m['tokens_per_s']:,.0f}  step {m['step_time_s'] * 1e3:.0f} ms  "
            f"comm {m['exposed_comm_s'] * 1e3:.1f} ms  lr {m['lr']:.2e}{held_out}")


@contextlib.contextmanager
def progress(enabled: bool, total: int, done: int) -> Iterator[Any]:
    if not enabled:
        yield None
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
    with Progress(*columns, transient=False) as bar:
        task = bar.add_task("train", total=total, completed=done, loss="-", eval="-",
                            tps="-")

        def update(m: dict[str, float]) -> None:
            held_out = {"eval": f"{m['eval_loss']:.4f}"} if "eval_loss" in m else {}
            bar.update(task, completed=int(m["step"]), loss=f"{m['loss']:.4f}",
                       tps=f"{m['tokens_per_s']:,.0f}", **held_out)

        yield update


def _fmt(key: str, value: float) -> str:
    if key.endswith("_bytes"):
        return f"{value / 2**20:,.1f} MiB"
    if key.endswith("_s") and key != "tokens_per_s":
        return f"{value * 1e3:,.2f} ms" if value < 10 else f"{value:,.1f} s"
    if key == "mfu":
        return f"{value:.2%}"
    if key in ("steps", "tokens_per_s"):
        return f"{value:,.0f}"
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
    # Exposed communication per axis group (comm/<axes>_exposed_s), median over steps.
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
