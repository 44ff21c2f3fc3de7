"""The coverage matrix's parts that need no ranks: shrinking configs, telling text-only
causal LMs apart, and the report's counts."""

import pytest

from paraxis_coverage.cells import CHECKS, Outcome
from paraxis_coverage.report import counts, render, rows_from_json, rows_to_json
from paraxis_coverage.runner import OWN_LOSS, Row
from paraxis_hf.families import Family, build_family, not_text_only
from paraxis_hf.shrink import HIDDEN, LAYERS, VOCAB, choose_layers, tiny_config

pytest.importorskip("transformers")


def test_choose_layers_keeps_every_kind_of_layer():
    five_to_one = ["sliding"] * 5 + ["full"]
    assert choose_layers([five_to_one * 4], 24) == [0, 1, 2, 5]
    assert choose_layers([[True] * 24], 24) == [0, 1, 2, 3]
    dense_then_moe = ["dense"] * 3 + ["moe"] * 21
    kv_shared = [False] * 20 + [True] * 4  # the last layers reuse another's cache
    chosen = choose_layers([five_to_one * 4, dense_then_moe, kv_shared], 24)
    for feature in (five_to_one * 4, dense_then_moe, kv_shared):
        assert {feature[i] for i in chosen} == set(feature)


@pytest.mark.parametrize(("family", "check"), [
    # Sizes under their own names, head_dim derived.
    ("gpt2", lambda c: (c.n_embd, c.n_layer, c.n_head) == (HIDDEN, LAYERS, 4)),
    # Sliding and full layers both kept, the window exercised at the test length.
    ("gemma3_text", lambda c: set(c.layer_types) == {"sliding_attention", "full_attention"}
     and c.sliding_window == 8),
    # NoPE layers kept in the per-layer list.
    ("smollm3", lambda c: 0 in c.no_rope_layers and 1 in c.no_rope_layers),
    # Latent attention: head_dim = nope + rope; experts 4, top-2, one expert group.
    ("deepseek_v3", lambda c: (c.qk_nope_head_dim + c.qk_rope_head_dim, c.n_routed_experts,
                               c.num_experts_per_tok, c.n_group) == (16, 4, 2, 1)),
    # Special ids beyond the vocabulary mapped into it.
    ("llama4_text", lambda c: c.vocab_size == VOCAB and max(
        i for i in (c.bos_token_id, c.eos_token_id, c.pad_token_id) if i is not None) < VOCAB),
    # An attribute_map alias written back under the field the constructor takes.
    ("qwen3_moe", lambda c: c.num_experts == 4),
])
def test_tiny_configs_keep_what_the_family_is(family, check):
    tiny = tiny_config(family)
    assert tiny.error is None, tiny.error
    assert check(tiny.config), tiny.overrides


def test_relaxations_are_tried_and_recorded():
    # Latent attention's validation wants one key/value head per query head here.
    family = build_family("dots3_note_text", "Dots3NoteForCausalLM")
    assert family.built and "mha" in family.relax and family.params < 2_000_000


@pytest.mark.parametrize(("family", "class_name", "says"), [
    ("gemma3", "Gemma3ForConditionalGeneration", "pixel_values"),
    ("bart", "BartForCausalLM", "encoder-decoder"),
    ("llama4", "Llama4ForCausalLM", "vision_config"),
    ("llama", "LlamaForCausalLM", None),
])
def test_text_only_causal_lms_are_told_apart(family, class_name, says):
    why = not_text_only(family, class_name)
    assert (why is None) if says is None else (says in why), why


def _row(model_type, shipped, cells, not_text=None, error=None):
    family = Family(model_type, "X", not_text=not_text, error=error, shipped=shipped,
                    overrides=None if (not_text or error) else {})
    return Row(family, {k: Outcome(v) for k, v in cells.items()})


