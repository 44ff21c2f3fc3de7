"""The training loop behind ``paraxis train``: build, parallelize, feed, log, checkpoint.

:func:`train` reads as its steps: :func:`start` (model, engine, data stream, resume, the
sinks), :func:`run_steps` (the loop with its logging, profiler window and periodic
checkpoints), :func:`finish` (last checkpoint, the axes' reports, the summary). Metrics
leave through the sinks only (:mod:`paraxis.train.sinks`: console, metrics.jsonl, and
the plugins' W&B, TensorBoard), on the logging rank.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from paraxis.checkpoint.files import read_index
from paraxis.checkpoint.format import resolve
from paraxis.config.errors import ConfigError
from paraxis.config.run import RunConfig
from paraxis.engine.apply import parallelize
from paraxis.engine.engine import Engine
from paraxis.engine.plugins import make_plugin_manager
from paraxis.parallel.summary import RunReport
from paraxis.runtime.world import init_distributed
from paraxis.train.build import build_model, lora_problems, model_spec
from paraxis.train.data import BatchStream, check_data, document_positions, load_tokenizer
from paraxis.train.failures import RankRecord
from paraxis.train.lifecycle import StopRequest
from paraxis.train.notices import (
    WarningLines,
    default_store,
    layout_words,
    resume_line,
    stop_line,
)
from paraxis.train.profile import StepProfiler
from paraxis.train.sinks import Sinks, check_sinks, open_sinks, run_directory
from paraxis.train.sources import open_stream
from paraxis.train.summary import summarize, trainable_counts

__all__ = ["Run", "evaluate", "finish", "run_steps", "start", "train"]


@dataclass
class Run:
    """One ``paraxis train`` run on this rank, from :func:`start` to :func:`finish`."""

    cfg: RunConfig
    pm: Any  # the plugin manager
    engine: Engine
    stream: Any  # a BatchStream, or another with its methods (paraxis.train.sources)
    signals: StopRequest
    history: list[dict[str, float]]
    first_step: int  # the engine's step when this run started (after a resume)
    done_before: int  # entries of ``history`` from before this run
    started: float  # perf_counter at the first step
    held_out: Any = None  # the held-out rows (data.eval), or None
    separator: int | None = None  # with data.document_masking: the tokenizer's separator
    sinks: Sinks | None = None  # on the logging rank
    profiler: StepProfiler | None = None  # train.profile's window

    def feed(self, rows: Any) -> Any:
        """What the engine gets for packed ``rows``: the rows, or with document masking
        the rows and their per-document position ids."""
        if self.separator is None or isinstance(rows, dict):  # unpacked rows: a mask
            return rows
        return {"input_ids": rows, "position_ids": document_positions(rows, self.separator)}

    @property
    def evaluating(self) -> bool:
        return self.held_out is not None and self.cfg.train.eval_every > 0

    @property
    def logging(self) -> bool:
        grid = self.engine.grid
        return grid.rank == grid.logging_rank


def train(cfg: RunConfig, history: list[dict[str, float]] | None = None) -> dict[str, float]:
    """Run ``cfg`` on the current world (under torchrun, or a world of one); return the
    summary. Each step's metrics are appended to ``history`` when one is given. In a
    torchrun worker, warnings are shown as single lines, once per run
    (:class:`paraxis.train.notices.WarningLines`)."""
    lines = WarningLines().install() if "TORCHELASTIC_RUN_ID" in os.environ else None
    run = None
    try:
        run = start(cfg, [] if history is None else history, lines)
        run_steps(run)
        return finish(run)
    finally:
        if run is not None:  # a failed run still closes its sinks and profiler window
            _close(run)
        if lines is not None:
            lines.uninstall()


def start(cfg: RunConfig, history: list[dict[str, float]],
          lines: WarningLines | None = None) -> Run:
    """Build the model (in a plugin's construction context, if one answers), parallelize
    it, open the data stream at this rank's share, resume from the latest checkpoint and
    open the sinks (logging rank)."""
    pm = make_plugin_manager()
    check_sinks(cfg, pm)
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    problems = [*check_data(cfg, tokenizer), *lora_problems(cfg, pm)]
    if problems:  # before any process group, with everything found
        raise ConfigError(problems)
    init_distributed()  # a construction context may partition over the ranks
    if lines is not None:
        lines.attach(default_store())
    context = pm.hook.paraxis_model_context(config=cfg)
    with context if context is not None else contextlib.nullcontext():
        model = build_model(model_spec(cfg, tokenizer.vocab_size), pm, seed=cfg.train.seed,
                            deferred=context is None, lora=cfg.lora)
    trainable = trainable_counts(model)  # the summary's share (a LoRA run's adapters)
    # A model constructed partitioned cannot run whole on a rank: no parity probe.
    engine = parallelize(model, config=cfg, train=cfg.train, plugin_manager=pm,
                         verify=context is None)
    engine.ctx.extras["trainable"] = trainable
    signals = StopRequest().install()
    engine.stop_request = signals
    index, count = engine.grid.sample_shard()
    stream, held_out = open_stream(cfg, tokenizer, rank=index, ranks=count)
    if held_out is not None and len(held_out) < cfg.train.global_batch:
        raise ValueError(f"data.eval holds {len(held_out)} sequences, fewer than one global "
                         f"batch of {cfg.train.global_batch}")
    ckpt, resumed = cfg.train.checkpoint_dir, None
    if ckpt and cfg.train.resume and (Path(ckpt) / "latest").exists():
        resumed = resolve(ckpt)
        engine.load(str(resumed))
        stream.load_state_dict(engine.data_state)
    run = Run(cfg, pm, engine, stream, signals, history, engine.step, len(history),
              time.perf_counter(), held_out,
              tokenizer.separator if cfg.data.document_masking else None)
    run.profiler = StepProfiler(cfg.train.profile, rank=engine.grid.rank, device=engine.device,
                                tracer=engine.tracer, directory=run_directory(cfg) / "profile")
    if run.logging:
        if resumed is not None:
            layout = layout_words(cfg.degrees, cfg.parallelism.zero)
            print(resume_line(resumed, read_index(resumed), layout, stream, engine.scheduler),
                  flush=True)
        run.sinks = open_sinks(cfg, pm)  # last: nothing after it can fail and leave them open
        run.sinks.start(cfg, engine.grid.describe(), engine.step)
    return run


def run_steps(run: Run) -> None:
    """Train until ``train.steps`` (or ``exit_after_steps`` more, or a stop signal),
    logging every ``log_every`` steps and checkpointing every ``checkpoint_every``."""
    cfg, engine = run.cfg, run.engine
    stop = cfg.train.steps
    if cfg.train.exit_after_steps:
        stop = min(stop, run.first_step + cfg.train.exit_after_steps)
    record = RankRecord()  # the launcher names a rank killed outright from it
    record.alive(engine.step)
    profiler = run.profiler
    while engine.step < stop:
        if profiler is not None:
            profiler.before_step(engine.step + 1)
        batch = run.stream.next_batch()
        engine.data_state = run.stream.state_dict()
        metrics = engine.train_step(run.feed(batch))
        record.alive(engine.step)
        run.history.append(metrics)
        last = engine.step == stop
        evaluated = run.evaluating and (engine.step % cfg.train.eval_every == 0 or last)
        if evaluated:
            metrics.update(evaluate(run))
        if run.sinks is not None:
            run.sinks.step(metrics)
            if engine.step % cfg.train.log_every == 0 or last or evaluated:
                run.sinks.metrics(engine.step, metrics)
        if profiler is not None:
            profiler.after_step(engine.step)
        if engine.stop_agreed:  # a signal reached some rank: every rank stops here
            break
        every = cfg.train.checkpoint_every
        if every and engine.step % every == 0 and not last:
            _save(run)


def evaluate(run: Run) -> dict[str, float]:
    """``eval_loss``: the mean of the losses of the first ``train.eval_batches`` global
    batches of the held-out rows, in order (the same batches at every evaluation and on
    every layout), each batch's loss its mean over its targets; ``eval_ppl`` its
    exponential. Every rank calls it (the loss is reduced over the grid)."""
    index, count = run.engine.grid.sample_shard()
    stream = BatchStream(run.held_out, global_batch=run.cfg.train.global_batch, rank=index,
                         ranks=count, shuffle=False)
    n = min(run.cfg.train.eval_batches, stream.batches_per_epoch)
    loss = sum(run.engine.eval_step(run.feed(stream.next_batch())) for _ in range(n)) / n
    return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 80.0))}


def finish(run: Run) -> dict[str, float]:
    """The last checkpoint, the axes' reports and traces, the summary; closes the engine."""
    cfg, engine = run.cfg, run.engine
    _save(run)
    engine.wait_for_checkpoint()  # an async save is on disk before the run reports it
    run.signals.uninstall()
    if run.profiler is not None:
        run.profiler.close(engine.step)
    if run.logging:
        _say_how_it_stopped(run)
    mine = run.history[run.done_before:]
    # Collective in some plugins (the pipeline's timeline): every rank asks.
    reports: list[RunReport] = run.pm.hook.paraxis_summarize_run(ctx=engine.ctx, history=mine)
    if cfg.train.trace_dir:
        engine.tracer.export(Path(cfg.train.trace_dir) / f"rank{engine.grid.rank:05d}.trace.json")
    summary = summarize(mine, time.perf_counter() - run.started, engine.step - run.first_step)
    summary.update(engine.ctx.extras.get("trainable", {}))
    for report in reports:
        summary.update(report.values)
    if run.sinks is not None:
        _show_reports(run, run.sinks, reports)
        run.sinks.end(summary, [row for report in reports for row in report.rows])
    engine.close()
    return summary


def _say_how_it_stopped(run: Run) -> None:
    """The lines of a run that stopped before ``train.steps`` (a signal, or
    ``train.exit_after_steps``: how to resume) and where the profiler wrote."""
    cfg, step = run.cfg, run.engine.step
    if run.engine.stop_agreed:
        print(stop_line(step, "by a signal", cfg.train.checkpoint_dir), flush=True)
    elif cfg.train.exit_after_steps and step < cfg.train.steps:
        print(stop_line(step, f"by train.exit_after_steps = {cfg.train.exit_after_steps}",
                        cfg.train.checkpoint_dir), flush=True)
    if run.profiler is not None and run.profiler.written:
        names = ", ".join(p.name.replace(f"rank{run.engine.grid.rank:05d}", "rank*")
                          for p in run.profiler.written)
        print(f"profile written in {run.profiler.directory}: {names} (one per rank; "
              "the traces open in ui.perfetto.dev)", flush=True)


def _show_reports(run: Run, sinks: Sinks, reports: list[RunReport]) -> None:
    """Print the axes' lines; write their figures beside the traces (or in the run's
    directory) and hand them to the sinks."""
    where = Path(run.cfg.train.trace_dir or run_directory(run.cfg))
    for report in reports:
        for line in report.text:
            print(line, flush=True)
        for name, svg in report.figures:
            where.mkdir(parents=True, exist_ok=True)
            (where / f"{name.replace('_', '-')}.svg").write_text(svg)
            sinks.figure(name, svg, run.engine.step)


def _close(run: Run) -> None:
    """After the run, or its failure: the profiler window and the sinks are closed
    (the sinks' ``end`` with no summary when the run did not reach :func:`finish`)."""
    if run.profiler is not None:
        with contextlib.suppress(Exception):
            run.profiler.close(run.engine.step)
    if run.sinks is not None:
        run.sinks.end(None)


def _save(run: Run) -> None:
    if run.cfg.train.checkpoint_dir:
        gather = getattr(run.stream, "gathered_state", None)
        if gather is not None:  # a stream whose ranks each know their own part
            run.engine.data_state = gather()
        run.engine.save(run.cfg.train.checkpoint_dir)
