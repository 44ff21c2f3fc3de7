"""Plans read from the models' own metadata, model building, and the loss."""

import pytest
import torch

from paraxis import PlanError, make_plugin_manager
from paraxis.engine.loss import causal_lm_loss_sum
from paraxis.parallel.batch import shift_labels
from paraxis.parallel.model_plan import find_plan
from paraxis.testing.tolerance import assert_step_close
from paraxis_hf import DEBUG_CONFIGS, build_debug_model

DECODERS = ["llama", "mistral", "qwen2"]


@pytest.mark.parametrize("family", DECODERS)
def test_decoder_plans_come_from_the_model(family):
    model = build_debug_model(family)
    plan = find_plan(model, make_plugin_manager(), None)
    assert plan.model_class == type(model).__name__
    assert plan.tensor_style("model.layers.1.self_attn.q_proj") == "colwise"
    assert plan.tensor_style("model.layers.0.self_attn.o_proj") == "rowwise"
    assert plan.tensor_style("model.layers.0.mlp.down_proj") == "rowwise"
    assert plan.tensor_style("lm_head") == "colwise_gather_output"
    assert plan.tensor_style("model.embed_tokens") == "embedding_rowwise"
    assert list(plan.pipeline) == ["model.embed_tokens", "model.layers", "model.norm",
                                   "lm_head"]  # forward order
    assert plan.pipeline["model.layers"][0][0] == "hidden_states"
    plan.check_against(model)  # every pattern names real modules
    for axis in ("tensor", "pipeline"):
        plan.require(axis)
    with pytest.raises(PlanError, match="no expert-parallel plan"):
        plan.require("expert")
    assert plan.extra["forward_kwargs"] == {"use_cache": False}


def test_gpt2_has_no_plan_and_says_so():
    plan = find_plan(build_debug_model("gpt2"), make_plugin_manager(), None)
    assert plan.tensor == {} and plan.pipeline == {}
    with pytest.raises(PlanError, match=r"GPT2LMHeadModel has no tensor-parallel plan"):
        plan.require("tensor")


def test_moe_blocks_are_found():
    model = build_debug_model("mixtral")
    plan = find_plan(model, make_plugin_manager(), None)
    assert plan.experts == ("model.layers.0.mlp", "model.layers.1.mlp")
    plan.require("expert")
    # Experts stay whole per expert rank: transformers' expert-splitting tensor entries
    # are left out; attention is still split.
    assert plan.extra["experts_kept_whole"] == [
        "model.layers.*.mlp.experts", "model.layers.*.mlp.experts.down_proj",
        "model.layers.*.mlp.experts.gate_up_proj"]
    assert not [p for p in plan.tensor if ".experts" in p]
    assert plan.tensor_style("model.layers.0.self_attn.q_proj") == "colwise"


def test_build_hook_and_unknown_family():
    pm = make_plugin_manager()
    model = pm.hook.paraxis_build_model(family="qwen2", config=DEBUG_CONFIGS["qwen2"])
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert model.model.layers[0].self_attn.q_proj.bias is not None
    assert pm.hook.paraxis_build_model(family="no-such-family", config={}) is None


@pytest.mark.parametrize("family", [*DECODERS, "gpt2"])
def test_loss_equals_the_models_own_labels_loss(family):
    model = build_debug_model(family)
    ids = torch.randint(0, 128, (3, 16), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, :5] = -100
    labels[2, 9:] = -100
    want = model(ids, labels=labels, use_cache=False).loss
    loss_sum, count = causal_lm_loss_sum(model(ids, use_cache=False).logits,
                                         shift_labels(labels))
    assert count == int((labels[:, 1:] != -100).sum())
    assert_step_close(loss_sum / count, want, "loss against the model's labels= loss")


def test_a_head_entry_alone_is_no_pipeline_plan():
    # transformers gives every causal LM its head's pipeline entry; Nemotron's base model
    # ships no pipeline plan, so there are no stages: refused as "no pipeline plan".
    from transformers import AutoModelForCausalLM

    from paraxis_hf.shrink import tiny_config

    model = AutoModelForCausalLM.from_config(tiny_config("nemotron").config)
    plan = find_plan(model, make_plugin_manager(), None)
    assert plan.tensor and plan.pipeline == {}
    with pytest.raises(PlanError, match="has no pipeline-parallel plan"):
        plan.require("pipeline")


def _tiny(model_type: str, **overrides):
    from paraxis_hf.families import build_family, build_model, causal_lm_types

    family = build_family(model_type, causal_lm_types()[model_type])
    return build_model(model_type, {**family.overrides, **overrides})


@pytest.mark.parametrize(("model_type", "refused"), [
    ("doge", {"tensor": "dt_proj", "context": "prepare_dynamic_mask"}),
    ("gemma3n_text", {"tensor": "_gaussian_topk", "sequence_parallel": "per-layer inputs",
                      "pipeline": "KV sharing"}),
    ("gemma4_text", {"sequence_parallel": "per-layer inputs",
                     "pipeline": "per-layer inputs from the token ids"}),
    # The pipeline stage check crashed on these (it was tallied as a refusal): each is
    # now refused for its cause, read from the model.
    ("deepseek_v4", {"pipeline": "hash routing, tid2eid",
                     "sequence_parallel": "hyper-connections"}),
    ("glm_moe_dsa", {"pipeline": "prev_topk_indices"}),
    # hy_v4 tensor=2 SP failed with a shape error (16x128 and 256x8): SP split its
    # 4 residual streams (dim -2) instead of the sequence.
    ("hy_v4", {"pipeline": "prev_topk_indices", "sequence_parallel": "hyper-connections"}),
    ("hrm_text", {"sequence_parallel": "two layer stacks"}),
    # tensor=2 SP failed with a shape error (16 against 8 in a torch.cat): each layer
    # takes a stack of earlier blocks' outputs built for the whole sequence.
    ("inkling2_text", {"sequence_parallel": "takes block_states"}),
    ("inkling2_loop_text", {"sequence_parallel": "takes block_states"}),
    ("llama", {}),
])
def test_layouts_a_model_cannot_run_are_named_with_the_cause(model_type, refused):
    """Each was a coverage defect (a wrong loss or a shape error the probe caught);
    now parallelize refuses the layout before any process group, saying why."""
    plan = find_plan(_tiny(model_type), make_plugin_manager(), None)
    assert sorted(plan.unsupported) == sorted(refused)
    for layout, cause in refused.items():
        assert cause in plan.unsupported[layout]


def test_a_stage_refusal_fails_before_any_process_group():
    import torch.distributed as dist

    import paraxis
    from paraxis import ConfigError

    with pytest.raises(ConfigError, match=r"parallelism.pipeline = 2: .*tid2eid"):
        paraxis.parallelize(_tiny("deepseek_v4"), pipeline=2, microbatches=2,
                            train={"seq_length": 16})
    assert not dist.is_initialized()


def test_activation_sparsity_off_lets_gemma3n_shard():
    """The rule reads the model: without activation sparsity gemma3n's MLP splits."""
    model = _tiny("gemma3n_text", activation_sparsity_pattern=[0.0] * 4)
    assert "tensor" not in find_plan(model, make_plugin_manager(), None).unsupported


def test_an_unsupported_layout_fails_before_any_process_group():
    import torch.distributed as dist

    import paraxis
    from paraxis import ConfigError

    with pytest.raises(ConfigError, match=r"parallelism.context = 2: DogeForCausalLM: "):
        paraxis.parallelize(_tiny("doge"), context=2, train={"seq_length": 16})
    assert not dist.is_initialized()
