"""paraxis: train transformer language models over a grid of devices, one axis at a time."""

from paraxis import hookspecs
from paraxis.api import parallelize
from paraxis.config import AXES, ParallelConfig
from paraxis.engine import Engine
from paraxis.errors import ConfigError, MissingAxisPackageError, Problem
from paraxis.grid import AxisGroup, Grid, GridLayout, shutdown
from paraxis.placement import Placement, Shard, placement_of
from paraxis.plan import ModelPlan, PlanError
from paraxis.plugins import make_plugin_manager
from paraxis.run_config import RunConfig
from paraxis.strategy import ApplyContext, Phase, Strategy, apply_parallelism
from paraxis.validation import ModelShape, validate

__version__ = "0.1.0"

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
    "apply_parallelism",
    "hookspecs",
    "make_plugin_manager",
    "parallelize",
    "placement_of",
    "shutdown",
    "validate",
]
