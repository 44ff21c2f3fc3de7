"""What a run says and where its metrics go (issue 38), without processes: group names
from the axis table, the console line, metrics.jsonl across a resume, a failing sink,
warnings as single lines once per run, the resume and stop lines."""

import io
import json
import warnings

import pytest

from paraxis.config.axes import BUILTIN_AXES, AxisSpec
from paraxis.config.errors import ConfigError
from paraxis.config.run import RunConfig
from paraxis.engine.plugins import make_plugin_manager
from paraxis.parallel.metric_names import group_names
from paraxis.parallel.sink import MetricSink
from paraxis.train.notices import WarningLines, layout_words, resume_line, stop_line
from paraxis.train.sinks import JsonlSink, Sinks, check_sinks
from paraxis.train.summary import ConsoleSink, console_line

STEP = {"step": 4.0, "loss": 2.5, "tokens_per_s": 1234.0, "step_time_s": 0.05,
        "exposed_comm_s": 0.002, "lr": 1e-3}


def test_groups_are_named_as_a_user_thinks_of_them_and_groups_of_one_left_out():
    names = group_names(BUILTIN_AXES, {"data": 2, "tensor": 2})
    shown = {key: name for key, name in names.items() if name is not None}
    assert shown == {"data": "data", "tensor": "tensor", "dataxexpertxcontext": "replicas",
                     "dataxcontext": "expert_replicas",
                     "dataxexpertxcontextxtensor": "sequence_shards",
                     "pipelinexdataxexpertxcontextxtensor": "world"}
    assert names["pipeline"] is None and names["expert"] is None and names["self"] is None
    # An axis a package adds (docs/architecture.md, "Adding an axis") is named by the table.
    table = BUILTIN_AXES.extended([AxisSpec("replay", 250, "samples", "pkg")])
    names = group_names(table, {"replay": 2})
    assert names["replay"] == "replay" and names["dataxreplayxexpertxcontext"] == "replicas"


def test_the_console_line_carries_an_moe_runs_numbers():
    assert "aux" not in console_line(STEP, 10)
    line = console_line({**STEP, "moe/aux_loss": 0.0123, "moe/load_imbalance": 1.5,
                         "moe/dropped_fraction": 0.031, "eval_loss": 2.0, "eval_ppl": 7.39}, 10)
    assert line.startswith("step     4/10  loss 2.5000")
    for part in ("eval loss 2.0000", "aux 0.0123", "imbalance 1.50", "dropped 3.1%",
                 "comm 2.0 ms", "lr 1.00e-03"):
        assert part in line, (part, line)


def test_off_a_terminal_the_console_prints_each_logged_step_as_a_plain_line(capsys):
    class File(io.StringIO):
        def isatty(self):
            return False

    sink = ConsoleSink(10, progress=True, stream=File())
    sink.start(None, {}, 0)
    sink.step(STEP)  # the bar's tick: nothing off a terminal
    assert capsys.readouterr().out == ""
    sink.metrics(4, STEP)
    assert capsys.readouterr().out == console_line(STEP, 10) + "\n"


def test_metrics_jsonl_keeps_the_history_up_to_the_resumed_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    first = JsonlSink(path)
    first.start(None, {}, 0)
    for step in (2, 4, 6):
        first.metrics(step, {**STEP, "step": float(step), "grad_norm": float("nan")})
    first.end(None)
    path.write_text(path.read_text() + '{"step": 8, "lo')  # a torn line: a killed run
    again = JsonlSink(path)
    again.start(None, {}, 4)  # resumed from step 4: steps 5.. are trained again
    again.metrics(6, {**STEP, "step": 6.0, "loss": 1.0})
    again.end({})
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in rows] == [(2, 2.5), (4, 2.5), (6, 1.0)]
    assert rows[0]["grad_norm"] == "nan" and next(iter(rows[0])) == "step"
    fresh = JsonlSink(path)
    fresh.start(None, {}, 0)  # a run from the start starts the file afresh
    fresh.end({})
    assert path.read_text() == ""


