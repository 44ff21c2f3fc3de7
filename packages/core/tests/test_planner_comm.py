"""Bytes per axis and the link each axis crosses, without processes."""

import itertools

import pytest

from paraxis.planner.comm import communication, link_of
from paraxis.planner.evaluate import make_layout
from paraxis.planner.inputs import Workload
from paraxis.planner.model import LayerCount, ModelCounts
from paraxis.runtime.grid import GridLayout

H, A, LAYERS, V = 1024, 16, 8, 32000


def counts(experts: int = 0, kv: int = A) -> ModelCounts:
    layer = LayerCount(matrices=12 * H * H, vectors=4 * H, experts=experts * 8 * H * H)
    return ModelCounts(family="gpt", embedding=V * H, layers=(layer,) * LAYERS, final=H,
                       head=V * H, tied=False, non_embedding=0, hidden_size=H,
                       num_heads=A, kv_heads=kv, head_dim=H // A, vocab_size=V,
                       num_experts=experts, top_k=2 if experts else 1)


def comm(degrees, options=None, *, work=None, c=None, node=8, dense=1e9, expert=0.0):
    work = work or Workload(seq=2048, global_batch=64, micro_batch=1)
    layout = make_layout(degrees, options or {}, work)
    out = communication(c or counts(), layout, work, gpus_per_node=node,
                        dense_grad_params=dense, expert_grad_params=expert)
    return {a.axis: a for a in out}, layout.schedule.microbatches


@pytest.mark.parametrize("degrees", [
    {"data": 2, "tensor": 4}, {"data": 4, "tensor": 4}, {"pipeline": 2, "data": 2, "tensor": 4},
    {"data": 2, "expert": 2, "context": 2, "tensor": 2}, {"data": 8, "context": 2},
    {"pipeline": 4, "tensor": 2}, {"data": 3, "tensor": 2},
])
def test_link_matches_the_rank_layout(degrees):
    layout = GridLayout(degrees)
    for node, axes in itertools.product((4, 8), [("tensor",), ("data",), ("pipeline",),
                                                  ("context",), ("data", "context"),
                                                  ("data", "expert", "context")]):
        brute = "intra" if all(len({r // node for r in g}) == 1
                               for g in layout.group_ranks(axes)) else "inter"
        assert link_of(layout.degrees, axes, node) == brute, (degrees, node, axes)


def test_data_parallel_is_2psi_n_minus_1_over_n_and_zero3_gathers_per_microbatch():
    axes, _ = comm({"data": 8})
    assert axes["data"].bytes == pytest.approx(2 * 1e9 * 2 * 7 / 8)  # 2 bytes x 2Ψ(N-1)/N
    assert axes["data"].collective == "all-reduce" and axes["data"].link == "intra"
    work = Workload(seq=2048, global_batch=8, micro_batch=1)
    axes, m = comm({"data": 8}, {"zero": 3}, work=work)
    assert m == 1 and axes["data"].bytes == pytest.approx(3 * 1e9 * 2 * 7 / 8)  # ZeRO §7
    axes, m = comm({"data": 8}, {"zero": 3})
    assert axes["data"].bytes == pytest.approx((2 * m + 1) * 1e9 * 2 * 7 / 8)


def test_tensor_is_8bsh_t_minus_1_over_t_per_layer_and_microbatch():
    ring, sbh = 3 / 4, 2048 * H * 2
    for sp in (False, True):
        axes, m = comm({"tensor": 4}, {"sequence_parallel": sp})
        layers = 8 * sbh * ring * LAYERS * m  # 4 all-reduces x 2(t-1)/t, Megatron's
        # The vocabulary-parallel ends (measured, docs/plan-accuracy.md): the embedding's
        # all-reduce, the head's input (all-gathered too under SP), the loss's 3 fp32
        # values per token; under SP the norms' partial gradients once per step.
        ends = ((2 + (3 if sp else 2)) * sbh * ring + 3 * 2 * 2048 * 4 * ring) * m
        norms = 2 * (4 * H * LAYERS + H) * 2 * ring if sp else 0
        assert axes["tensor"].bytes == pytest.approx(layers + ends + norms)
    axes, m = comm({"tensor": 4}, {"activation_checkpointing": "full"})
    ends = (4 * sbh * ring + 3 * 2 * 2048 * 4 * ring) * m
    assert axes["tensor"].bytes == pytest.approx(1.5 * layers + ends)  # forward replayed


def test_pipeline_is_bsh_per_boundary_per_microbatch_each_way():
    axes, m = comm({"pipeline": 4})
    # A middle stage sends an activation forward and a gradient backward per microbatch.
    assert axes["pipeline"].bytes == pytest.approx(2 * m * 2048 * H * 2)
    axes, m = comm({"pipeline": 2, "tensor": 2}, {"sequence_parallel": True})
    assert axes["pipeline"].bytes == pytest.approx(m * 2048 * H * 2 / 2)
    assert axes["pipeline"].link == "intra"  # 4 ranks in one node of 8


def test_expert_all_to_all_volume():
    axes, m = comm({"data": 2, "expert": 4}, c=counts(experts=8))
    tokens = 2048
    assert axes["expert"].bytes == pytest.approx(2 * 2 * tokens * 2 * H * 3 / 4 * 2 * LAYERS * m)


def test_context_ulysses_and_ring_volumes():
    work = Workload(seq=4096, global_batch=8, micro_batch=1)
    axes, m = comm({"context": 4}, {"context_mode": "ulysses"}, work=work, c=counts(kv=4))
    kv = 4 * (H // A)
    per_layer = 2 * (2 * H + 2 * kv) * 4096 / 4 * 3 / 4  # forward and backward
    assert axes["context"].bytes == pytest.approx(per_layer * 2 * LAYERS * m)
    axes, m = comm({"context": 4}, {"context_mode": "ring"}, work=work, c=counts(kv=4))
    assert axes["context"].bytes == pytest.approx(3 * 2 * 4096 * kv * 3 / 4 * 2 * LAYERS * m)
    assert axes["context"].overlap.startswith("yes")
