"""The local experts' grouped form: paraxis's padded batched matmul equals the family's
own loop (outputs and every gradient, fp64: biases, transposed weights, GPT-OSS's clamped
gate, DeepSeek-V3's shared-expert family); which kernel runs where; and expert=2 in fp64
with the model's default ``grouped_mm`` (no torch kernel for fp64: the padded form runs)
against the unsharded block run with the loop."""

import copy

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")

from moe_tiny_models import HIDDEN, build, shares

from paraxis.parallel.placement import record_replicated
from paraxis.runtime.grid import Grid
from paraxis.testing.tolerance import FP64_RTOL
from paraxis_moe import ExpertParallel
from paraxis_moe import grouped as grouped_module
from paraxis_moe.grouped import local_kernel, padded_bmm_forward

F64 = torch.float64


def _experts(family, implementation):
    model = build(family, num_key_value_heads=4).to(F64)
    model.set_experts_implementation(implementation)
    return model.model.layers[0].mlp.experts


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss", "deepseek_v3", "qwen2_moe"])
def test_padded_bmm_is_the_models_loop(family):
    experts = _experts(family, "eager")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(13, HIDDEN, generator=g, dtype=F64, requires_grad=True)
    index = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(13)])
    index[:, 0] = 0  # a busy expert: the others are padded
    weights = torch.rand(13, 2, generator=g, dtype=F64, requires_grad=True)
    inputs = [x, weights, *experts.parameters()]
    want = experts(x, index, weights)
    want_grads = torch.autograd.grad(want.square().sum(), inputs)
    got = padded_bmm_forward(experts, x, index, weights)
    grads = torch.autograd.grad(got.square().sum(), inputs)
    torch.testing.assert_close(got, want, rtol=FP64_RTOL, atol=FP64_RTOL)
    for a, b in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=FP64_RTOL, atol=FP64_RTOL * float(b.abs().max()))


def test_which_kernel_runs_where(monkeypatch):
    assert local_kernel(_experts("mixtral", "grouped_mm").float()) == "model"
    assert local_kernel(_experts("mixtral", "grouped_mm")) == "padded_bmm"  # fp64
    assert local_kernel(_experts("mixtral", "eager")) == "model"  # the model's choice
    monkeypatch.setitem(grouped_module.GROUPED_DEFAULT, ("cpu", torch.float32), False)
    assert local_kernel(_experts("mixtral", "grouped_mm").float()) == "eager"


def fp64_grouped_parity():
    n, r = dist.get_world_size(), dist.get_rank()
    grid = Grid.build({"expert": n})
    model = build("mixtral").to(F64)  # transformers' default: grouped_mm
    record_replicated(model)
    ref = copy.deepcopy(model)
    ref.set_experts_implementation("eager")
    ExpertParallel(model, ["model.layers.0.mlp"], grid.group("expert"),
                   token_group=grid.group("expert"))
    block, ref_block = model.model.layers[0].mlp, ref.model.layers[0].mlp
    assert local_kernel(block.experts) == "padded_bmm"
    xs = shares(n, (2, 6, HIDDEN), 1, F64)
    want = ref_block(torch.cat(xs))
    want = want[0] if isinstance(want, tuple) else want
    want.square().sum().backward()
    got = block(xs[r].clone())
    got = got[0] if isinstance(got, tuple) else got
    got.square().sum().backward()
    torch.testing.assert_close(got, want[r * 2:(r + 1) * 2], rtol=FP64_RTOL, atol=FP64_RTOL)
    mine = block.experts.gate_up_proj.grad
    first = r * mine.shape[0]
    full = ref_block.experts.gate_up_proj.grad[first:first + mine.shape[0]]
    torch.testing.assert_close(mine, full, rtol=FP64_RTOL, atol=FP64_RTOL * float(full.abs().max()))
    grid.destroy()


def test_expert_parallel_fp64_runs_grouped_as_the_loop(worlds):
    worlds.run(2, fp64_grouped_parity)
