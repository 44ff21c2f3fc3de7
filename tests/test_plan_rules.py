"""``paraxis plan`` and ``paraxis validate`` with the axis packages installed: the
planner asks each axis' own rules (it restates none), and validate checks a layout that
needs them (core's own tests run with core alone)."""

import json

from paraxis.cli.main import main

TINY = {"vocab_size": 256, "hidden_size": 64, "num_layers": 4, "num_heads": 4,
        "intermediate_size": 128, "seq_length": 64}


def _yaml(tmp_path, parallelism):
    path = tmp_path / "run.yaml"
    path.write_text(f"parallelism: {parallelism}\n" "schedule: {microbatches: 2}\n"
                    f"model: {{family: tiny, config: {json.dumps(TINY)}}}\n"
                    "train: {global_batch: 8, seq_length: 64, bf16: true}\n")
    return path


def test_plan_refuses_by_the_tensor_axis_rules(capsys, tmp_path):
    code = main(["plan", "--model", str(_yaml(tmp_path, "{data: 2, tensor: 2}")),
                 "--tensor", "3"])
    out, err = capsys.readouterr()
    assert code == 1 and out == ""
    assert "must be divisible by the tensor degree 3" in err and err.count("\n") == 1


def test_plan_checks_ulysses_heads_through_the_context_axis(capsys, tmp_path):
    """The Ulysses head rule lives in paraxis-seq-context; the planner asks it (its own
    copy refused layouts the axis accepts)."""
    path = _yaml(tmp_path, "{}")
    code = main(["plan", "--model", str(path), "--context", "8", "--context-impl", "ulysses"])
    _, err = capsys.readouterr()
    assert code == 1 and "Ulysses" in err and "tensor x context = 8" in err
    assert main(["plan", "--model", str(path), "--context", "2", "--context-impl",
                 "ulysses"]) == 0


def test_validate_a_two_axis_layout_warns_when_it_does_not_fit(capsys, tmp_path):
    path = _yaml(tmp_path, "{data: 2, tensor: 2}")
    code = main(["validate", "--config", str(path), "--device-memory", "1MB"])
    out, err = capsys.readouterr()
    assert code == 0 and "valid" in out
    assert "warning:" in err and "the largest term is" in err


def test_a_v_schedule_with_an_odd_chunk_count_is_refused_in_one_line(capsys, tmp_path):
    """ZB-V folds two chunks per rank into a V; the pipeline axis' rules refuse three,
    for ``paraxis plan`` and ``paraxis validate`` alike, before any process group."""
    path = _yaml(tmp_path, "{data: 2}")
    code = main(["plan", "--model", str(path), "--pipeline", "2", "--schedule", "zbv",
                 "--virtual-stages", "3"])
    out, err = capsys.readouterr()
    assert code == 1 and out == "" and err.count("\n") == 1
    assert "schedule.virtual_stages = 3" in err and "cannot fold into a V" in err
    bad = tmp_path / "bad.yaml"
    bad.write_text(path.read_text().replace(
        "parallelism: {data: 2}", "parallelism: {pipeline: 2}").replace(
        "schedule: {microbatches: 2}",
        "schedule: {microbatches: 4, pipeline_schedule: zbv, virtual_stages: 3}"))
    code = main(["validate", "--config", str(bad)])
    out, err = capsys.readouterr()
    assert code != 0 and "cannot fold into a V" in err + out
