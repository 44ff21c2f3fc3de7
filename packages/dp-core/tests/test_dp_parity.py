"""Data parallel against a single-process reference, on real gloo ranks.

The reference trains the same model on the whole global batch in one process; data=N
trains each rank on its 1/N slice and averages gradients. Per-step losses, every
parameter's first-step gradient on every rank (replicas equal, each parameter within the
shared one-step rule: paraxis.testing.parity.assert_same_gradients) and final parameters
must agree at the shared tolerance (paraxis.testing.tolerance).
"""

from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist

from paraxis import Grid, ParallelConfig, apply_parallelism, make_plugin_manager
from paraxis.parallel.placement import placement_of, record_replicated
from paraxis.testing.models import TinyConfig, TinyTransformer, causal_lm_loss, random_batches
from paraxis.testing.parity import assert_same_gradients
from paraxis.testing.tolerance import assert_losses_close, assert_weights_close

CFG = TinyConfig(vocab_size=96, hidden_size=32, num_layers=2, num_heads=4,
                 intermediate_size=64, seq_length=16)
STEPS, GLOBAL_BATCH, SEED, LR = 20, 8, 1234, 3e-3


def train(rank, world, microbatches, bucket_mb, ctx=None, model=None):
    """Train STEPS steps on this rank's slice; returns losses, the first step's
    gradients (by name, with their placements), params."""
    batches = random_batches(STEPS, GLOBAL_BATCH, CFG, seed=SEED)
    per = GLOBAL_BATCH // world
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    losses, first_grads, launched_early = [], None, []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        local = batches[step, rank * per:(rank + 1) * per]
        total = torch.zeros(())
        for i, mb in enumerate(local.chunk(microbatches)):
            last = i == microbatches - 1
            with nullcontext() if (last or ctx is None) else ctx.no_sync():
                loss = causal_lm_loss(model(mb), mb) / microbatches
                loss.backward()
            total += loss.detach()
        if ctx is not None:
            sync = ctx.grad_syncs[0]
            launched_early.append(sync._next)  # buckets started by hooks, before finish
            ctx.finish_grad_sync()
            dist.all_reduce(total)
            total /= world
        if step == 0:
            first_grads = {placement_of(p).name: (p.grad.clone(), placement_of(p))
                           for p in model.parameters()}
        opt.step()
        losses.append(total.item())
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return losses, first_grads, params, launched_early


def reference():
    torch.manual_seed(SEED)
    model = TinyTransformer(CFG)
    record_replicated(model)  # one process: every parameter whole, named as the ranks'
    return train(0, 1, 1, 25.0, model=model)[:3]


def dp_rank(microbatches, bucket_mb):
    rank, world = dist.get_rank(), dist.get_world_size()
    config = ParallelConfig.from_kwargs(data=world, bucket_mb=bucket_mb)
    grid = Grid.build(config)
    torch.manual_seed(SEED)
    model = TinyTransformer(CFG)
    if rank > 0:  # different initial weights: the wrap-time broadcast must fix them
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    model, ctx = apply_parallelism(model, grid=grid, config=config,
                                   plugin_manager=make_plugin_manager())
    losses, grads, params, launched = train(rank, world, microbatches, bucket_mb, ctx, model)
    n_buckets = len(ctx.grad_syncs[0].buckets)
    grid.destroy()
    # Every rank ships its gradients (replicas must agree); only rank 0 its parameters.
    return losses, grads, params if rank == 0 else None, launched, n_buckets


@pytest.fixture(scope="module")
def ref():
    return reference()


def assert_close_dicts(got, want, what, steps):
    assert got.keys() == want.keys()
    for name in want:
        assert_weights_close(got[name], want[name], lr=LR, steps=steps, what=f"{what} {name}")


@pytest.mark.parametrize(("world", "microbatches", "bucket_mb"), [
    (2, 1, 25.0),      # one bucket holds the whole model
    (2, 4, 25.0),      # gradient accumulation over 4 microbatches, sync on the last only
    (4, 1, 0.01),      # many small buckets, launched from hooks during backward
    (4, 2, 0.02),
])
def test_data_parallel_matches_single_process(worlds, ref, world, microbatches, bucket_mb):
    ref_losses, ref_grads, ref_params = ref
    out = worlds.run(world, dp_rank, microbatches, bucket_mb)
    for losses, *_ in out:  # every rank reports the same, global, loss
        assert_losses_close(losses, ref_losses)
    # Every parameter's gradient before any Adam step, from every rank.
    assert_same_gradients([o[1] for o in out], ref_grads)
    assert_close_dicts(out[0][2], ref_params, "final parameter", STEPS)
    launched, n_buckets = out[0][3], out[0][4]
    if bucket_mb < 1:
        assert n_buckets > 3
        # Every bucket started from a hook during backward, none waited for finish().
        assert launched == [n_buckets] * 20, (launched, n_buckets)
