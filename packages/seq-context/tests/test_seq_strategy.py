"""The context strategy against core's contracts, without processes: the zigzag split of
a :class:`paraxis.parallel.batch.Batch` (ids, shifted targets, positions), the refusal of packed
positions and padding masks, the model's attention selected (each pipeline chunk), the
plugin's rules on the model's shape and on the module itself, and ``parallelize``
refusing before any process group exists."""

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import paraxis
from paraxis.config.errors import ConfigError
from paraxis.config.parallel import ParallelConfig
from paraxis.config.rules import validate
from paraxis.config.shape import ModelShape
from paraxis.engine.plugins import collect_strategies, make_plugin_manager
from paraxis.parallel.anatomy import find_anatomy
from paraxis.parallel.batch import Batch
from paraxis.parallel.stages import PipelineChunks
from paraxis.runtime.collectives import CommStats
from paraxis.runtime.grid import AxisGroup
from paraxis_seq import _plugin
from paraxis_seq.rules import check_context, check_module
from paraxis_seq.strategy import ContextParallelStrategy, SequenceSplit
from paraxis_seq.zigzag import positions

SHAPE = ModelShape(hidden_size=32, num_attention_heads=4, num_layers=2, vocab_size=64,
                   num_key_value_heads=2, seq_length=256)


def test_sequence_split_zigzag():
    ids = torch.arange(16).view(1, 16).repeat(2, 1)
    batch = Batch.from_user(ids)  # targets shifted once, before the cut
    out = SequenceSplit(size=2, rank=1)(batch)
    want = positions(16, 2, 1)
    assert torch.equal(out.input_ids[0], want) and torch.equal(out.targets[1], want + 1)
    assert torch.equal(out.position_ids[0], want) and out.position_ids.shape == (2, 8)
    last = SequenceSplit(size=2, rank=0)(batch)  # holds position 15: no next token
    assert last.targets[0, -1] == -100 and torch.equal(last.targets[0, :4], torch.arange(1, 5))
    shared = SequenceSplit(size=2, rank=0)(Batch(ids, ids, torch.arange(16)[None]))
    assert shared.position_ids.shape == (1, 8)  # shared by the rows, as given
    assert torch.equal(shared.position_ids[0], positions(16, 2, 0))
    assert [mb.input_ids.shape for mb in out.chunk(2)] == [(1, 8), (1, 8)]


def test_sequence_split_turns_documents_and_padding_into_document_ids():
    """Packed documents and padding cannot travel as a whole-sequence mask: they become
    per-token document ids (pads -1), cut like the tokens, for the kernels."""
    ids = torch.arange(8).view(1, 8)
    packed = Batch.from_user({"input_ids": ids,
                              "position_ids": torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]])})
    assert packed.packed
    rank0 = SequenceSplit(size=2, rank=0)(packed)  # zigzag: chunks 0 and 3 of 4
    assert rank0.document_ids.tolist() == [[0, 0, 1, 1]]
    assert rank0.position_ids.tolist() == [[0, 1, 2, 3]]
    padded = Batch.from_user({"input_ids": ids, "attention_mask": torch.tensor(
        [[1, 1, 1, 1, 1, 1, 0, 0]])})
    rank1 = SequenceSplit(size=2, rank=1)(padded)  # chunks 1 and 2
    assert rank1.document_ids.tolist() == [[0, 0, 0, 0]] and rank1.padding_mask is None
    assert SequenceSplit(size=2, rank=0)(padded).document_ids.tolist() == [[0, 0, -1, -1]]
    ones = Batch.from_user({"input_ids": ids, "attention_mask": torch.ones(1, 8)})
    assert ones.padding_mask is None  # masks nothing
    assert SequenceSplit(size=2, rank=0)(ones).document_ids is None
    with pytest.raises(ValueError, match="8 equal chunks"):
        SequenceSplit(size=4, rank=0)(Batch.from_user(torch.zeros(1, 12, dtype=torch.long)))


def _alone():
    return AxisGroup(("context",), (0,), 0, None, CommStats())


def _ctx(model=None, **parallel):
    group = _alone()
    return SimpleNamespace(grid=SimpleNamespace(group=lambda axes: group),
                           config=ParallelConfig.from_kwargs(**parallel),
                           anatomy=find_anatomy(model) if model is not None else None,
                           batch_transforms=[], extras={})


def _llama(**over):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(**{**dict(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=32), **over})
    return transformers.LlamaForCausalLM(cfg)


