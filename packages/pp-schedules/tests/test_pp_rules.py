"""The pipeline axis' rules, reported by its own package before any process group."""

from paraxis import ModelShape, ParallelConfig
from paraxis_pp.rules import check_pipeline

SHAPE = ModelShape(hidden_size=64, num_attention_heads=4, num_layers=2, vocab_size=100)


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
