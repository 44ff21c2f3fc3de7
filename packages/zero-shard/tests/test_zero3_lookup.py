"""ZeRO-3 gathers a plain embedding lookup's table for forward only (issue 36, item 5):
its backward reads no weight (the table's gradient is the output's, added into rows by
index), so gathering it again for backward, as every other unit is, only held a second
whole table beside its whole gradient at the end of backward.

On data 2 (core's tiny model with a bare token table, named as transformers names the
input embedding): the same steps gathering the table for backward too give
bit-identical losses, gradient norms and shards; the table is gathered once per step
here and twice there. A table whose module has a forward of its own is gathered for
both, as before."""

import pytest
import torch
from torch import nn
from zero_tiny import CFG, TRAIN, train_steps

import paraxis
from paraxis.models.tiny import TinyTransformer
from paraxis.testing.parity import local_shards
from paraxis_zero import sharded_unit, stage3


class _Scaled(nn.Embedding):
    """A table with a forward of its own (as Gemma's scaled embedding has)."""

    def forward(self, ids):
        return super().forward(ids) * 1.0


class LookupTiny(TinyTransformer):
    """Core's tiny model with a bare token table, named as transformers names it."""

    def __init__(self, cfg, table=nn.Embedding):
        super().__init__(cfg)
        self.embed = table(cfg.vocab_size, cfg.hidden_size)

    def get_input_embeddings(self):
        return self.embed

    def hidden_states(self, input_ids=None, inputs_embeds=None, position_ids=None,
                      attention_mask=None):
        return super().hidden_states(inputs_embeds=self.embed(input_ids),
                                     attention_mask=attention_mask)


def steps(skip: bool, scaled: bool = False):
    torch.manual_seed(0)
    model = LookupTiny(CFG, _Scaled if scaled else nn.Embedding)
    launched: list[str] = []
    start = sharded_unit.ShardedUnit.start_gather

    def counting(unit, compute):
        if unit.state == sharded_unit.SHARDED:
            launched.append(unit.name)
        start(unit, compute)

    sharded_unit.ShardedUnit.start_gather = counting
    reads = stage3.reads_weights_back
    if not skip:
        stage3.reads_weights_back = lambda module: True
    try:
        engine = paraxis.parallelize(model, data=2, zero=3, train=TRAIN)
        names = [u.name for u in engine.ctx.extras["zero"].units]
        launched.clear()  # what parallelize's own checks gathered
        history = train_steps(engine, 0, 3)
        shards = local_shards(engine.model)
        engine.close()
    finally:
        sharded_unit.ShardedUnit.start_gather = start
        stage3.reads_weights_back = reads
    return history, shards, launched.count("embedding"), names


def both():
    return steps(True), steps(False), steps(True, scaled=True)


def test_a_lookup_table_is_gathered_for_forward_only(worlds):
    for skipped, gathered, scaled in worlds.run(2, both):
        assert "embedding" in skipped[3], skipped[3]
        assert skipped[0] == gathered[0]  # losses and gradient norms, exactly
        for name, shard in skipped[1].items():
            assert torch.equal(shard[0], gathered[1][name][0]), name
        assert (skipped[2], gathered[2], scaled[2]) == (3, 6, 6)


@pytest.mark.parametrize("cls, reads", [(nn.Embedding, False), (_Scaled, True),
                                        (nn.Linear, True)])
def test_only_an_embeddings_own_forward_is_trusted(cls, reads):
    from paraxis.parallel.code_reading import reads_weights_back

    assert reads_weights_back(cls(4, 4)) is reads
