"""ParallelConfig: kwargs, YAML in the seed format, ${VAR} expansion, type errors."""

import pytest

from paraxis import ConfigError, ParallelConfig
from paraxis.config.text import expand_env

SEED_YAML = """
parallelism: {data: ${DATA_PARALLEL_DEGREE}, tensor: ${TP:-1}, pipeline: 1, expert: 1}
schedule: {microbatches: 4, activation_checkpointing: selective}
checkpoint: {format: distributed, save_rng_state: true, save_data_position: true}
"""


def test_kwargs_fill_sections():
    cfg = ParallelConfig.from_kwargs(data=2, tensor=2, zero=1, microbatches=4,
                                     save_rng_state=False)
    assert cfg.degrees == {"pipeline": 1, "data": 2, "expert": 1, "context": 1, "tensor": 2}
    assert cfg.world_size == 4
    assert cfg.parallelism.zero == 1
    assert cfg.schedule.microbatches == 4
    assert cfg.checkpoint.save_rng_state is False


def test_yaml_seed_format_expands_env(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(SEED_YAML)
    cfg = ParallelConfig.from_yaml(path, env={"DATA_PARALLEL_DEGREE": "4"})
    assert cfg.parallelism.data == 4  # an int, not the string "4"
    assert cfg.parallelism.tensor == 1  # ${TP:-1} default
    assert cfg.schedule.activation_checkpointing == "selective"
    assert cfg.world_size == 4


def test_unset_variables_are_all_named(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("parallelism: {data: ${DP}, tensor: ${TP}}\n")
    with pytest.raises(ConfigError) as err:
        ParallelConfig.from_yaml(path, env={})
    assert [p.field for p in err.value.problems] == [f"{path}:1", f"{path}:1"]
    assert "DP is not set" in str(err.value) and "TP is not set" in str(err.value)


def test_partial_string_expansion():
    text = "# ${UNSET} in a comment is left alone\nname: run-${X}-b\n"
    assert expand_env(text, {"X": "7"}) == "# ${UNSET} in a comment is left alone\nname: run-7-b\n"


def test_type_errors_reported_together_with_field_and_value():
    with pytest.raises(ConfigError) as err:
        ParallelConfig.from_kwargs(data=0, tensor="two", zero=5, microbatches=-1)
    by_field = {p.field: p for p in err.value.problems}
    assert set(by_field) == {"parallelism.data", "parallelism.tensor", "parallelism.zero",
                             "schedule.microbatches"}
    assert by_field["parallelism.data"].value == 0
    assert by_field["parallelism.zero"].value == 5
    assert all(p.fix for p in err.value.problems)


def test_unknown_keys_rejected():
    with pytest.raises(ConfigError, match="tensr"):
        ParallelConfig.from_kwargs(tensr=2)
    with pytest.raises(ConfigError, match=r"parallelism\.tensr"):
        ParallelConfig.from_dict({"parallelism": {"tensr": 2}})
