"""paraxis: train transformer language models over a grid of devices, one axis at a time."""

from paraxis import hookspecs
from paraxis.config import AXES, ParallelConfig
from paraxis.errors import ConfigError, MissingAxisPackageError, Problem
from paraxis.grid import AxisGroup, Grid, GridLayout, shutdown
from paraxis.placement import Placement, Shard, placement_of
from paraxis.plugins import make_plugin_manager
from paraxis.strategy import ApplyContext, Phase, Strategy, apply_parallelism
from paraxis.validation import ModelShape, validate

__version__ = "0.1.0"

__all__ = [
    "AXES",
    "ApplyContext",
    "AxisGroup",
    "ConfigError",
    "Grid",
    "GridLayout",
    "MissingAxisPackageError",
    "ModelShape",
    "ParallelConfig",
    "Phase",
    "Placement",
    "Problem",
    "Shard",
    "Strategy",
    "apply_parallelism",
    "hookspecs",
    "make_plugin_manager",
    "placement_of",
    "shutdown",
    "validate",
]
