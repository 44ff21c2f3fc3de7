"""The context strategy and its batch transform, without processes and without core's
coming Batch class (a stand-in with the same fields): the zigzag split of ids, targets
and positions, the refusal of packed positions, the model's attention selected, and
the plugin's registration and validation rule."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from paraxis.collectives import CommStats
from paraxis.config import ParallelConfig
from paraxis.errors import ConfigError
from paraxis.grid import AxisGroup
from paraxis.plugins import collect_strategies, make_plugin_manager
from paraxis.validation import ModelShape, validate
from paraxis_seq import _plugin
from paraxis_seq.strategy import ContextParallelStrategy, SequenceSplit
from paraxis_seq.zigzag import positions


@dataclasses.dataclass(frozen=True)
class StandInBatch:
    input_ids: torch.Tensor
    targets: torch.Tensor
    position_ids: torch.Tensor | None = None


def test_sequence_split_zigzag():
    ids = torch.arange(16).view(1, 16).repeat(2, 1)
    batch = StandInBatch(ids, ids + 100)
    out = SequenceSplit(size=2, rank=1)(batch)
    want = positions(16, 2, 1)
    assert torch.equal(out.input_ids[0], want) and torch.equal(out.targets[1], want + 100)
    assert torch.equal(out.position_ids[0], want) and out.position_ids.shape == (2, 8)
    shared = SequenceSplit(size=2, rank=0)(StandInBatch(ids, ids, torch.arange(16)[None]))
    assert shared.position_ids.shape == (1, 8)  # shared by the rows, as given
    assert torch.equal(shared.position_ids[0], positions(16, 2, 0))


def test_sequence_split_refuses_packed_positions():
    ids = torch.zeros(1, 8, dtype=torch.long)
    packed = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]])
    with pytest.raises(ValueError, match="packed"):
        SequenceSplit(size=2, rank=0)(StandInBatch(ids, ids, packed))


def test_strategy_selects_attention_and_appends_the_split():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1,
                                   vocab_size=32)
    model = transformers.LlamaForCausalLM(cfg)
    group = AxisGroup(("context",), (0,), 0, None, CommStats())
    ctx = SimpleNamespace(grid=SimpleNamespace(group=lambda axes: group),
                          config=ParallelConfig(), batch_transforms=[], extras={})
    assert ContextParallelStrategy().apply(model, ctx) is model
    assert model.config._attn_implementation == "paraxis_ring"
    assert model.config.use_cache is False
    assert ctx.batch_transforms == [SequenceSplit(1, 0, "zigzag")]


def test_plugin_registers_and_validates():
    pm = make_plugin_manager(load_entrypoints=False, builtins=False, plugins=(_plugin,))
    assert collect_strategies(pm)["context"] is ContextParallelStrategy
    shape = ModelShape(hidden_size=32, num_attention_heads=4, num_layers=2, vocab_size=64,
                       seq_length=12)
    config = ParallelConfig.from_kwargs(context=2)
    with pytest.raises(ConfigError, match="2 x context = 4"):
        validate(config, world_size=2, model=ModelShape(**{**vars(shape), "seq_length": 10}),
                 plugin_manager=pm)
    validate(config, world_size=2, model=shape, plugin_manager=pm)
