"""Expert tensor parallelism (``parallelism.expert_tensor``, Megatron-Core's ETP): each
expert's FFN split column/row-wise over the tensor group, on Mixtral (fused experts)
trained through ``parallelize`` against one process (tests/hf_parity.py): the first
step's gradients parameter by parameter, per-step losses, gradient norms and router
losses, the evaluation loss and the final weights, at the shared tolerance.

Under sequence parallelism the rows each rank's experts received are all-gathered over
the tensor group and the partial outputs reduce-scattered back; without it the input
enters by Megatron's f and the output leaves by g (all-reduce).
"""

import pytest

pytest.importorskip("transformers")
pytest.importorskip("paraxis_moe")

from hf_parity import LR, compare

LAYOUTS = {
    "expert2_tensor2_sp": ({"expert": 2, "tensor": 2}, True),
    "tensor2_sp": ({"tensor": 2}, True),
    "tensor2": ({"tensor": 2}, False),
    "data2_tensor2_sp": ({"data": 2, "tensor": 2}, True),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_split_experts_match_one_process(worlds, layout):
    degrees, sp = LAYOUTS[layout]
    out = compare(worlds, "mixtral", degrees, steps=6, expert_tensor=2, sequence_parallel=sp)
    assert all(h[2] > 0 for h in out[0][0]), "the router loss is trained every step"


# A shared expert follows the dense tensor plan (a column/row-split MLP of its own);
# only the routed experts take the expert-tensor split.
@pytest.mark.parametrize("sp", [True, False], ids=["sp", "no_sp"])
def test_split_experts_beside_a_shared_expert(worlds, sp):
    compare(worlds, "qwen2_moe", {"tensor": 2}, steps=6, expert_tensor=2, sequence_parallel=sp)


# With a capacity, the rows go through the dispatch even at expert degree 1; without
# sequence parallelism every tensor rank drops the same pairs, so one process applying
# the capacity per expert rank's tokens drops them too (tests/test_moe_capacity.py).
@pytest.mark.parametrize("degrees", [{"tensor": 2}, {"expert": 2, "tensor": 2}],
                         ids=["tensor2", "expert2_tensor2"])
def test_split_experts_with_a_capacity_drop_as_one_process(worlds, degrees):
    from test_moe_capacity import train_capped

    from paraxis.testing.parity import assert_same_weights
    from paraxis.testing.tolerance import assert_losses_close

    groups = degrees.get("expert", 1)
    ref, ref_shards = worlds.run(1, train_capped, {}, groups)[0]
    out = worlds.run(2 * groups, train_capped, {**degrees, "expert_tensor": 2}, 1)
    assert sum(h[3] for h in ref) > 0, "capacity 0.5 should drop pairs"
    for history, _ in out:
        assert [h[3] for h in history] == [h[3] for h in ref], "drops differ"
        for i, what in enumerate(("losses", "gradient norms", "router losses")):
            assert_losses_close([h[i] for h in history], [h[i] for h in ref], what)
    assert_same_weights([s for _, s in out], ref_shards, lr=LR, steps=20)


def expert_bytes(expert_tensor):
    """This rank's expert parameter bytes under tensor 2 + SP, and the coverage matrix's
    shard proof of the layout (paraxis_coverage.checks)."""
    import paraxis
    from paraxis import ParallelConfig
    from paraxis_coverage.cells import Check
    from paraxis_coverage.checks import shard_proof
    from paraxis_coverage.shares import proven
    from paraxis_hf import build_debug_model

    kwargs = {"tensor": 2, "sequence_parallel": True, "expert_tensor": expert_tensor}
    model = build_debug_model("mixtral")
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    engine = paraxis.parallelize(model, config=ParallelConfig.from_kwargs(**kwargs),
                                 train={"steps": 1, "lr": 1e-3, "seq_length": 16})
    held = sum(p.numel() * p.element_size() for n, p in engine.model.named_parameters()
               if ".experts." in n)
    proof = shard_proof(engine, whole)
    engine.close()
    return held, proven(Check("tensor=2 SP", kwargs, "tensor"), [{"proof": proof}]).cell()


def test_split_experts_halve_each_ranks_expert_bytes(worlds):
    whole = worlds.run(2, expert_bytes, 1)
    split = worlds.run(2, expert_bytes, 2)
    for (held, cell), (halved, split_cell) in zip(whole, split, strict=True):
        assert halved * 2 == held, (held, halved)
        assert "replicated over tensor" in cell and split_cell.startswith("pass"), cell
        assert "expert tensors sharded over tensor" in split_cell, split_cell


def test_unsupported_expert_tensor_layouts_are_refused():
    from paraxis import ParallelConfig
    from paraxis.config.rules import check
    from paraxis.config.shape import ModelShape
    from paraxis_moe.config import moe_problems

    def problems(**kwargs):
        config = ParallelConfig.from_kwargs(**kwargs)
        shape = ModelShape(hidden_size=64, num_attention_heads=4, num_layers=2,
                           vocab_size=128, intermediate_size=96, num_experts=4)
        found = check(config)
        return [p for p in found + moe_problems(config, shape, found)
                if p.field == "parallelism.expert_tensor"]

    assert not problems(tensor=4, expert_tensor=4)
    assert "must divide the tensor degree 4" in problems(tensor=4, expert_tensor=3)[0].rule
    assert "sub-group" in problems(tensor=4, expert_tensor=2)[0].rule
    # Run at parity beside them (test_split_experts_beside_other_axes_match_one_process).
    assert not problems(tensor=2, expert_tensor=2, data=2, zero=1)
    assert not problems(tensor=2, expert_tensor=2, pipeline=2)
    assert not problems(tensor=2, expert_tensor=2, context=2)


def test_experts_the_split_cannot_hold_are_refused_before_any_group():
    from paraxis import ParallelConfig
    from paraxis.config.errors import ConfigError
    from paraxis.config.run import TrainSection
    from paraxis.engine.apply import preflight
    from paraxis_hf import build_debug_model

    # Qwen3-MoE's experts have their own width (moe_intermediate_size), which the dense
    # tensor rules do not check.
    model = build_debug_model("qwen3_moe", moe_intermediate_size=33)
    config = ParallelConfig.from_kwargs(tensor=2, expert_tensor=2)
    with pytest.raises(ConfigError, match="expert FFN width 33 is not divisible by "
                                          "expert_tensor 2"):
        preflight(model, config, train=TrainSection(seq_length=8), world_size=2)


def test_the_plan_matches_split_experts_measured(worlds):
    """``paraxis plan``'s bytes against one real step (paraxis.planner.accuracy): model
    state, the tensor group's bytes (dense plus the split experts' all-gather and
    reduce-scatter, or all-reduce without SP) within 2%, activations within the bound."""
    from paraxis.planner.accuracy import BOUND, CASES, run

    cases = [c for c in CASES if c.name in ("tp2-sp-etp2-mixtral", "tp2-etp2-mixtral")]
    rows = run(cases, worlds)
    assert {r.case for r in rows} == {c.name for c in cases}
    for r in rows:
        bound = BOUND if r.quantity.startswith("activations") else 0.02
        assert r.error <= bound, (r.case, r.quantity, r.planned, r.measured)
    assert any(r.quantity == "tensor bytes" for r in rows)


# A checkpoint of split experts restores on a grid that keeps them whole, and back
# (tests/test_checkpoint_topology.py: 3 steps, save, load, 3 more against one process).
RESHARD = {
    "etp2sp-expert2": ({"tensor": 2, "sequence_parallel": True, "expert_tensor": 2},
                       {"expert": 2}),
    "data2-etp2": ({"data": 2}, {"tensor": 2, "expert_tensor": 2}),
}


@pytest.mark.parametrize("row", list(RESHARD))
def test_a_checkpoint_of_split_experts_continues_on_another_grid(worlds, tmp_path, row):
    from test_checkpoint_topology import SAVE, STEPS, reference, run

    from paraxis.testing.tolerance import assert_losses_close

    grid_a, grid_b = RESHARD[row]
    ref_eval, ref_history, _ = reference(worlds, "mixtral")
    ckpt = str(tmp_path / "ckpt")
    worlds.run(2, run, "mixtral", grid_a, SAVE, None, ckpt)
    for evaluated, history, _ in worlds.run(2, run, "mixtral", grid_b, STEPS, ckpt):
        assert_losses_close([evaluated], [ref_eval], f"{row}: loss of the fixed batch")
        assert_losses_close([h[0] for h in history], [h[0] for h in ref_history[SAVE:]],
                            f"{row}: per-step losses after the load")


# Under train.precision bf16 rows travel in bf16 as the dispatch sends them; the routing
# weights and the partial outputs travel unrounded (one process keeps them in fp32).
@pytest.mark.parametrize("layout", ["tensor2_sp", "expert2_tensor2_sp"])
def test_split_experts_in_bf16_match_one_process_bf16(worlds, layout):
    from paraxis.testing.tolerance import BF16_RTOL

    degrees, sp = LAYOUTS[layout]
    compare(worlds, "mixtral", degrees, steps=6, recipe={"precision": "bf16"},
            rtol=BF16_RTOL, expert_tensor=2, sequence_parallel=sp)


# Split experts beside the other axes (each was refused until a run here matched one
# process): pipeline stages (each stage's experts split over its own tensor group, the
# 8-rank layout with expert 2 too), context ranks (each routes its own chunks of the
# sequence, the split FFN sees the tensor group's rows), ZeRO's partition of the split
# expert tensors over data (stage 1: optimizer states; stage 3: the weights themselves).
WITH_OTHER_AXES = {
    "tensor2_sp_pipeline2": ({"tensor": 2, "pipeline": 2}, {"microbatches": 2}),
    "expert2_tensor2_sp_pipeline2": ({"expert": 2, "tensor": 2, "pipeline": 2},
                                     {"microbatches": 2}),
    "context2_tensor2_sp": ({"context": 2, "tensor": 2}, {}),
    "data2_tensor2_sp_zero1": ({"data": 2, "tensor": 2}, {"zero": 1}),
    "data2_tensor2_sp_zero3": ({"data": 2, "tensor": 2}, {"zero": 3}),
}


@pytest.mark.parametrize("layout", list(WITH_OTHER_AXES))
def test_split_experts_beside_other_axes_match_one_process(worlds, layout):
    degrees, options = WITH_OTHER_AXES[layout]
    compare(worlds, "mixtral", degrees, steps=4, expert_tensor=2, sequence_parallel=True,
            **options)