@pytest.mark.parametrize("mode", ["ring", "ulysses"])
def test_strategy_selects_attention_and_appends_the_split(mode):
    model = _llama()
    ctx = _ctx(model, context_mode=mode)
    assert ContextParallelStrategy().apply(model, ctx) is model
    assert model.config._attn_implementation == f"paraxis_{mode}"
    assert model.config.use_cache is False
    layout = {"ring": "zigzag", "ulysses": "contiguous"}[mode]  # Ulysses: no permutation
    assert ctx.batch_transforms == [SequenceSplit(1, 0, layout)]
    assert ctx.extras["context"].mode == mode and ctx.extras["context"].layout == layout


def test_strategy_reaches_every_pipeline_chunk():
    import copy

    first = _llama()
    second = copy.copy(first)  # interleaved chunks are shallow copies...
    second.config = copy.deepcopy(first.config)  # ...here with a config of its own
    chunks = PipelineChunks([first, second])
    ContextParallelStrategy().apply(chunks, _ctx(first))
    assert [c.config._attn_implementation for c in chunks] == ["paraxis_ring"] * 2


def test_plugin_registers_and_validates():
    pm = make_plugin_manager(load_entrypoints=False, builtins=False, plugins=(_plugin,))
    assert collect_strategies(pm)["context"] is ContextParallelStrategy
    config = ParallelConfig.from_kwargs(context=2)
    with pytest.raises(ConfigError, match="2 x context = 4"):
        validate(config, world_size=2, model=ModelShape(**{**vars(SHAPE), "seq_length": 10}),
                 plugin_manager=pm)
    validate(config, world_size=2, model=SHAPE, plugin_manager=pm)


def _fields(problems):
    return [(p.field, p.value) for p in problems]


def test_rules_on_the_shape():
    def check(model=SHAPE, **parallel):
        return check_context(ParallelConfig.from_kwargs(**parallel), model)

    assert check(context=1, context_mode="ulysses") == []
    assert check(context=4) == []  # ring splits no heads
    assert check(context=4, context_mode="ulysses") == []  # 4 heads; 2 kv heads repeated
    short = ModelShape(**{**vars(SHAPE), "seq_length": 260})
    assert _fields(check(short, context=4)) == [("model.seq_length", 260)]
    assert check(short, context=2) == []  # 260 = 4 chunks of 65
    assert check(short, context=4, context_mode="ulysses") == []  # contiguous: 4 of 65
    got = check(ModelShape(**{**vars(SHAPE), "seq_length": 258}), context=4,
                context_mode="ulysses")
    assert _fields(got) == [("model.seq_length", 258)] and "contiguous" in got[0].rule
    got = check(context=8, context_mode="ulysses")
    assert _fields(got) == [("model.num_attention_heads", 4)]
    assert "tensor x context = 8" in got[0].rule and "context_mode: ring" in got[0].fix
    got = check(context=4, tensor=2, context_mode="ulysses")  # heads split by tensor first
    assert _fields(got) == [("model.num_attention_heads", 4)]
    assert "[1, 2]" in got[0].fix
    assert check(context=2, tensor=2, context_mode="ulysses") == []
    assert check_context(ParallelConfig.from_kwargs(context=2), SHAPE, layout="contiguous") \
        == []


def test_rules_on_the_module():
    config = ParallelConfig.from_kwargs(context=2)
    assert check_module(config, _llama()) == []
    assert check_module(ParallelConfig(), torch.nn.Linear(2, 2)) == []  # no context axis
    (problem,) = check_module(config, torch.nn.Linear(2, 2))
    assert problem.field == "parallelism.context" and "not a transformers" in problem.rule
    custom = _llama()
    custom.config._attn_implementation = "my_kernel"
    (problem,) = check_module(config, custom)
    assert "'my_kernel'" in problem.rule and "sdpa" in problem.fix


def test_parallelize_refuses_before_any_process_group():
    """Every problem at once, from validation and from the module, and no group."""
    transformers = pytest.importorskip("transformers")
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):  # Falcon's ALiBi variant: inline attention, refused
        falcon = AutoModelForCausalLM.from_config(AutoConfig.for_model(
            "falcon", hidden_size=16, num_attention_heads=2, num_hidden_layers=1,
            vocab_size=32, alibi=True))
    with pytest.raises(ConfigError) as err:
        paraxis.parallelize(falcon, context=4, context_mode="ulysses",
                            train={"seq_length": 18})
    text = str(err.value)
    for part in ("world_size", "computes attention inline", "model.seq_length = 18",
                 "model.num_attention_heads = 2"):
        assert part in text, text
    assert not dist.is_initialized()
    assert transformers is not None