class Broken(MetricSink):
    name = "broken"
    calls = 0

    def metrics(self, step, metrics):
        Broken.calls += 1
        raise ConnectionError("unreachable")


class Counting(MetricSink):
    def __init__(self):
        self.steps = []

    def metrics(self, step, metrics):
        self.steps.append(step)


def test_a_failing_sink_is_switched_off_with_one_warning_and_the_others_go_on():
    counting = Counting()
    sinks = Sinks([Broken(), counting])
    with pytest.warns(RuntimeWarning, match="metric sink 'broken' failed in metrics"):
        sinks.metrics(1, STEP)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sinks.metrics(2, STEP)
    assert Broken.calls == 1 and counting.steps == [1, 2]


class Store:
    """The rendezvous store's ``add``, shared by the 'ranks' of a test."""

    def __init__(self):
        self.counts = {}

    def add(self, key, n):
        self.counts[key] = self.counts.get(key, 0) + n
        return self.counts[key]


def test_a_warning_is_one_line_without_its_source_and_said_once_per_run(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    store, out = Store(), [io.StringIO(), io.StringIO()]
    ranks = [WarningLines(stream) for stream in out]
    for lines in ranks:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            lines.install()
            try:
                for _ in range(2):
                    warnings.warn("the model is on the meta device:\n  stages unchecked",
                                  UserWarning, stacklevel=1)
                lines.attach(store)  # the process group exists: held lines are agreed on
                warnings.warn("late", FutureWarning, stacklevel=1)
            finally:
                lines.uninstall()
    said = out[0].getvalue() + out[1].getvalue()
    assert said.splitlines() == [
        "warning: UserWarning: the model is on the meta device: stages unchecked",
        "warning: FutureWarning: late"]
    assert ".py" not in said


def test_the_resume_and_stop_lines(monkeypatch):
    index = {"step": 3, "grid": {"degrees": {"pipeline": 1, "data": 2, "tensor": 2}},
             "parallel_config": {"parallelism": {"zero": 1}}, "data": {"position": 24}}

    class Stream:
        global_batch, batches_per_epoch = 8, 10

    class Schedule:
        resume_note, total, lr = None, 6, 2.6e-3

    layout = layout_words({"pipeline": 2, "data": 2, "tensor": 1})
    line = resume_line("ck/step-00000003", index, layout, Stream(), Schedule())
    assert line == ("resumed from ck/step-00000003 at step 3: written on data 2 x tensor 2 "
                    "(ZeRO-1), read onto pipeline 2 x data 2; data at sample 24 (epoch 1, "
                    "batch 4 of 10); lr schedule as saved (cosine to step 6): lr 2.60e-03 "
                    "at step 3")
    Schedule.resume_note = "lr schedule re-spread from step 3 over train.steps = 9"
    assert resume_line("c", index, "data 2 x tensor 2 (ZeRO-1)", Stream(), Schedule()
                       ).endswith("written and read on data 2 x tensor 2 (ZeRO-1); data at "
                                  "sample 24 (epoch 1, batch 4 of 10); lr schedule re-spread "
                                  "from step 3 over train.steps = 9")
    monkeypatch.setenv("PARAXIS_COMMAND", "paraxis train --config run.yaml")
    assert stop_line(3, "by train.exit_after_steps = 3", "ck") == (
        "stopped by train.exit_after_steps = 3 after step 3: checkpoint ck/step-00000003 "
        "written; resume with: paraxis train --config run.yaml")


def test_a_logging_integration_that_is_not_installed_is_refused_naming_it():
    cfg = RunConfig.from_dict({"logging": {"tensorboard": "tb/"}})
    with pytest.raises(ConfigError, match="pip install paraxis-tensorboard"):
        check_sinks(cfg, make_plugin_manager(load_entrypoints=False))
    check_sinks(RunConfig.from_dict({}), make_plugin_manager(load_entrypoints=False))
