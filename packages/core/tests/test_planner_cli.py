"""``paraxis plan`` and ``paraxis validate --device-memory`` end to end, in process."""

import importlib.util
import json
import xml.dom.minidom

import pytest

from paraxis.cli.main import main
from paraxis.config.parallel import ParallelConfig

TINY = {"vocab_size": 256, "hidden_size": 64, "num_layers": 4, "num_heads": 4,
        "intermediate_size": 128, "seq_length": 64}


@pytest.fixture
def tiny_yaml(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        "parallelism: {data: 2, tensor: 2}\n"
        "schedule: {microbatches: 2}\n"
        f"model: {{family: tiny, config: {json.dumps(TINY)}}}\n"
        "train: {global_batch: 8, seq_length: 64, bf16: true}\n")
    return path


def run(capsys, *argv):
    code = main(["plan", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def test_evaluate_prints_memory_communication_bubble_and_step(capsys, tiny_yaml):
    code, out, err = run(capsys, "--model", tiny_yaml, "--data", 2, "--pipeline", 2,
                         "--device-memory", "1GB", "--explain")
    assert code == 0, err
    for text in ("memory per rank", "pipeline stage 0 of 2", "fits 1.00 GB", "send/recv",
                 "bubble", "MFU", "assumed", "1. Resident", "6. Failure modes"):
        assert text in out, text


def test_json_has_the_documented_keys(capsys, tiny_yaml):
    code, out, _ = run(capsys, "--model", tiny_yaml, "--data", 2, "--tensor", 2, "--zero", 1,
                       "--peak-flops", "100T", "--bandwidth", "intra=100GB/s,inter=10GB/s",
                       "--json")
    assert code == 0
    plan = json.loads(out)
    assert set(plan["memory"]) >= {"parameters", "gradients", "optimizer", "activations",
                                   "buffers", "total"}
    assert set(plan["communication"]) == {"data", "tensor"}
    assert plan["config"]["data"] == 2 and plan["config"]["zero"] == 1
    assert plan["bubble"] == 0.0 and plan["step_time_s"] > 0 and 0 < plan["mfu"] <= 1


def test_json_omits_step_time_without_peak_and_bandwidth(capsys, tiny_yaml):
    code, out, _ = run(capsys, "--model", tiny_yaml, "--json")
    assert code == 0 and "step_time_s" not in json.loads(out)


def test_search_ranks_and_svg_parses(capsys, tiny_yaml, tmp_path):
    svg = tmp_path / "plan.svg"
    code, out, err = run(capsys, "--model", tiny_yaml, "--world-size", 4,
                         "--gpus-per-node", 2, "--device-memory", "1GB", "--svg", svg)
    assert code == 0, err
    assert "searched" in out and "why slower than #1" in out and "seeds' placement" in out
    assert "the best layout, #1" in out
    doc = xml.dom.minidom.parse(str(svg))
    assert doc.documentElement.tagName == "svg"
    code, out, _ = run(capsys, "--model", tiny_yaml, "--world-size", 4, "--json")
    assert code == 0 and json.loads(out)["search"]["ranking"]


@pytest.mark.parametrize(("argv", "message"), [
    (["--device-memory", "80 gigs"], "--device-memory '80 gigs' is not a quantity"),
    (["--world-size", 6, "--data", 2, "--tensor", 2, "--pipeline", 1, "--expert", 1,
      "--context", 1], "is not the product of the degrees"),
    (["--world-size", 6, "--tensor", 4], "do not divide --world-size 6"),
    (["--bandwidth", "intra=1GB/s"], "lacks inter"),
    (["--headroom", 1.5], "--headroom 1.5 must be in [0, 1)"),
    (["--world-size", 2, "--device-memory", "1kB"], "no layout of 2 ranks fits"),
])
def test_bad_input_is_one_line_and_exit_1(capsys, tiny_yaml, argv, message):
    code, out, err = run(capsys, "--model", tiny_yaml, *argv)
    assert code == 1 and out == ""
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_unknown_model_type_is_one_line(capsys, tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "no_such_model", "hidden_size": 8}')
    code, _, err = run(capsys, "--model", tmp_path)
    assert code == 1 and "model_type 'no_such_model'" in err and err.count("\n") == 1


def test_rules_of_a_missing_axis_package_are_named_unchecked(capsys, tiny_yaml):
    """Core alone: the tensor axis' rules (paraxis-tp-layers) cannot be checked, and the
    plan says so instead of planning as if they passed."""
    from paraxis.engine.plugins import make_plugin_manager
    from paraxis.planner.evaluate import unchecked_axes

    none = make_plugin_manager(load_entrypoints=False)
    layout = ParallelConfig.from_kwargs(tensor=3, data=2)
    assert unchecked_axes(layout, none) == ("tensor", "data")
    code, out, err = run(capsys, "--model", tiny_yaml, "--tensor", 3)
    if importlib.util.find_spec("paraxis_tp") is None:
        assert code == 0, err
        assert "unchecked  the rules of tensor were not checked" in out
        assert "pip install paraxis-tp-layers" in out
    else:  # installed: its rule refuses 3 heads' worth of width (tests/test_plan_rules.py)
        assert code == 1 and "must be divisible by the tensor degree 3" in err


def test_validate_warns_when_the_plan_does_not_fit(capsys, tmp_path):
    path = tmp_path / "run.yaml"  # one rank: core's own axes only
    path.write_text(f"model: {{family: tiny, config: {json.dumps(TINY)}}}\n"
                    "train: {global_batch: 8, seq_length: 64, bf16: true}\n")
    code = main(["validate", "--config", str(path), "--device-memory", "1MB"])
    out, err = capsys.readouterr()
    assert code == 0 and "valid" in out
    assert "warning:" in err and "the largest term is" in err
    assert main(["validate", "--config", str(path), "--device-memory", "80GB"]) == 0
    assert "warning" not in capsys.readouterr().err
    assert main(["validate", "--config", str(path), "--device-memory", "lots"]) == 1
    assert "--device-memory 'lots'" in capsys.readouterr().err


def test_efficiency_tables_time_the_step(capsys, tiny_yaml, tmp_path):
    """A built-in table by name, a written one by file, single figures overridden; a
    table chosen on purpose gives the speeds, so --json has the step time."""
    from paraxis.planner.efficiency import BUILTIN, write_efficiency

    times = {}
    for args in (("--efficiency", "h100"), ("--efficiency", "h200"),
                 ("--efficiency", "h100", "--efficiency-set", "gemm=0.001")):
        code, out, err = run(capsys, "--model", tiny_yaml, "--data", 2, "--peak-flops", "989T",
                             "--bandwidth", "intra=450GB/s,inter=50GB/s", "--json", *args)
        assert code == 0, err
        times[args] = json.loads(out)["step_time_s"]
    assert times[("--efficiency", "h200")] < times[("--efficiency", "h100")]  # faster HBM
    assert times[("--efficiency", "h100", "--efficiency-set", "gemm=0.001")] > \
        times[("--efficiency", "h100")]
    path = tmp_path / "table.json"
    write_efficiency(BUILTIN["h200"], path)
    code, out, _ = run(capsys, "--model", tiny_yaml, "--data", 2, "--efficiency", path, "--json")
    assert code == 0 and json.loads(out)["step_time_s"] == pytest.approx(
        times[("--efficiency", "h200")])


@pytest.mark.parametrize(("args", "words"), [
    (("--efficiency", "nope.json"), "neither a built-in table"),
    (("--efficiency-set", "speed=2"), "KEY one of"),
])
def test_bad_efficiency_input_is_one_line(capsys, tiny_yaml, args, words):
    code, _, err = run(capsys, "--model", tiny_yaml, *args)
    assert code == 1 and words in err and len(err.strip().splitlines()) == 1


def test_calibrate_alone_writes_a_table(capsys, tmp_path, monkeypatch):
    from paraxis.planner import calibrate as calibrate_module

    monkeypatch.setattr(calibrate_module, "GEMM_M", (8, 64))
    monkeypatch.setattr(calibrate_module, "GEMM_NK", (16,))
    monkeypatch.setattr(calibrate_module, "SEQS", (32,))
    path = tmp_path / "here.json"
    code, out, err = run(capsys, "--calibrate", path, "--world-size", 1)
    assert code == 0, err
    assert "calibrated, written to" in out and json.loads(path.read_text())["gemm"]
    code, _, err = run(capsys, "--world-size", 2)
    assert code == 1 and "--model is required" in err


def test_the_v_schedules_plan_two_chunks_with_both_ends_on_rank_zero(capsys, tiny_yaml):
    """``--schedule zbv`` (or dualpipev) holds two chunks per rank unless told otherwise;
    rank 0 holds the first and the last stage (embedding and head), so it is the most
    loaded (tests/test_plan_rules.py: the pipeline axis refuses an odd count)."""
    from paraxis.parallel.bubble import closed_form_bubble

    for name in ("zbv", "dualpipev"):
        code, out, err = run(capsys, "--model", tiny_yaml, "--pipeline", 2, "--data", 2,
                             "--schedule", name, "--json")
        assert code == 0, err
        plan = json.loads(out)
        assert plan["config"]["virtual_stages"] == 2 and plan["memory"]["stage"] == 0
        m = plan["config"]["microbatches"]
        assert plan["bubble"] == pytest.approx(closed_form_bubble(name, 2, m, 2).fraction)