def test_denominators_count_shipped_plans_and_built_types():
    rows = [_row("a", ("tensor", "pipeline"), {"data=2": "pass", "tensor=2": "pass"}),
            _row("b", ("tensor",), {"data=2": "pass", "tensor=2": "fail"}),
            _row("c", ("tensor",), {}, error="does not build"),
            _row("d", ("tensor",), {}, not_text="vision")]
    c = counts(rows, ["data=2", "tensor=2", "pipeline=2"])
    assert c["data=2"] == {"pass": 2, "explained": 0, "refused": 0, "fail": 0, "of": 2}
    assert c["tensor=2"] == {"pass": 1, "explained": 0, "refused": 0, "fail": 1,
                             "of": 3}  # c counts, d not
    assert c["pipeline=2"]["of"] == 1
    text = render(rows, CHECKS[:1], versions="v", seconds=60)
    assert text.startswith("<!-- Generated") and "Do not edit by hand" in text
    assert "| d | X | vision |" in text and "| c | t | does not build |" in text
    again = rows_from_json(rows_to_json(rows))
    assert [r.cells for r in again] == [r.cells for r in rows]
    assert OWN_LOSS not in c


def test_a_model_with_experts_is_compared_with_one_process_running_the_same_microbatches():
    # The router's load-balancing loss is per forward: a pipeline's 2 microbatches train
    # what one process accumulating the same 2 microbatches trains, not one forward.
    from paraxis_coverage.runner import Prepared, _reference_for

    pipeline = next(c for c in CHECKS if c.name == "pipeline=2")
    data = next(c for c in CHECKS if c.name == "data=2")
    assert (pipeline.microbatches, data.microbatches) == (2, 1)
    moe = Prepared(Family("m", "X", overrides={}, plans=("expert",)), {"losses": [1.0]}, 0.0,
                   {2: {"losses": [2.0]}})
    assert _reference_for(moe, pipeline) == {"losses": [2.0]}
    assert _reference_for(moe, data) == {"losses": [1.0]}


def _first_grads(planted=1.0, rounding=0.0):
    """First-step gradients as a run returns them (whole tensors with their placements);
    ``planted`` scales the norm weight's, ``rounding`` (relative) stands for another
    summation order's."""
    import torch

    from paraxis.parallel.placement import Placement

    weights = {"model.embed_tokens.weight": torch.linspace(-1.0, 1.0, 12).reshape(3, 4),
               "model.norm.weight": torch.full((4,), 1e-3) * planted}
    weights = {n: g * (1 + rounding) for n, g in weights.items()}
    return {name: (g, Placement(name, tuple(g.shape), g.dtype)) for name, g in weights.items()}


def test_a_data_mismatch_is_passed_only_when_one_process_split_the_same_way_equals_it():
    """CpmAnt: data=2's step-3 gradient norm is 5.9e-5 off one process on whole batches,
    and exactly one process accumulating the same two shares (reduction order, grown by
    an ill-conditioned model), which equals whole batches at step 1 parameter by
    parameter; a data run that equals neither still fails."""
    from paraxis_coverage.checks import compare, split_explained

    whole = {"losses": [5.0, 4.0, 3.0], "norms": [89.31, 49.36, 52.69037],
             "grads": _first_grads()}
    ranks = [dict(whole, norms=[89.31, 49.36, 52.69349])] * 2
    # One process split: the ranks' numbers, its first gradients in another order.
    split = dict(ranks[0], grads=_first_grads(rounding=1e-7))
    cell = compare(whole, ranks)
    assert cell.status == "fail"
    explained = split_explained(whole, split, ranks, cell, 2)
    assert explained.status == "explained" and "ill-conditioned" in explained.detail
    assert "5.9e-05" in explained.detail and "at step 1" in explained.detail
    wrong = [dict(split, norms=[89.31, 49.36, 52.8])] * 2
    assert split_explained(whole, split, wrong, compare(whole, wrong), 2).status == "fail"
    # One process agreeing with itself split: the ranks' difference is theirs.
    assert split_explained(whole, whole, wrong, compare(whole, wrong), 2).status == "fail"
    # Without first-step gradients step 1 cannot be held to them: no explanation.
    bare = {k: v for k, v in split.items() if k != "grads"}
    assert split_explained(whole, bare, [bare] * 2, cell, 2) == cell


