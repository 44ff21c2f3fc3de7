"""``train.profile`` without processes: the window's steps, a run resumed inside it, the
files it writes, and a window past the last step refused with the fix (issue 38)."""

import json

import torch

from paraxis.config.run import ProfileWindow, RunConfig
from paraxis.engine.metrics import Tracer
from paraxis.train.profile import StepProfiler


def steps(profiler, tracer, first, last):
    for step in range(first, last + 1):
        profiler.before_step(step)
        with tracer.span("forward"):
            torch.ones(8).sum()
        profiler.after_step(step)


def test_a_window_opened_by_a_resume_profiles_what_is_left_of_it(tmp_path):
    tracer = Tracer()
    window = ProfileWindow(start=2, steps=3, memory=True)
    profiler = StepProfiler(window, rank=3, device=torch.device("cpu"), tracer=tracer,
                            directory=tmp_path)
    steps(profiler, tracer, 3, 8)  # resumed at step 2: steps 3 and 4 are left
    assert [p.name for p in profiler.written] == ["rank00003.steps3-4.trace.json",
                                                  "rank00003.steps3-4.tracemalloc.txt"]
    events = json.loads(profiler.written[0].read_text())["traceEvents"]
    names = [e.get("name") for e in events]
    assert names.count("paraxis/forward") == 2  # steps 3 and 4 only
    assert {"ProfilerStep#3", "ProfilerStep#4"} <= set(names)
    assert not tracer.ranges  # the spans are plain again after the window


def test_a_window_past_the_last_step_is_refused_with_where_to_start_it():
    cfg = RunConfig.from_dict({"train": {"steps": 6, "profile": {"start": 5, "steps": 3}}})
    (problem,) = [p for p in cfg.check_run() if p.field == "train.profile"]
    assert "ends after the last step (train.steps = 6)" in str(problem)
    assert "start it at step 4 or earlier" in str(problem)
