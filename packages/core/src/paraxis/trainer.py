"""The training loop behind ``paraxis train``: build, parallelize, feed, log, checkpoint."""

from __future__ import annotations

import contextlib
import os
import re
import statistics
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from paraxis.api import parallelize
from paraxis.data import BatchStream, load_tokenizer, pack
from paraxis.engine import Engine
from paraxis.launch import init_distributed
from paraxis.lifecycle import StopRequest
from paraxis.plugins import make_plugin_manager
from paraxis.run_config import ModelSection, RunConfig
from paraxis.tiny import TinyConfig, TinyTransformer

__all__ = ["build_model", "train"]


def build_model(spec: ModelSection, plugin_manager: Any, *, seed: int = 0) -> nn.Module:
    """``tiny`` is built here; any other family, or ``pretrained`` weights, by the first
    plugin that knows it."""
    torch.manual_seed(seed)  # every rank starts from the same weights
    if spec.pretrained:
        model = plugin_manager.hook.paraxis_load_pretrained(directory=spec.pretrained,
                                                            config=spec.config)
        if model is None:
            raise ValueError(f"model.pretrained {spec.pretrained!r}: no installed plugin "
                             "loads it; for save_pretrained directories: pip install "
                             "paraxis-hf")
        return model
    if spec.family == "tiny":
        return TinyTransformer(TinyConfig(**spec.config))
    model = plugin_manager.hook.paraxis_build_model(family=spec.family, config=spec.config)
    if model is None:
        raise ValueError(f"model.family {spec.family!r}: no installed plugin builds it; "
                         "for Hugging Face model types: pip install paraxis-hf")
    return model


def _console_line(m: dict[str, float], steps: int) -> str:
    return (f"step {int(m['step']):>5}/{steps}  loss {m['loss']:.4f}  "
            f"tok/s {m['tokens_per_s']:,.0f}  step {m['step_time_s'] * 1e3:.0f} ms  "
            f"comm {m['exposed_comm_s'] * 1e3:.1f} ms  lr {m['lr']:.2e}")


@contextlib.contextmanager
def _progress(enabled: bool, total: int, done: int) -> Iterator[Any]:
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
               TextColumn("loss {task.fields[loss]}  tok/s {task.fields[tps]}"),
               TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn()]
    with Progress(*columns, transient=False) as bar:
        task = bar.add_task("train", total=total, completed=done, loss="-", tps="-")
        yield lambda m: bar.update(task, completed=int(m["step"]), loss=f"{m['loss']:.4f}",
                                   tps=f"{m['tokens_per_s']:,.0f}")


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


def _summary_table(summary: dict[str, float], rows: Sequence[tuple[str, str]] = ()) -> None:
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


_ASSIGNED = re.compile(r"^moe/(.+)/assigned/(\d+)$")


def _expert_load(history: list[dict[str, float]]) -> tuple[dict[str, float], list[tuple[str, str]]]:
    """The most and least loaded expert over the run, from the per-layer, per-expert
    ``moe/<block>/assigned/<expert>`` metrics (paraxis-moe-ep): summary values (load
    over the mean load) and the table's rows naming them."""
    totals: dict[tuple[str, int], float] = {}
    for m in history:
        for key, value in m.items():
            if hit := _ASSIGNED.match(key):
                where = (hit[1], int(hit[2]))
                totals[where] = totals.get(where, 0.0) + value
    mean = sum(totals.values()) / len(totals) if totals else 0.0
    if not mean:
        return {}, []
    out, rows = {}, []
    for label, pick in (("most", max), ("least", min)):
        (block, expert), n = pick(totals.items(), key=lambda kv: kv[1])
        out[f"moe/{label}_loaded_vs_mean"] = n / mean
        rows.append((f"{label} loaded expert",
                     f"{block} #{expert}: {n:,.0f} routed ({n / mean:.2f}x mean)"))
    return out, rows


def _save(engine: Engine, cfg: RunConfig) -> None:
    if cfg.train.checkpoint_dir:
        engine.save(cfg.train.checkpoint_dir)


