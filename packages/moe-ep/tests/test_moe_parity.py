"""One MoE block of tiny Mixtral, Qwen2-MoE, Qwen3-MoE, GPT-OSS and DeepSeek-V3 with its
experts sharded over expert=2 and expert=4 gloo ranks, each rank holding its own tokens,
against the unsharded block run in one process on every rank's tokens concatenated: outputs, input
gradients and the gradient of every parameter (expert shards gathered, replicated ones
summed over ranks), dropless and with capacity; and the dispatch bytes."""

import copy

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")

from moe_tiny_models import HIDDEN, NUM_EXPERTS, TOP_K, build, shares

from paraxis.parallel.placement import Shard, placement_of, record_replicated
from paraxis.runtime.grid import Grid
from paraxis.testing.tolerance import assert_step_close
from paraxis_moe import ExpertParallel, MoEConfig, expert_capacity, keep_mask

BLOCK = "model.layers.0.mlp"
B, S = 2, 6  # tokens per rank: 12
# Sums over tokens are reordered (per rank, then over ranks), so errors scale with the
# summands: tolerance rtol elementwise plus rtol x the tensor's largest entry. fp32 with
# transformers' grouped_mm: DESIGN's 1e-5; fp64 (eager experts, grouped_mm has no fp64).
RTOL = {torch.float32: 1e-5, torch.float64: 1e-10}


def _close(got, want, rtol, what):
    got, want = got.detach(), want.detach()
    torch.testing.assert_close(got, want, rtol=rtol, atol=rtol * float(want.abs().max()),
                               msg=lambda m: f"{what}: {m}")
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def _out(y):
    return y[0] if isinstance(y, tuple) else y


def _cap_reference(experts, n, tokens, moe):
    """The unsharded experts, dropping per rank's group of tokens as each rank does."""
    forward = experts.forward

    def capped(hidden, index, weights):
        cap = expert_capacity(tokens, TOP_K, NUM_EXPERTS, moe.capacity_factor, moe.min_capacity)
        keep = torch.cat([keep_mask(index[i * tokens:(i + 1) * tokens],
                                    weights[i * tokens:(i + 1) * tokens], NUM_EXPERTS, cap,
                                    moe.drop_policy) for i in range(n)])
        capped.dropped = [int((~k).sum()) for k in keep.split(tokens)]
        return forward(hidden, index, weights.masked_fill(~keep, 0.0))

    experts.forward = capped
    return capped


