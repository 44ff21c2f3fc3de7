"""The pipeline axis' rules, reported by its own package before any process group."""

import pytest

from paraxis import ModelShape, ParallelConfig
from paraxis_pp.rules import check_pipeline

SHAPE = ModelShape(hidden_size=64, num_attention_heads=4, num_layers=2, vocab_size=100)
FOUR_LAYERS = ModelShape(hidden_size=64, num_attention_heads=4, num_layers=4, vocab_size=100)


def fields(problems):
    return sorted(p.field for p in problems)


def test_pipeline_rules_all_at_once():
    problems = check_pipeline(ParallelConfig.from_kwargs(pipeline=4, microbatches=2), SHAPE)
    assert fields(problems) == ["parallelism.pipeline", "schedule.microbatches"]


def test_interleaving_goes_with_its_schedule():
    config = ParallelConfig.from_kwargs(pipeline=2, microbatches=3, virtual_stages=2)
    assert fields(check_pipeline(config, None)) == ["schedule.virtual_stages"]
    config = ParallelConfig.from_kwargs(pipeline=2, microbatches=3, virtual_stages=2,
                                        pipeline_schedule="interleaved_1f1b")
    assert fields(check_pipeline(config, None)) == ["schedule.microbatches"]


def test_split_points_must_cover_every_layer_once():
    shape = ModelShape(hidden_size=64, num_attention_heads=4, num_layers=8, vocab_size=100)
    bad = ParallelConfig.from_kwargs(pipeline=2, microbatches=2, pipeline_split=[9])
    assert fields(check_pipeline(bad, shape)) == ["schedule.pipeline_split"]
    good = ParallelConfig.from_kwargs(pipeline=2, microbatches=2, pipeline_split=[3])
    assert check_pipeline(good, shape) == []


@pytest.mark.parametrize(("name", "chunks", "why"), [
    ("zbv", 1, "cannot fold into a V"), ("zbv", 3, "cannot fold into a V"),
    ("dualpipev", 4, "exactly two chunks per rank")])
def test_a_v_schedule_holds_two_chunks_per_rank(name, chunks, why):
    config = ParallelConfig.from_kwargs(pipeline=2, microbatches=4, pipeline_schedule=name,
                                        virtual_stages=chunks)
    (problem,) = check_pipeline(config, None)
    assert problem.field == "schedule.virtual_stages" and why in str(problem)
    assert "set virtual_stages: 2" in str(problem)


def test_dualpipev_needs_a_microbatch_per_stage():
    config = ParallelConfig.from_kwargs(pipeline=2, microbatches=3, virtual_stages=2,
                                        pipeline_schedule="dualpipev")
    (problem,) = check_pipeline(config, None)
    assert problem.field == "schedule.microbatches" and ">= 4" in str(problem)
    for name, m in (("dualpipev", 4), ("zbv", 2)):
        config = ParallelConfig.from_kwargs(pipeline=2, microbatches=m, virtual_stages=2,
                                            pipeline_schedule=name)
        assert check_pipeline(config, FOUR_LAYERS) == []
    # Two chunks per rank: 2 x 2 stages need 4 layers.
    problems = check_pipeline(config, SHAPE)
    assert fields(problems) == ["parallelism.pipeline"] and "4 stages" in str(problems[0])
