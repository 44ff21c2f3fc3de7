"""Enumerating, fitting and ranking layouts, without processes."""

import itertools
from dataclasses import replace

import pytest

from paraxis.planner.evaluate import evaluate, make_layout, problems
from paraxis.planner.inputs import Hardware, Workload
from paraxis.planner.model import LayerCount, ModelCounts
from paraxis.planner.reasons import is_tie, tie_key, why_slower
from paraxis.planner.search import grids, search
from paraxis.planner.units import fmt_seconds

H, A, LAYERS, V = 4096, 32, 32, 32000


def llama7b() -> ModelCounts:
    layer = LayerCount(matrices=4 * H * H + 3 * H * 11008, vectors=2 * H, experts=0)
    return ModelCounts(family="llama", embedding=V * H, layers=(layer,) * LAYERS, final=H,
                       head=V * H, tied=False, non_embedding=LAYERS * layer.total + V * H,
                       hidden_size=H, num_heads=A, kv_heads=A, head_dim=H // A,
                       vocab_size=V, intermediate_size=11008, max_seq=4096)


WORK = Workload(seq=2048, global_batch=64, micro_batch=1)


def test_the_ranking_stars_layouts_whose_rules_went_unchecked():
    """With no axis package registered, every ranked layout needs an axis whose rules
    nobody checked: each row is starred and one line below the table names the axes
    and the packages to install."""
    from paraxis.engine.plugins import make_plugin_manager
    from paraxis.planner.report import format_ranking

    hw = Hardware(gpus_per_node=8, device_memory=40e9)
    ranking = search(llama7b(), WORK, hw, world=16, fixed={}, options={},
                     plugin_manager=make_plugin_manager(load_entrypoints=False))
    table = format_ranking(ranking, world=16, top=3, hw=hw).splitlines()
    rows = table[2:5]
    assert all(row.rstrip().endswith("*") or " * " in row for row in rows), rows
    assert table[5].startswith("* the rules of ") and "were not checked" in table[5]
    assert "(pip install paraxis-" in table[5]


def test_grids_are_every_factorization_with_fixed_degrees_kept():
    assert len(list(grids(8, {}))) == 35  # three factors of 2 over five axes: C(7, 4)
    assert len(list(grids(8, {}, experts=False))) == 20
    fixed = list(grids(8, {"tensor": 2}))
    assert fixed and all(g["tensor"] == 2 for g in fixed)
    assert list(grids(8, {"tensor": 3})) == []


def test_search_ranks_fitting_layouts_by_step_time():
    hw = Hardware(gpus_per_node=8, device_memory=40e9, peak_flops=300e12, intra_bw=300e9,
                  inter_bw=25e9)
    ranking = search(llama7b(), WORK, hw, world=16, fixed={}, options={})
    assert ranking.plans and ranking.valid <= ranking.grids
    # By step time; plans within TIE_RTOL of each other may be ordered by what else they
    # cost (exposed communication, axes, memory), never a slower one before a faster one.
    for a, b in itertools.pairwise(ranking.plans):
        assert b.step.step_s >= a.step.step_s or is_tie(a, b)
        if is_tie(a, b) and b.step.step_s < a.step.step_s:
            assert tie_key(a) <= tie_key(b)
    for plan in ranking.plans:
        assert plan.worst.total <= 40e9
        assert problems(plan.counts, plan.layout, WORK, world_size=16) == []
    # 7B in mixed precision is 16 x 6.7 GB of model state unsharded: nothing fits 40 GB
    # without sharding it somehow.
    assert all(p.layout.parallelism.zero or p.layout.parallelism.tensor > 1
               or p.layout.parallelism.pipeline > 1 for p in ranking.plans)
    assert ranking.seed is not None
    assert ranking.seed.layout.parallelism.zero <= 1  # pipeline stages make it fit


def test_search_reports_the_closest_when_nothing_fits():
    hw = Hardware(device_memory=1e9)
    ranking = search(llama7b(), WORK, hw, world=2, fixed={}, options={})
    assert ranking.plans == () and ranking.closest is not None
    assert ranking.closest.worst.total > 1e9


def test_fixed_options_are_kept():
    ranking = search(llama7b(), WORK, Hardware(), world=4, fixed={"tensor": 2},
                     options={"activation_checkpointing": "full"})
    assert all(p.layout.degrees["tensor"] == 2 for p in ranking.plans)
    assert {p.layout.schedule.activation_checkpointing for p in ranking.plans} == {"full"}


