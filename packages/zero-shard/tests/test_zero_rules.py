"""The ZeRO axis' validation rules and the pieces that need no processes."""

import pytest
import torch

from paraxis import ParallelConfig
from paraxis.config.errors import ConfigError, MissingAxisPackageError
from paraxis.config.rules import validate
from paraxis.engine.plugins import make_plugin_manager
from paraxis.engine.resolve import resolve_strategies
from paraxis.parallel.placement import Placement
from paraxis.runtime.grid import AxisGroup
from paraxis_zero.layout import ShardLayout
from paraxis_zero.rules import check_zero


def problems(**kw):
    return check_zero(ParallelConfig.from_kwargs(**kw), None)


def test_zero_without_replicas_is_an_error_not_a_no_op():
    (p,) = problems(zero=2)
    assert p.field == "parallelism.zero" and "no-op" in p.rule and "data > 1" in p.fix
    assert problems(zero=1, data=2) == []
    assert problems(zero=3, expert=2) == []  # expert replicas hold dense copies
    assert problems(zero=1, context=2) == []


def test_every_stage_combines_with_a_pipeline():
    """Issue 36: stages 2 and 3 run beside a pipeline (one gather and one
    reduce-scatter per step); they were refused."""
    for zero in (1, 2, 3):
        assert problems(zero=zero, data=2, pipeline=2, microbatches=2) == []


@pytest.mark.parametrize(("options", "words"), [
    ({"zero": 3, "data": 4, "zero_shard": 3}, "must divide parallelism.data (4)"),
    ({"zero": 2, "data": 4, "zero_shard": 8}, "must divide parallelism.data (4)"),
    ({"zero": 0, "data": 4, "zero_shard": 2}, "zero is 0"),
    ({"zero": 1, "data": 4, "zero_shard": 1}, "shard nothing"),
])
def test_zero_shard_refused_in_one_line_before_any_process_group(options, words):
    (p,) = problems(**options)
    assert p.field == "parallelism.zero_shard" and words in p.rule
    assert "\n" not in str(p)
    assert problems(zero=3, data=4, zero_shard=2) == []


def test_rules_run_through_validate_with_the_installed_plugin():
    with pytest.raises(ConfigError, match=r"parallelism\.zero_shard.*\[2, 4\]"):
        validate(ParallelConfig.from_kwargs(zero=3, data=4, zero_shard=3),
                 world_size=4, plugin_manager=make_plugin_manager())


def test_the_zero_axis_resolves_to_this_package_and_names_it_when_missing():
    config = ParallelConfig.from_kwargs(data=2, zero=2)
    (cls,) = resolve_strategies(config, make_plugin_manager())
    assert cls.__module__ == "paraxis_zero.strategy"
    with pytest.raises(MissingAxisPackageError, match="pip install paraxis-zero-shard"):
        resolve_strategies(config, make_plugin_manager(load_entrypoints=False))


def _layout(rows, n=3, rank=1):
    params = [torch.nn.Parameter(torch.randn(r, 2)) for r in rows]
    return ShardLayout.build(AxisGroup(("data",), tuple(range(n)), rank), params), params


def test_layout_round_trips_uneven_parameters_through_rank_major_buffers():
    layout, params = _layout([7, 3, 1])  # chunks of 3, 1, 1 rows over 3 ranks
    assert layout.chunk == [3, 1, 1] and layout.per_rank == (3 + 1 + 1) * 2
    buffer = torch.full((3 * layout.per_rank,), float("nan"))
    for i, p in enumerate(params):
        layout.to_rank_major(buffer, i, p.data)
    assert not torch.isnan(buffer).any()  # padding travels as zeros
    for i, p in enumerate(params):
        back = torch.empty_like(p)
        layout.from_rank_major(buffer, i, back)
        assert torch.equal(back, p.data)
    assert torch.equal(layout.slot(buffer, 0)[2], torch.cat([params[0].data[6:7].view(-1),
                                                              torch.zeros(4)]))


def test_layout_placements_say_which_rows_each_rank_holds():
    layout, _ = _layout([7, 1])
    rec = Placement("w", (7, 2), torch.float32, replicated=("data", "tensor"))
    shard = layout.placement(0, rec)
    assert shard.shards[-1].axes == ("data",) and shard.local_shape == (3, 2)
    assert (shard.shards[-1].offset, shard.shards[-1].length) == (3, 3)
    assert layout.rank_rows(1, rank=1) == (1, 0, 1)  # one row: ranks 1 and 2 hold padding
    assert layout.rank_rows(0, rank=2) == (6, 1, 2)


@pytest.mark.parametrize("command", ["validate", "train"])
def test_the_cli_says_a_bad_zero_shard_in_one_line_before_any_process(tmp_path, capsys,
                                                                     command):
    """Issue 36's bad input: zero_shard not dividing data, one line, exit 1, no process
    group and no worker started."""
    from paraxis.cli.main import main

    config = tmp_path / "run.yaml"
    config.write_text("parallelism: {data: 4, zero: 3, zero_shard: 3}\n"
                      "model: {family: tiny, config: {hidden_size: 32, num_layers: 2, "
                      "num_heads: 4, intermediate_size: 64}}\n"
                      "data: {source: stdlib, tokenizer: bytes}\n")
    assert main([command, "--config", str(config)]) == 1
    lines = [x for x in capsys.readouterr().err.splitlines() if "zero_shard" in x]
    assert len(lines) == 1 and "must divide parallelism.data (4)" in lines[0]
    assert not torch.distributed.is_initialized()
