"""The deferred weight gradients of a split backward (:mod:`paraxis_pp.deferred`): I then
W gives the whole backward's gradients, on the parameters themselves (recomputed blocks
too), in fp32 and under bf16 autocast; a stage with another trainable matrix keeps
torch's split; the executor defers on every chunk that splits."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

import paraxis
from paraxis.models.tiny import TinyConfig, TinyTransformer
from paraxis.testing.tolerance import assert_gradients_close
from paraxis_pp.deferred import DeferredWeights, uninstall_deferred

CFG = TinyConfig(vocab_size=61, hidden_size=32, num_layers=2, num_heads=4,
                 intermediate_size=64, seq_length=16)


class _Stage(nn.Module):
    """A middle stage of the tiny model: its blocks (one recomputed when asked), a
    biased projection and the final norm."""

    def __init__(self, recompute: bool):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = TinyTransformer(CFG).layers
        self.proj = nn.Linear(CFG.hidden_size, CFG.hidden_size)
        self.norm = nn.RMSNorm(CFG.hidden_size)
        self.recompute = recompute

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            x = checkpoint(block, x, use_reentrant=False) if self.recompute and i == 0 \
                else block(x)
        return self.norm(self.proj(x))


def _grads(stage: nn.Module, store: DeferredWeights | None, dtype: torch.dtype | None):
    """One microbatch's gradients: the whole backward (no ``store``) or I then W."""
    torch.manual_seed(1)
    x = torch.randn(2, CFG.seq_length, CFG.hidden_size, requires_grad=True)
    g = torch.randn(2, CFG.seq_length, CFG.hidden_size)
    with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        out = stage(x)
    if store is None:
        out.backward(g)
        return x.grad, {n: p.grad for n, p in stage.named_parameters()}, None
    taken = store.backward_input([out], [g])
    before = {n: p.grad for n, p in stage.named_parameters()}
    DeferredWeights.weight(taken)
    return x.grad, {n: p.grad for n, p in stage.named_parameters()}, before


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "recomputed"])
def test_input_then_weight_gives_the_whole_backward(dtype, recompute):
    stage = _Stage(recompute)
    x_ref, ref, _ = _grads(copy.deepcopy(stage), None, dtype)
    x_grad, grads, after_input = _grads(stage, DeferredWeights.install(stage), dtype)
    params = dict(stage.named_parameters())
    assert torch.equal(x_grad, x_ref)
    linear = {f"{n}.weight" for n, m in stage.named_modules() if isinstance(m, nn.Linear)}
    assert len(linear) == 9
    for name, grad in grads.items():
        # I left every linear weight to W and gave the rest (norms, the bias) at once
        assert (after_input[name] is None) == (name in linear), name
        assert grad is not None and grad.dtype == torch.float32, name
        assert grad.grad_fn is None and not grad.requires_grad, name  # W is not recorded
        # laid out as the weight, as autograd's own (a transposed gradient slows every
        # accumulation and optimizer step after it)
        assert grad.stride() == params[name].stride(), name
        assert torch.equal(grad, ref[name]), name


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_microbatches_accumulate_as_the_whole_backward_does(dtype):
    """A second microbatch's weight gradient is summed into the first's (in the GEMM
    itself for fp32), as autograd accumulates them: the same fp32 terms summed in
    another order, so within the shared reduction tolerance (a lost or doubled
    microbatch is a relative error of 1/2 or 1)."""
    stage = _Stage(recompute=False)
    reference = copy.deepcopy(stage)
    store = DeferredWeights.install(stage)
    for _ in range(2):
        _grads(reference, None, dtype)
        _grads(stage, store, dtype)
    got = {name: p.grad for name, p in stage.named_parameters()}
    assert_gradients_close(got, {n: p.grad for n, p in reference.named_parameters()})
    assert all(g.grad_fn is None for g in got.values())


def test_a_stage_with_another_matrix_keeps_torchs_split():
    class Conv1D(nn.Module):  # GPT-2's projection: a matrix, not an nn.Linear
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(4, 4))

        def forward(self, x):
            return x @ self.weight

    assert DeferredWeights.install(nn.Sequential(nn.Linear(4, 4), Conv1D())) is None
    frozen = nn.Sequential(nn.Linear(4, 4), Conv1D())
    frozen[1].weight.requires_grad_(False)  # a frozen matrix has no weight gradient
    assert DeferredWeights.install(frozen) is not None
    stage = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 4))
    assert DeferredWeights.install(stage) is not None
    uninstall_deferred(stage)
    assert "forward" not in vars(stage[1])


FOUR_LAYERS = TinyConfig(vocab_size=61, hidden_size=32, num_layers=4, num_heads=4,
                         intermediate_size=64, seq_length=16)


def _deferred_chunks(schedule: str, chunks: int, positions: bool):
    torch.manual_seed(0)
    model = TinyTransformer(FOUR_LAYERS)
    model.embed.positions.requires_grad_(positions)
    engine = paraxis.parallelize(model, pipeline=2, microbatches=4,
                                 pipeline_schedule=schedule, virtual_stages=chunks,
                                 train={"steps": 2, "lr": 1e-3, "seq_length": CFG.seq_length})
    runner = engine.ctx.forward_backward
    out = [(runner.schedule.stage(dist.get_rank(), c), d is not None)
           for c, d in enumerate(runner.deferred)]
    engine.close()
    return out


@pytest.mark.parametrize(("schedule", "chunks", "positions", "expected"), [
    # Stage 0 too (its W sums the microbatches in the GEMM), unless it trains a matrix
    # no GEMM defers (the tiny model's learned position table: torch's split there).
    ("zbv", 2, False, [[(0, True), (3, True)], [(1, True), (2, True)]]),
    ("zbv", 2, True, [[(0, False), (3, True)], [(1, True), (2, True)]]),
    ("zero_bubble_h1", 1, False, [[(0, True)], [(1, True)]]),
    ("zero_bubble_h1", 1, True, [[(0, False)], [(1, True)]]),
    # 1F1B splits nothing
    ("1f1b", 1, False, [[(0, False)], [(1, False)]]),
])
def test_the_runner_defers_on_every_split_chunk(worlds, schedule, chunks, positions,
                                                expected):
    assert worlds.run(2, _deferred_chunks, schedule, chunks, positions) == expected
