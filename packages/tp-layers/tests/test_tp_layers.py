"""Each tensor-parallel sharding against its unsharded twin on real gloo ranks: outputs,
input gradients and weight gradients (one step's tolerance). Modules are sharded in place,
so a subclass keeps its own forward (an embedding that scales its output)."""

import copy
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from paraxis import Grid
from paraxis.parallel.placement import record_replicated
from paraxis.runtime.differentiable import all_gather, copy_to
from paraxis.testing.tolerance import assert_step_close
from paraxis_tp import (
    TensorParallelRNG,
    shard_column,
    shard_embedding,
    shard_row,
    vocab_parallel_cross_entropy,
)

close = assert_step_close  # one step's arithmetic in another order


def setup(seed=0):
    grid = Grid.build({"tensor": dist.get_world_size()})
    torch.manual_seed(seed)
    return grid, grid.group("tensor")


def own(t, g, dim):
    return t.chunk(g.size, dim=dim)[g.rank]


def twin(dense):
    """A copy of ``dense`` with placement records, to be sharded in place."""
    module = copy.deepcopy(dense)
    record_replicated(module)
    return module


class ScaledEmbedding(nn.Embedding):
    """Like Gemma's: an nn.Embedding subclass whose forward scales its output."""

    def forward(self, ids):
        return super().forward(ids) * 3.0


def column_rank(gather_output, sequence_parallel):
    grid, g = setup()
    dense = nn.Linear(8, 12)
    record_replicated(dense)
    x = torch.randn(2, 4, 8)
    w = torch.randn(2, 4, 12)
    xd = x.clone().requires_grad_()
    (dense(xd) * w).sum().backward()
    enter = (functools.partial(all_gather, group=g, dim=1, grad="sum") if sequence_parallel
             else functools.partial(copy_to, group=g))
    col = twin(dense)
    shard_column(col, g, {}, gather_output=gather_output, enter=enter)
    xp = (own(x, g, 1) if sequence_parallel else x).clone().requires_grad_()
    y = col(xp)
    if gather_output:  # every rank holds the whole output and the same loss
        close(y, dense(x), "gathered output")
        (y * w).sum().backward()
    else:
        close(y, own(dense(x), g, -1), "output slice")
        (y * own(w, g, -1)).sum().backward()
    close(xp.grad, own(xd.grad, g, 1) if sequence_parallel else xd.grad, "input grad")
    close(col.weight.grad, own(dense.weight.grad, g, 0), "weight grad")
    close(col.bias.grad, own(dense.bias.grad, g, 0), "bias grad")
    grid.destroy()
    return True


def row_rank(split_input, sequence_parallel):
    grid, g = setup()
    dense = nn.Linear(12, 8)
    record_replicated(dense)
    x, w = torch.randn(2, 4, 12), torch.randn(2, 4, 8)
    xd = x.clone().requires_grad_()
    (dense(xd) * w).sum().backward()
    row = twin(dense)
    shard_row(row, g, {}, split_input=split_input, sequence_parallel=sequence_parallel)
    xp = (x if split_input else own(x, g, -1)).clone().requires_grad_()
    y = row(xp)
    if sequence_parallel:
        close(y, own(dense(x), g, 1), "sequence shard of output")
        (y * own(w, g, 1)).sum().backward()
        # The bias is added to this rank's tokens only: a partial gradient, summed over
        # the group by the strategy's PartialGradSync.
        close(row.bias.grad, own(w, g, 1).sum(dim=(0, 1)), "bias grad (partial)")
    else:
        close(y, dense(x), "output")
        (y * w).sum().backward()
        close(row.bias.grad, dense.bias.grad, "bias grad")
    want_x = xd.grad if split_input else own(xd.grad, g, -1)
    close(xp.grad, want_x, "input grad")
    close(row.weight.grad, own(dense.weight.grad, g, 1), "weight grad")
    grid.destroy()
    return True


def embedding_and_loss_rank(kind):
    grid, g = setup()
    vocab = 11  # not a multiple of the tensor degree: padded
    emb = kind(vocab, 6, padding_idx=7)  # the pad row must get no gradient
    ids = torch.randint(0, vocab, (3, 5))
    ids[0, 0] = 7
    (emb(ids) ** 2).sum().backward()
    par = twin(emb)
    shard_embedding(par, g, {}, padded=-(-vocab // g.size) * g.size)
    assert type(par) is kind  # the module keeps its class, hence its forward
    out = par(ids)
    close(out, emb(ids), "embedding output")
    (out ** 2).sum().backward()
    per = par.weight.shape[0]
    real = max(0, min(per, vocab - g.rank * per))
    close(par.weight.grad[:real], emb.weight.grad[g.rank * per:g.rank * per + real],
          "embedding grad")
    assert torch.count_nonzero(par.weight.grad[real:]) == 0  # padding never used
    assert torch.count_nonzero(emb.weight.grad[7]) == 0 and (ids == 7).any()

    logits = torch.randn(7, vocab, requires_grad=True)
    target = torch.randint(0, vocab, (7,))
    target[2] = -100
    ref = F.cross_entropy(logits, target, reduction="none", ignore_index=-100)
    ref.sum().backward()
    local = torch.zeros(7, per)
    local[:, :real] = logits.detach()[:, g.rank * per:g.rank * per + real]
    local.requires_grad_()
    loss = vocab_parallel_cross_entropy(local, target, start=g.rank * per, vocab=vocab,
                                        group=g)
    close(loss, ref.detach(), "per-token loss")
    loss.sum().backward()
    close(local.grad[:, :real], logits.grad[:, g.rank * per:g.rank * per + real],
          "logit grad")
    assert torch.count_nonzero(local.grad[:, real:]) == 0
    grid.destroy()
    return True


def rng_rank():
    grid, g = setup(seed=5)
    rng = TensorParallelRNG(seed=5, tensor_rank=g.rank)
    shared = torch.rand(16)
    rng.enter()
    split = torch.rand(16)
    state = rng.get_state()
    again = torch.rand(16)
    rng.exit()
    after = torch.rand(16)
    rng.set_state(state)
    rng.enter()
    replay = torch.rand(16)
    rng.exit()
    out = [torch.empty(16 * 3) for _ in range(g.size)]
    dist.all_gather(out, torch.cat([shared, split, after]), group=g.pg)
    grid.destroy()
    return [o.view(3, 16) for o in out], torch.equal(again, replay)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize(("gather_output", "sequence_parallel"),
                         [(False, False), (True, False), (False, True)])
def test_column_parallel_linear(worlds, world, gather_output, sequence_parallel):
    assert all(worlds.run(world, column_rank, gather_output, sequence_parallel))


@pytest.mark.parametrize(("split_input", "sequence_parallel"),
                         [(False, False), (True, False), (False, True)])
def test_row_parallel_linear(worlds, split_input, sequence_parallel):
    assert all(worlds.run(2, row_rank, split_input, sequence_parallel))


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("kind", [nn.Embedding, ScaledEmbedding])
def test_vocab_parallel_embedding_and_cross_entropy_with_padding(worlds, world, kind):
    assert all(worlds.run(world, embedding_and_loss_rank, kind))


def test_dropout_rng_same_outside_different_inside_and_restorable(worlds):
    results = worlds.run(2, rng_rank)
    r0, r1 = results[0][0]  # what each rank drew, gathered
    assert torch.equal(r0[0], r1[0]), "replicated activations need identical masks"
    assert not torch.equal(r0[1], r1[1]), "split activations need different masks"
    assert torch.equal(r0[2], r1[2]), "leaving the region restores the shared stream"
    assert all(replayed for _, replayed in results)