def test_why_slower_names_the_biggest_cause():
    hw = Hardware(gpus_per_node=4, peak_flops=300e12, intra_bw=300e9, inter_bw=25e9)
    fast = evaluate(llama7b(), make_layout({"data": 8}, {}, WORK), WORK, hw)
    cross = evaluate(llama7b(), make_layout({"tensor": 8}, {}, WORK), WORK, hw)
    why = why_slower(cross, fast)  # the largest cause first, the net at the end
    assert why.startswith("tensor over inter exposed +"), why
    assert why.endswith(f"(net +{fmt_seconds(cross.step.step_s - fast.step.step_s)})")
    piped = evaluate(llama7b(), make_layout({"pipeline": 8}, {}, WORK), WORK, hw,
                     simulate=False)
    lean = evaluate(llama7b(), make_layout({"data": 8}, {"activation_checkpointing": "full"},
                                           WORK), WORK, hw)
    assert why_slower(piped, fast).startswith("bubble")
    assert why_slower(lean, fast).startswith("recomputes (full)")
    assert why_slower(fast, fast).startswith("ties #1 on time")


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero_bubble_h1"])
def test_first_stage_is_the_most_loaded_under_pipelines(schedule):
    layout = make_layout({"pipeline": 4}, {"pipeline_schedule": schedule}, WORK)
    plan = evaluate(llama7b(), layout, WORK, Hardware(), simulate=False)
    assert len(plan.memory) == 4
    if schedule != "gpipe":
        assert plan.worst.stage == 0


def test_headroom_is_kept_free_for_what_the_plan_does_not_count():
    layout = make_layout({"data": 8}, {"zero": 3}, WORK)
    total = evaluate(llama7b(), layout, WORK, Hardware()).worst.total
    for headroom, fits in ((0.0, True), (0.1, False)):
        hw = Hardware(device_memory=total / 0.95, headroom=headroom)
        assert evaluate(llama7b(), layout, WORK, hw).fits is fits


def test_a_reason_never_contradicts_the_order():
    """Issue 38: "it is slower than #1 because same time, more memory". A plan within
    TIE_RTOL of #1 ties it and says what broke the tie; any other names what makes its
    extra time, the net equal to the difference in step time."""
    from paraxis.planner.report import format_ranking, seed_sentence

    hw = Hardware(gpus_per_node=8, device_memory=80e9)
    ranking = search(llama7b(), WORK, hw, world=16, fixed={}, options={})
    best = ranking.plans[0]
    for plan in ranking.plans[1:]:
        why = why_slower(plan, best)
        assert not why.startswith("faster") and "same time" not in why
        if is_tie(plan, best):
            assert why.startswith("ties #1 on time"), why
        elif "(net +" in why:
            assert why.endswith(f"(net +{fmt_seconds(plan.step.step_s - best.step.step_s)})")
    # A plan 0.1% slower ties: the line says so, and what broke the tie.
    twin = replace(best, step=replace(best.step, step_s=best.step.step_s * 1.001))
    assert why_slower(twin, best).startswith("ties #1 on time"), why_slower(twin, best)
    sentence = seed_sentence(ranking)
    if ranking.seed is not None and is_tie(ranking.seed, best):
        assert "slower than #1" not in sentence
    assert "same time" not in format_ranking(ranking, world=16, top=10, hw=hw)


def test_hsdp_keeps_the_shard_group_in_a_node_and_is_ranked():
    """Issue 36: with ZeRO-3 over 64 data ranks on 8-GPU nodes the search tries full
    sharding and groups of 8 data ranks (one node, zero_shard 8) and ranks them by time:
    the shard group's gathers stay on the node's links, only the gradient shards'
    all-reduce (1/8 of the bytes) crosses, so HSDP comes first where the nodes' links are
    slow (100 Gb/s a GPU: full sharding's gathers no longer hide under the compute; at
    400 Gb/s they do, and full sharding ties or wins); the replica traffic is its own row,
    across nodes."""
    hw = Hardware(gpus_per_node=8, device_memory=80e9, peak_flops=989e12, intra_bw=450e9,
                  inter_bw=12.5e9)
    work = Workload(seq=2048, global_batch=512, micro_batch=1, precision="bf16")
    ranking = search(llama7b(), work, hw, world=64, fixed={"tensor": 1, "pipeline": 1,
                                                          "context": 1},
                     options={"zero": 3})
    best = ranking.plans[0]
    assert best.layout.parallelism.zero_shard == 8
    links = {a.axis: a.link for a in best.comm}
    assert links == {"data": "intra", "data_replica": "inter"}
    full = evaluate(llama7b(), make_layout({"data": 64}, {"zero": 3}, work), work, hw)
    assert best.step.step_s < full.step.step_s