def test_a_defect_shared_by_the_split_run_and_the_ranks_is_not_explained():
    """A gradient doubled in both the ranks and one process accumulating the same shares
    (a defect of accumulation, which both run): they equal each other at every step and
    differ from whole batches, which once read as ill-conditioned (issue 32). All runs
    start from the same weights, so step 1 must agree parameter by parameter: a fail."""
    from paraxis_coverage.checks import compare, split_explained

    whole = {"losses": [5.0, 4.0, 3.0], "norms": [89.31, 49.36, 52.69037],
             "grads": _first_grads()}
    # The norm weight's share is too small for the step-1 norm to show it doubled.
    doubled = dict(whole, norms=[89.31, 49.36, 52.69349], grads=_first_grads(planted=2.0))
    ranks = [dict(doubled), dict(doubled)]
    cell = compare(whole, ranks)
    assert cell.status == "fail" and "model.norm.weight" in cell.detail, cell
    assert compare(doubled, ranks).status == "pass"  # what the old rule went by
    judged = split_explained(whole, doubled, ranks, cell, 2)
    assert judged.status == "fail" and judged == cell, judged


def test_a_router_loss_is_compared_per_step():
    """A model with experts reports ``moe/aux_loss``: a mismatch there fails the cell
    even where losses and norms agree; a model without one is not held to it."""
    from paraxis_coverage.checks import compare

    ref = {"losses": [5.0, 4.0], "norms": [9.0, 8.0], "aux": [2.0e-3, 1.9e-3]}
    assert compare(ref, [dict(ref)] * 2).status == "pass"
    off = dict(ref, aux=[2.0e-3, 1.95e-3])
    cell = compare(ref, [off] * 2)
    assert cell.status == "fail" and "router load-balancing loss at step 2" in cell.detail
    missing = compare(ref, [dict(ref, aux=[None, None])] * 2)
    assert missing.status == "fail" and "not reported" in missing.detail
    dense = {"losses": [5.0, 4.0], "norms": [9.0, 8.0], "aux": [None, None]}
    assert compare(dense, [dense] * 2).status == "pass"


def _proof(sharded=0, handed_over=0, bytes_=500, claimed=500, whole=1000, kept=0):
    return {"sharded": {"tensor": sharded, "pipeline": 0, "expert": 0},
            "handed_over": handed_over, "bytes": bytes_, "claimed": claimed, "whole": whole,
            "experts_replicated_over_tensor": kept}


def test_a_layout_cell_passes_only_with_its_shard_proof():
    """A plan that matched nothing would pass on losses alone; the cell must see that
    every rank sharded something, holds less than the whole model, and holds exactly what
    its placements claim (issue 19, finding 2)."""
    from paraxis_coverage.checks import compare

    tensor = next(c for c in CHECKS if c.name == "tensor=2")
    ref = {"losses": [5.0], "norms": [9.0]}
    ok = [{**ref, "proof": _proof(sharded=7, kept=2)}] * 2
    cell = compare(ref, ok, tensor)
    assert cell.status == "pass" and "7 parameters sharded" in cell.detail
    assert "0.50 of the model" in cell.detail and "experts of 2 block(s)" in cell.detail
    nothing = [{**ref, "proof": _proof(bytes_=1000, claimed=1000)}] * 2
    assert "sharded nothing over tensor" in compare(ref, nothing, tensor).detail
    lying = [{**ref, "proof": _proof(sharded=7, claimed=400)}] * 2
    assert compare(ref, lying, tensor).status == "fail"
    pipeline = next(c for c in CHECKS if c.name == "pipeline=2")
    stages = [{**ref, "proof": {**_proof(handed_over=3), "sharded": {
        "tensor": 0, "pipeline": 0, "expert": 0}}}] * 2
    assert "3 modules handed to the other stage" in compare(ref, stages, pipeline).detail


