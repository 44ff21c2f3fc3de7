"""paraxis pipeline parallelism: schedules as data, a checker, a simulator, an executor."""

from paraxis_pp.check import ScheduleError, check
from paraxis_pp.schedules import Action, Schedule, build
from paraxis_pp.simulate import Timeline, replay, simulate, theoretical_bubble
from paraxis_pp.strategy import PipelineStrategy

__all__ = ["Action", "PipelineStrategy", "Schedule", "ScheduleError", "Timeline", "build",
           "check", "replay", "simulate", "theoretical_bubble"]
