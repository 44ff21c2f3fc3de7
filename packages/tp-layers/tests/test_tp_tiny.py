"""paraxis's own tiny model with a hand-written plan: tensor=2 against one process (the
first step's gradients parameter by parameter, per-step losses, final weights), and
plans that name an unknown style or a module of the wrong type fail at wrap time."""

import pytest
import torch
import torch.distributed as dist

import paraxis
from paraxis import ModelPlan, PlanError
from paraxis.models.tiny import TINY_PLAN, TinyConfig, TinyTransformer
from paraxis.testing.parity import (
    assert_same_gradients,
    assert_same_weights,
    local_gradients,
    local_shards,
)
from paraxis.testing.tolerance import assert_losses_close

CFG = TinyConfig(vocab_size=61, hidden_size=32, num_layers=2, num_heads=4,
                 intermediate_size=64, seq_length=16)
PLAN = TINY_PLAN
STEPS = 10


def train_tiny(tensor):
    torch.manual_seed(0)
    engine = paraxis.parallelize(TinyTransformer(CFG), tensor=tensor, plan=PLAN,
                                 train={"steps": STEPS, "lr": 1e-3, "warmup_steps": 2,
                                        "seq_length": CFG.seq_length})
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, CFG.vocab_size, (4, CFG.seq_length), generator=g)
               for _ in range(STEPS)]
    grads = local_gradients(engine, batches[0])
    losses = [engine.train_step(ids)["loss"] for ids in batches]
    shards = local_shards(engine.model)
    engine.close()
    return losses, shards, grads


def test_tiny_tensor_parallel_matches_one_process(worlds):
    ref_losses, ref_shards, ref_grads = worlds.run(1, train_tiny, 1)[0]
    out = worlds.run(2, train_tiny, 2)
    assert_same_gradients([g for *_, g in out], ref_grads)
    for losses, *_ in out:
        assert_losses_close(losses, ref_losses)
    assert_same_weights([s for _, s, _ in out], ref_shards, lr=1e-3, steps=STEPS)


def wrap_with(plan):
    torch.manual_seed(0)
    try:
        paraxis.parallelize(TinyTransformer(CFG), tensor=dist.get_world_size(), plan=plan)
    except PlanError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize(("entry", "message"), [
    ({"layers.*.mlp.up": "sequence_parallel"},
     "layers.0.mlp.up: tensor-parallel style 'sequence_parallel' is not supported"),
    ({"layers.*.attn_norm": "colwise"},
     "layers.0.attn_norm: style 'colwise' needs Linear, found RMSNorm"),
])
def test_bad_plans_fail_at_wrap_time_naming_module_and_style(worlds, entry, message):
    errors = worlds.run(2, wrap_with, ModelPlan("TinyTransformer", tensor=entry))
    assert all(e is not None and message in e for e in errors), errors