def test_a_cell_fails_when_a_rank_holds_other_bytes_than_the_plan_gives():
    """Bytes equal to the placements' claim and below the whole model are not enough: a
    plan entry an axis silently skipped writes no placement (planted in paraxis_tp, the
    logits' entry skipped: llama tensor=2 passed parity and the old proof, and failed
    with "lm_head.weight 65,536 (expected 32,768)")."""
    from paraxis_coverage.checks import compare

    tensor = next(c for c in CHECKS if c.name == "tensor=2")
    ref = {"losses": [5.0], "norms": [9.0]}
    want = {"bytes": 500, "split": 800, "replicated": 150, "replicated_experts": 50,
            "elsewhere": 0, "every_stage": 0, "per_param": [(["head"], 100), (["mlp"], 400)]}
    held = {"head": 100, "mlp": 400}
    ok = [{**ref, "proof": {**_proof(sharded=7), "expected": want, "held": held}}] * 2
    cell = compare(ref, ok, tensor)
    assert cell.status == "pass", cell
    assert "0.80 of the model named by the tensor plan, split 1/2" in cell.detail
    assert "0.20 replicated, experts 0.05 of it" in cell.detail
    skipped = [{**ref, "proof": {**_proof(sharded=7, bytes_=600, claimed=600),
                                 "expected": want, "held": {**held, "head": 200}}}] * 2
    cell = compare(ref, skipped, tensor)
    assert cell.status == "fail" and "the plan gives 500" in cell.detail
    assert "head 200 (expected 100)" in cell.detail


def _llama_share(degrees, **seat):
    from paraxis import make_plugin_manager
    from paraxis.parallel.model_plan import find_plan
    from paraxis_coverage.shares import expected_share, whole_layout
    from paraxis_hf.families import build_family, build_model, causal_lm_types

    family = build_family("llama", causal_lm_types()["llama"])
    model = build_model("llama", family.overrides)
    plan = find_plan(model, make_plugin_manager(), None)
    return expected_share(whole_layout(model), plan, degrees, **seat)


def _names(share):
    return {n for names, _ in share["per_param"] for n in names}


