"""Layer 1, configuration: what a run asks for, checked before any process exists.

``axes`` (the grid's axes as a table a package may extend: mesh place, role, package),
``parallel`` (degrees, schedule, checkpoint and MoE sections; the pipeline schedules'
names), ``run`` (the whole ``paraxis train``
file: model, train, data, logging), ``shape`` (a model's sizes, from any Hugging Face
spelling), ``rules`` (cross-field rules, every problem at once) and ``errors``. Imports
nothing else of paraxis.
"""

from paraxis.config.axes import BUILTIN_AXES, AxisSpec, AxisTable
from paraxis.config.errors import ConfigError, MissingAxisPackageError, Problem
from paraxis.config.parallel import (
    AXES,
    PIPELINE_SCHEDULES,
    SAMPLE_AXES,
    TOKEN_AXES,
    CheckpointConfig,
    MoEConfig,
    Offload,
    ParallelConfig,
    Parallelism,
    ScheduleConfig,
)
from paraxis.config.run import DataSection, LoggingSection, ModelSection, RunConfig, TrainSection
from paraxis.config.shape import SIZE_SPELLINGS, ModelShape, config_size, read_model_config
from paraxis.config.text import expand_env

__all__ = [
    "AXES",
    "BUILTIN_AXES",
    "PIPELINE_SCHEDULES",
    "SAMPLE_AXES",
    "SIZE_SPELLINGS",
    "TOKEN_AXES",
    "AxisSpec",
    "AxisTable",
    "CheckpointConfig",
    "ConfigError",
    "DataSection",
    "LoggingSection",
    "MissingAxisPackageError",
    "MoEConfig",
    "ModelSection",
    "ModelShape",
    "Offload",
    "ParallelConfig",
    "Parallelism",
    "Problem",
    "RunConfig",
    "ScheduleConfig",
    "TrainSection",
    "config_size",
    "expand_env",
    "read_model_config",
]