def train(cfg: RunConfig, history: list[dict[str, float]] | None = None) -> dict[str, float]:
    """Run ``cfg`` on the current world (under torchrun, or a world of one); return the
    summary. Each step's metrics are appended to ``history`` when one is given."""
    pm = make_plugin_manager()
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    model_spec = cfg.model
    if (cfg.model.family == "tiny" and not cfg.model.pretrained
            and "vocab_size" not in cfg.model.config):
        model_spec = cfg.model.model_copy(update={"config": {
            **cfg.model.config, "vocab_size": tokenizer.vocab_size,
            "seq_length": cfg.train.seq_length}})
    init_distributed()  # a construction context may partition over the ranks
    context = pm.hook.paraxis_model_context(config=cfg)
    with context if context is not None else contextlib.nullcontext():
        model = build_model(model_spec, pm, seed=cfg.train.seed)
    # A model constructed partitioned cannot run whole on a rank: no parity probe.
    engine = parallelize(model, config=cfg, train=cfg.train, plugin_manager=pm,
                         verify=context is None)
    signals = StopRequest().install()
    engine.stop_request = signals
    grid = engine.grid
    rows = pack(cfg.data, cfg.train.seq_length, tokenizer)
    index, count = grid.sample_shard()
    stream = BatchStream(rows, global_batch=cfg.train.global_batch, rank=index, ranks=count,
                         shuffle=cfg.data.shuffle, seed=cfg.train.seed)
    ckpt = cfg.train.checkpoint_dir
    if ckpt and cfg.train.resume and (Path(ckpt) / "latest").exists():
        engine.load(ckpt)
        stream.load_state_dict(engine.data_state)
    logging = grid.rank == grid.logging_rank
    if logging:
        pm.hook.paraxis_log_start(config=cfg, grid=grid.describe())
    history = [] if history is None else history
    done_before = len(history)
    start = time.perf_counter()
    first = engine.step
    stop = cfg.train.steps
    if cfg.train.exit_after_steps:
        stop = min(stop, first + cfg.train.exit_after_steps)
    with _progress(logging and cfg.logging.progress, cfg.train.steps, first) as update:
        while engine.step < stop:
            batch = stream.next_batch()
            engine.data_state = stream.state_dict()
            metrics = engine.train_step(batch)
            history.append(metrics)
            last = engine.step == stop
            if logging and (engine.step % cfg.train.log_every == 0 or last):
                pm.hook.paraxis_log_metrics(step=engine.step, metrics=metrics)
                if update is None:
                    print(_console_line(metrics, cfg.train.steps), flush=True)
            if update is not None:
                update(metrics)
            if engine.stop_agreed:  # a signal reached some rank: every rank stops here
                break
            every = cfg.train.checkpoint_every
            if every and engine.step % every == 0 and not last:
                _save(engine, cfg)
    _save(engine, cfg)
    engine.wait_for_checkpoint()  # an async save is on disk before the run reports it
    signals.uninstall()
    if engine.stop_agreed and logging:
        command = os.environ.get("PARAXIS_COMMAND", "the same command")
        where = (f"checkpoint {cfg.train.checkpoint_dir}/step-{engine.step:08d} written; "
                 f"resume with: {command}" if cfg.train.checkpoint_dir else
                 "no checkpoint written (train.checkpoint_dir is not set)")
        print(f"stopped by a signal after step {engine.step}: {where}", flush=True)
    _log_pipeline_timeline(engine, cfg, pm, logging)
    if cfg.train.trace_dir:
        engine.tracer.export(Path(cfg.train.trace_dir) / f"rank{grid.rank:05d}.trace.json")
    summary = _summarize(history[done_before:], time.perf_counter() - start,
                         engine.step - first)
    load, rows = _expert_load(history[done_before:])
    summary.update(load)
    if logging:
        pm.hook.paraxis_log_end(summary=summary)
        _summary_table(summary, rows)
    engine.close()
    return summary


def _log_pipeline_timeline(engine: Engine, cfg: RunConfig, pm: Any, logging: bool) -> None:
    """The last step's measured pipeline timeline, as SVG: written beside the traces (or
    the checkpoints) and handed to the logging plugins. Collective over the pipeline."""
    runner = engine.ctx.forward_backward
    if not hasattr(runner, "measured_svg"):
        return
    svg, summary = runner.measured_svg()
    if not logging:
        return
    where = cfg.train.trace_dir or cfg.train.checkpoint_dir
    if where:
        Path(where).mkdir(parents=True, exist_ok=True)
        (Path(where) / "pipeline-timeline.svg").write_text(svg)
    print(summary, flush=True)
    pm.hook.paraxis_log_figure(name="pipeline_timeline", svg=svg, step=engine.step)


def _summarize(history: list[dict[str, float]], wall: float, steps: int) -> dict[str, float]:
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
    for key in ("mfu", "peak_rss_bytes", "model_state_bytes", "peak_alloc_bytes"):
        if key in history[-1]:
            out[key] = history[-1][key]
    return out