def test_a_parameter_split_twice_fails_though_another_kept_whole_keeps_the_total():
    """The proof compares each parameter, not the rank's total (issue 32): llama at
    tensor=2 with one rank's gate_proj split twice (8,192 bytes instead of 16,384) and
    its q_proj kept whole (16,384 instead of 8,192) holds the total the plan gives, and
    fails naming both."""
    from paraxis_coverage.checks import compare

    want = _llama_share({"tensor": 2})
    held = {names[0]: b for names, b in want["per_param"]}
    gate, query = "model.layers.0.mlp.gate_proj.weight", "model.layers.0.self_attn.q_proj.weight"
    assert held[gate] == 2 * held[query]  # so the two errors cancel in the total
    planted = {**held, gate: held[gate] // 2, query: held[query] * 2}
    assert sum(planted.values()) == want["bytes"]
    ref, tensor = {"losses": [5.0], "norms": [9.0]}, next(c for c in CHECKS if c.name == "tensor=2")
    whole = 2 * want["bytes"]
    ranks = [{**ref, "proof": {**_proof(sharded=7, bytes_=want["bytes"], claimed=want["bytes"],
                                        whole=whole), "expected": want, "held": h}}
             for h in (planted, held)]
    cell = compare(ref, ranks, tensor)
    assert cell.status == "fail", cell
    assert "rank 0: 2 parameter(s)" in cell.detail and "the same total" in cell.detail
    assert f"{gate} 8,192 (expected 16,384)" in cell.detail
    assert f"{query} 16,384 (expected 8,192)" in cell.detail
    ranks[0]["proof"]["held"] = held
    assert compare(ref, ranks, tensor).status == "pass"


def test_the_stage_cut_is_counted_from_the_layer_list_not_read_from_the_engine():
    """The expected stages come from the whole model's layer list and the degrees
    (issue 32: the proof read the engine's own ranges, so a wrong cut agreed with
    itself). The count agrees with the pipeline axis' split wherever both are defined,
    and a rank holding another cut than it fails by name."""
    from paraxis.parallel.split import stage_ranges
    from paraxis_coverage.shares import expected_stage_ranges, parameters_off_share

    for layers, stages in [(4, 2), (5, 2), (7, 3), (8, 4), (12, 5), (3, 3)]:
        for hidden, vocab in [(64, 256), (16, 50_000), (0, 0)]:
            assert expected_stage_ranges(layers, stages, hidden=hidden, vocab=vocab) == \
                stage_ranges(layers, stages, hidden=hidden, vocab=vocab), (layers, stages)
    assert expected_stage_ranges(4, 2, hidden=64, vocab=256, points=[1]) == [(0, 1), (1, 4)]
    first = _llama_share({"pipeline": 2}, pipeline_rank=0)
    last = _llama_share({"pipeline": 2}, pipeline_rank=1)
    assert "model.layers.1.mlp.up_proj.weight" in _names(first) - _names(last)
    assert {"lm_head.weight", "model.norm.weight"} <= _names(last) - _names(first)
    assert "model.embed_tokens.weight" in _names(first) - _names(last)
    # A stage 0 cut after layer 0 (the engine's ranges would say so, and agree).
    held = {ns[0]: b for ns, b in first["per_param"] if not ns[0].startswith("model.layers.1.")}
    wrong = parameters_off_share(held, first)
    assert wrong and all("model.layers.1." in w and "missing" in w for w in wrong), wrong
    extra = {**{ns[0]: b for ns, b in first["per_param"]}, "model.layers.2.mlp.up_proj.weight": 1}
    assert parameters_off_share(extra, first) == [
        "model.layers.2.mlp.up_proj.weight 1 (expected none: another stage holds it)"]


@pytest.mark.parametrize(("model_type", "degrees", "split", "experts_whole"), [
    ("llama", {"tensor": 2}, 1.0, 0.0),  # every parameter but the norms is named
    ("mixtral", {"tensor": 2}, 0.17, 0.82),  # experts stay whole over tensor
    ("mixtral", {"expert": 2}, 0.82, 0.0),
    # expert_tensor = tensor (what a tensor column runs where parallelize accepts it):
    # every expert's FFN split over tensor too, so nothing stays whole but the norms.
    ("mixtral", {"tensor": 2, "expert_tensor": 2}, 0.99, 0.0),
])
def test_the_expected_share_is_read_from_the_plan(model_type, degrees, split, experts_whole):
    from paraxis import make_plugin_manager
    from paraxis.parallel.model_plan import find_plan
    from paraxis_coverage.shares import expected_share, whole_layout
    from paraxis_hf.families import build_family, build_model, causal_lm_types

    family = build_family(model_type, causal_lm_types()[model_type])
    model = build_model(model_type, family.overrides)
    plan = find_plan(model, make_plugin_manager(), None)
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    want = expected_share(whole_layout(model), plan, degrees)
    assert want["split"] / whole == pytest.approx(split, abs=0.01)
    assert want["replicated_experts"] / whole == pytest.approx(experts_whole, abs=0.01)
    assert want["bytes"] == whole - want["split"] // 2  # every split tensor divides by 2
    assert want["split_experts"] / whole == pytest.approx(  # split by either axis
        0.0 if experts_whole or model_type == "llama" else 0.82, abs=0.01)


def test_a_defect_the_probe_caught_is_a_failure_not_a_refusal():
    from paraxis_coverage.checks import compare

    caught = [{"defect": "the parallel model's loss on a probe batch is 5.59"}] * 2
    assert compare({"losses": [5.0]}, caught).status == "fail"
    declined = [{"refused": "no tensor-parallel plan"}] * 2
    assert compare({"losses": [5.0]}, declined).status == "refused"


def test_a_crash_in_the_stage_check_is_a_failure_not_a_refusal(monkeypatch):
    """The pipeline stage check's crash (gemma3n's "KeyError: 'sliding_attention'" was
    tallied as refused) is a defect nobody diagnosed: the cell fails. A cause found in
    the model goes to paraxis_hf.limits and is refused at preflight instead."""
    import paraxis
    from paraxis.parallel.stages import StageParityError
    from paraxis_coverage.checks import _train, compare
    from paraxis_hf.families import build_family, causal_lm_types

    def crash(*args, **kwargs):
        raise StageParityError("LlamaForCausalLM: a pipeline stage cannot run this "
                               "model's forward (KeyError: 'sliding_attention')")

    monkeypatch.setattr(paraxis, "parallelize", crash)
    family = build_family("llama", causal_lm_types()["llama"])
    result = _train("llama", family.overrides, {"pipeline": 2}, own=False)
    assert "sliding_attention" in result["defect"] and "refused" not in result
    assert compare({"losses": [5.0]}, [result] * 2).status == "fail"


def test_a_drifting_run_is_passed_only_from_the_reference_weights_and_float64():
    """Gemma 4, tensor=2: 1.2e-5 off one process at step 2, equal to it from the
    reference's own weights, and one process in float32 is 2.3e-4 off float64 there
    (the layout 2.2e-4): ill-conditioned. A layout wrong at the reference's weights, a
    reference that float64 confirms, or a layout farther from float64 stay failures."""
    from paraxis_coverage.checks import compare
    from paraxis_coverage.drift import drift_explained

    ref = {"losses": [5.538076, 5.540164, 5.511240], "norms": [14.36712, 13.25554, 11.14923]}
    exact = {"losses": [5.538076, 5.540169, 5.511277], "norms": [14.36712, 13.25246, 11.15674]}
    ranks = [{"losses": [5.538076, 5.540168, 5.511247],
              "norms": [14.36713, 13.25538, 11.15292]}] * 2
    anchored = [{"losses": ref["losses"], "norms": [14.36713, 13.25554, 11.14923]}] * 2
    cell = compare(ref, ranks)
    assert cell.status == "fail"
    explained = drift_explained(ref, exact, anchored, ranks, cell)
    assert explained.status == "explained" and "ill-conditioned" in explained.detail
    assert "6.7e-04 off float64" in explained.detail and cell.detail in explained.detail
    wrong_at_weights = [dict(anchored[0], norms=[14.36713, 13.25654, 11.14923])] * 2
    assert drift_explained(ref, exact, wrong_at_weights, ranks, cell) == cell
    assert drift_explained(ref, ref, anchored, ranks, cell) == cell
    far = [dict(ranks[0], norms=[14.36713, 13.27, 11.15292])] * 2
    assert drift_explained(ref, exact, anchored, far, compare(ref, far)).status == "fail"
    assert drift_explained(ref, exact, [], ranks, cell) == cell


def test_the_readme_states_the_running_time_of_the_run_it_copies():
    """The README said 11 minutes while docs/coverage.md said 7.1: the time is now copied
    with the table, from the same run."""
    from paraxis_coverage.report import readme_table

    md = ("transformers 5.24.0; the whole matrix took 9.5 minutes on 2 cores. How it is "
          "made: ...\n| data=2 | 158 types | 157 | 1 | 0 | 0 |  |\n")
    table = readme_table(md)
    assert table.endswith("The last full run took 9.5 minutes on 2 cores (docs/coverage.md).")
    assert "| `data=2` | 157 | 1 | 0 | 0 | 158 types |" in table
