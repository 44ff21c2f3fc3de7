"""With a capacity factor, drops are deterministic and identical to one process that
applies the same capacity to the same token groups (each rank's tokens): 20 steps of
expert=2 and expert 2 x data 2 against one process whose experts drop per group
(``ExpertParallel.set_capacity_groups``), at the shared tolerance, drop counts equal."""

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("paraxis_moe")

from hf_parity import BATCH, LR, SEQ

import paraxis
from paraxis import ParallelConfig
from paraxis.testing.parity import assert_same_weights, local_shards
from paraxis.testing.tolerance import assert_losses_close
from paraxis_hf import build_debug_model

STEPS = 20
MOE = {"capacity_factor": 0.5, "min_capacity": 0, "drop_policy": "probs"}


def train_capped(degrees, groups):
    config = ParallelConfig.from_kwargs(**degrees, moe=MOE)
    model = build_debug_model("mixtral")
    engine = paraxis.parallelize(model, config=config, train={
        "steps": STEPS, "lr": LR, "warmup_steps": 2, "seq_length": SEQ})
    assert engine.ctx.skip_verify and "capacity_factor" in engine.ctx.skip_verify
    engine.ctx.extras["expert"].set_capacity_groups(groups)
    index, count = engine.grid.sample_shard()
    part = slice(index * BATCH // count, (index + 1) * BATCH // count)
    g = torch.Generator().manual_seed(3)
    history = []
    for _ in range(STEPS):
        ids = torch.randint(0, engine.model.config.vocab_size, (BATCH, SEQ), generator=g)
        m = engine.train_step(ids[part])
        history.append((m["loss"], m["grad_norm"], m["moe/aux_loss"], m["moe/tokens_dropped"]))
    shards = local_shards(engine.model)
    engine.close()
    return history, shards


@pytest.mark.parametrize("degrees", [{"expert": 2}, {"expert": 2, "data": 2}],
                         ids=["expert2", "expert2_data2"])
def test_drops_match_one_process_with_the_same_groups(worlds, degrees):
    ranks = ParallelConfig.from_kwargs(**degrees).world_size
    ref, ref_shards = worlds.run(1, train_capped, {}, ranks)[0]
    out = worlds.run(ranks, train_capped, degrees, 1)
    assert sum(h[3] for h in ref) > 0, "capacity 0.5 should drop pairs"
    for history, _ in out:
        assert [h[3] for h in history] == [h[3] for h in ref], "drops differ"
        for i, what in enumerate(("losses", "gradient norms", "router losses")):
            assert_losses_close([h[i] for h in history], [h[i] for h in ref], what)
    assert_same_weights([s for _, s in out], ref_shards, lr=LR, steps=STEPS)

def test_groups_matter(worlds):
    """Not vacuous: one process applying capacity to the whole batch as one group drops
    other pairs (here as many, half of them, but others) and trains something else."""
    one, _ = worlds.run(1, train_capped, {}, 1)[0]
    two, _ = worlds.run(1, train_capped, {}, 2)[0]
    with pytest.raises(AssertionError):
        assert_losses_close([h[0] for h in one], [h[0] for h in two])
