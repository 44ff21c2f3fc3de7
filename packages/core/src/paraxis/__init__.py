"""paraxis: train transformer language models over a grid of devices, one axis at a time.

Core's layers, each importing only those below it (``nox -s lint`` checks it):

    cli                     the ``paraxis`` command
    train | planner         the training loop and its data; the planner
    engine                  parallelize(), the Engine, the parity probe, plugins
    checkpoint              checkpoints of any TrainState, on any grid
    models                  core's own ``tiny`` model family
    parallel                the contract an axis implements (strategy, placement, hooks)
    runtime                 processes, the grid, collectives
    config                  what a run asks for, and its rules

Axis packages import only ``parallel``, ``runtime`` and ``config``.
"""

from paraxis.config.errors import ConfigError, MissingAxisPackageError, Problem
from paraxis.config.parallel import AXES, ParallelConfig
from paraxis.config.rules import validate
from paraxis.config.run import RunConfig
from paraxis.config.shape import ModelShape
from paraxis.engine.apply import apply_parallelism, parallelize
from paraxis.engine.engine import Engine
from paraxis.engine.plugins import make_plugin_manager
from paraxis.parallel import hookspecs
from paraxis.parallel.model_plan import ModelPlan, PlanError
from paraxis.parallel.placement import Placement, Shard, placement_of
from paraxis.parallel.strategy import ApplyContext, Phase, Strategy
from paraxis.runtime.grid import AxisGroup, Grid, GridLayout, shutdown
from paraxis.version import __version__

__all__ = [
    "AXES",
    "ApplyContext",
    "AxisGroup",
    "ConfigError",
    "Engine",
    "Grid",
    "GridLayout",
    "MissingAxisPackageError",
    "ModelPlan",
    "ModelShape",
    "ParallelConfig",
    "Phase",
    "Placement",
    "PlanError",
    "Problem",
    "RunConfig",
    "Shard",
    "Strategy",
    "__version__",
    "apply_parallelism",
    "hookspecs",
    "make_plugin_manager",
    "parallelize",
    "placement_of",
    "shutdown",
    "validate",
]
