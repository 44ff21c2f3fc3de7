"""What a run reports about itself: the ``logging`` section (where its metrics go) and
``train.profile`` (a profiler window), apart from :mod:`paraxis.config.run` so that each
reads in a sitting; :mod:`paraxis.config.run` re-exports both."""

from __future__ import annotations

from pydantic import PositiveInt

from paraxis.config.parallel import _Section

__all__ = ["LoggingSection", "ProfileWindow"]


class LoggingSection(_Section):
    """Where a run's metrics go (the sinks, :mod:`paraxis.train.sinks`): the console,
    ``metrics.jsonl`` in the run's directory (always), W&B, TensorBoard."""

    wandb: bool = True  # used when paraxis-wandb is installed
    project: str = "paraxis"
    run_name: str | None = None
    # The rich progress bar when stdout is a terminal; otherwise (nohup, SLURM, a pipe),
    # or with false, a plain line every train.log_every steps, flushed.
    progress: bool = True
    # The run's directory: metrics.jsonl (one JSON object per logged step), the axes'
    # figures and the profiler's files. Default: train.checkpoint_dir, else
    # runs/<run_name or "paraxis">.
    dir: str | None = None
    # TensorBoard event files in this directory (paraxis-tensorboard): scalars, the MoE
    # load heatmap and the pipeline timeline as images.
    tensorboard: str | None = None


class ProfileWindow(_Section):
    """``train.profile``: torch.profiler over ``steps`` steps from step ``start`` (the
    steps as the console counts them, from 1) on every rank: a Chrome trace per rank
    (Perfetto, chrome://tracing) with CPU (and CUDA, where present) activity and
    paraxis's spans as ranges; with ``memory``, a CUDA memory snapshot (GPU) or the
    top allocations by tracemalloc (CPU) over the window. Files go to ``dir`` (default
    ``<run directory>/profile``), named by rank and steps."""

    start: PositiveInt
    steps: PositiveInt = 1
    memory: bool = False
    dir: str | None = None
