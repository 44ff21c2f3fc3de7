"""The tensor axis' rules, reported by its own package before any process group, and
``tensor_overlap``'s resolution per group."""

import warnings

import pytest

from paraxis import ConfigError, ModelShape, ParallelConfig, make_plugin_manager, validate
from paraxis.runtime.cuda_paths import UnvalidatedCudaPath
from paraxis.runtime.group import AxisGroup
from paraxis_tp.rules import check_tensor
from paraxis_tp.strategy import overlap_wanted

SHAPE = ModelShape(hidden_size=60, num_attention_heads=4, num_key_value_heads=3,
                   num_layers=2, vocab_size=5, intermediate_size=100, seq_length=30)


def fields(problems):
    return sorted(p.field for p in problems)


def test_every_split_dimension_is_checked_at_once():
    problems = check_tensor(ParallelConfig.from_kwargs(tensor=8, sequence_parallel=True),
                            SHAPE)
    assert fields(problems) == ["model.hidden_size", "model.intermediate_size",
                                "model.num_attention_heads", "model.num_key_value_heads",
                                "model.seq_length", "model.vocab_size"]
    assert all(p.rule and p.fix for p in problems)
    assert "choose tensor among [1, 2, 4]" in str(ConfigError(problems))


def test_kv_heads_must_split_over_the_tensor_degree():
    shape = ModelShape(hidden_size=64, num_attention_heads=8, num_key_value_heads=2,
                       num_layers=2, vocab_size=100)
    assert check_tensor(ParallelConfig.from_kwargs(tensor=2), shape) == []
    (p,) = check_tensor(ParallelConfig.from_kwargs(tensor=4), shape)
    assert p.field == "model.num_key_value_heads" and "never replicated" in p.rule
    assert "choose tensor among [1, 2]" in str(p)


def test_sequence_parallel_needs_a_tensor_axis():
    (p,) = check_tensor(ParallelConfig.from_kwargs(sequence_parallel=True), None)
    assert p.field == "parallelism.sequence_parallel"


def test_the_installed_plugin_reports_through_validate():
    try:
        validate(ParallelConfig.from_kwargs(tensor=8), world_size=8, model=SHAPE,
                 plugin_manager=make_plugin_manager())
    except ConfigError as exc:
        assert "model.num_attention_heads" in str(exc)
    else:
        raise AssertionError("tensor=8 on 4 heads was accepted")


@pytest.mark.parametrize(("option", "nccl", "want", "warned"), [
    ("auto", False, False, 0),  # gloo: no step-time gain measured on CPU
    ("on", False, True, 0),
    ("auto", True, False, 0),   # NCCL: off until a GPU run validates it (cuda_paths)
    ("off", True, False, 0),
    ("on", True, True, 1),      # by hand: runs, one warning naming the path
])
def test_overlap_auto_is_off_everywhere_until_a_gpu_validates_it(option, nccl, want, warned):
    group = AxisGroup(axes=("tensor",), ranks=(0, 1), rank=0, stream_ordered=nccl)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert overlap_wanted(option, group) is want
    seen = [w for w in seen if w.category is UnvalidatedCudaPath]
    assert len(seen) == warned
    assert all("'tensor_overlap'" in str(w.message) for w in seen)