def block_parity(family, capacity_factor, policy, implementation, dtype, chunks=1):
    n, r = dist.get_world_size(), dist.get_rank()
    grid = Grid.build({"expert": n})
    group = grid.group("expert")
    model = build(family).to(dtype)
    model.set_experts_implementation(implementation)
    record_replicated(model)
    ref = copy.deepcopy(model)
    moe = MoEConfig(capacity_factor=capacity_factor, drop_policy=policy, min_capacity=0,
                    dispatch_chunks=chunks)
    ep = ExpertParallel(model, [BLOCK], group, moe=moe, token_group=group)
    block, ref_block = model.get_submodule(BLOCK), ref.get_submodule(BLOCK)
    capped = None
    if capacity_factor is not None:
        capped = _cap_reference(ref_block.experts, n, B * S, moe)

    xs, ups = shares(n, (B, S, HIDDEN), 1, dtype), shares(n, (B, S, HIDDEN), 2, dtype)
    big = torch.cat(xs).requires_grad_(True)
    want = _out(ref_block(big))
    (want * torch.cat(ups)).sum().backward()
    x = xs[r].clone().requires_grad_(True)
    got = _out(block(x))
    (got * ups[r]).sum().backward()

    rtol, mine = RTOL[dtype], slice(r * B, (r + 1) * B)
    err = {"output": _close(got, want[mine], rtol, "output"),
           "input_grad": _close(x.grad, big.grad[mine], rtol, "input gradient")}
    for name, p in block.named_parameters():
        expected = ref_block.get_parameter(name).grad
        record = placement_of(p)
        if record.shards:
            assert record.shards == (Shard(0, "expert", r * NUM_EXPERTS // n, NUM_EXPERTS // n),)
            assert record.global_shape == tuple(expected.shape)
            assert "expert" not in record.replicated
            parts = [torch.empty_like(p.grad) for _ in range(n)]
            dist.all_gather(parts, p.grad.contiguous())
            grad = torch.cat(parts)
        else:
            grad = p.grad.clone()
            dist.all_reduce(grad)
        err[name] = _close(grad, expected, rtol, name)
    values = ep.stats.layers[BLOCK].values
    dropped = int(values["dropped"].sum())
    assert int(values["assigned"].sum()) == B * S * TOP_K
    assert dropped == (capped.dropped[r] if capped else 0)
    assert int(values["accepted"].sum()) == B * S * TOP_K - dropped
    grid.destroy()
    return err, dropped


F32, F64 = torch.float32, torch.float64
CASES = [
    ("mixtral", None, "probs", "grouped_mm", F32),
    ("mixtral", None, "probs", "eager", F64),
    ("qwen2_moe", None, "probs", "grouped_mm", F32),
    ("qwen2_moe", None, "probs", "eager", F64),
    ("qwen3_moe", None, "probs", "grouped_mm", F32),
    ("qwen3_moe", None, "probs", "eager", F64),
    ("mixtral", 0.5, "probs", "grouped_mm", F32),
    ("qwen2_moe", 0.5, "probs", "eager", F64),
    ("qwen3_moe", 0.75, "position", "grouped_mm", F32),
    ("gpt_oss", None, "probs", "grouped_mm", F32),
    ("gpt_oss", 0.5, "position", "eager", F64),
    ("deepseek_v3", None, "probs", "grouped_mm", F32),
    ("deepseek_v3", 0.75, "probs", "eager", F32),  # its router computes in fp32 always
]


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize(("family", "capacity", "policy", "implementation", "dtype"), CASES)
def test_block_matches_unsharded(worlds, n, family, capacity, policy, implementation, dtype):
    out = worlds.run(n, block_parity, family, capacity, policy, implementation, dtype)
    worst = max(max(err.values()) for err, _ in out)
    print(f"{family} ep={n} capacity={capacity} {policy} {implementation} {dtype}: max error "
          f"/ max|ref| {worst:.1e}, dropped per rank {[d for _, d in out]}")
    if capacity is not None:
        assert sum(d for _, d in out) > 0, "the capacity case should drop something"


def dispatch_bytes():
    """Balanced routing: every expert gets T*k/E pairs from every rank."""
    n = dist.get_world_size()
    grid = Grid.build({"expert": n})
    model = build("mixtral")
    ep = ExpertParallel(model, [BLOCK], grid.group("expert"), token_group=grid.group("expert"))
    experts = model.get_submodule(BLOCK).experts
    tokens = 16
    index = torch.stack([(torch.arange(tokens) + j) % NUM_EXPERTS for j in range(TOP_K)], -1)
    hidden = torch.randn(tokens, HIDDEN, requires_grad=True)
    key = ("expert", "all_to_all")
    before = grid.comm.bytes.get(key, 0.0)
    y = experts(hidden, index, torch.full((tokens, TOP_K), 0.5))
    comm_fwd = grid.comm.bytes[key] - before
    stats = ep.stats.layers[BLOCK].values
    fwd = float(stats["dispatch_bytes"])
    per_expert_fwd = float(stats["bytes_per_expert"].sum())
    y.square().sum().backward()
    out = {"fwd": fwd, "per_expert_fwd": per_expert_fwd, "comm_fwd": comm_fwd,
           "total": float(stats["dispatch_bytes"]), "comm_total": grid.comm.bytes[key] - before,
           "dispatch_s": float(stats["dispatch_s"]),
           "compute_s": float(stats["expert_compute_s"])}
    grid.destroy()
    return out


@pytest.mark.parametrize("n", [2, 4])
def test_dispatch_bytes_match_formula(worlds, n):
    """Per rank, one all-to-all pair (dispatch + combine, forward) moves
    2*T*k*h*(ep-1)/ep elements under balanced routing (= (E-1)/E at ep = E): what is
    sent to other ranks, core's convention. Backward moves the same again. The counts
    exchange adds (ep-1)*(E/ep) int64 per forward, in core's counters only."""
    tokens, elt = 16, 4
    pair = 2 * tokens * TOP_K * HIDDEN * (n - 1) / n * elt
    counts = (n - 1) * (NUM_EXPERTS // n) * 8
    for rank in worlds.run(n, dispatch_bytes):
        assert rank["fwd"] == pair == rank["per_expert_fwd"]
        assert rank["comm_fwd"] == pair + counts
        assert rank["total"] == 2 * pair
        assert rank["comm_total"] == 2 * pair + counts
        assert rank["dispatch_s"] > 0 and rank["compute_s"] > 0
    print(f"ep={n}: {pair:.0f} bytes per rank per forward pair (formula {pair:.0f})")


def idle_ranks(implementation, chunks=1):
    """Every token picks experts 0 and 1: the ranks owning neither receive no rows, yet
    must join backward's mirrored exchanges; their experts get zero gradients."""
    n, r = dist.get_world_size(), dist.get_rank()
    grid = Grid.build({"expert": n})
    model = build("mixtral")
    model.set_experts_implementation(implementation)
    ref = copy.deepcopy(model).get_submodule(BLOCK).experts
    ExpertParallel(model, [BLOCK], grid.group("expert"), token_group=grid.group("expert"),
                   moe=MoEConfig(dispatch_chunks=chunks))
    experts = model.get_submodule(BLOCK).experts
    index = torch.tensor([[0, 1]] * 8)
    weights = torch.full((8, 2), 0.5)
    hidden = torch.randn(8, HIDDEN, generator=torch.Generator().manual_seed(r))
    want = ref(hidden, index, weights)
    x = hidden.clone().requires_grad_(True)
    got = experts(x, index, weights)
    got.square().sum().backward()
    assert_step_close(got, want, "expert outputs")
    idle = r * NUM_EXPERTS // n >= 2
    grads = [p.grad for p in experts.parameters()]
    assert all(g is not None for g in grads)
    assert all(bool((g == 0).all()) == idle for g in grads)
    grid.destroy()
    return idle


@pytest.mark.parametrize("implementation", ["grouped_mm", "eager"])
def test_ranks_without_tokens_still_join_backward(worlds, implementation):
    assert worlds.run(4, idle_ranks, implementation) == [False, False, True, True]
