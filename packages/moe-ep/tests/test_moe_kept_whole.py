"""At expert degree 1 nothing is dispatched: MoE blocks whose experts paraxis cannot
shard (JetMoE's attention and MLP experts, Llama 4's) are kept whole and train the
model's own forward, their routers watched for the losses and statistics. A router with
more logits than experts (ZAYA's skip class) gives statistics over the real experts."""

import copy

import pytest
import torch

pytest.importorskip("transformers")

from paraxis.testing.tolerance import assert_losses_close

VOCAB, B, S = 64, 2, 16
TINY = {
    # Attention experts (MoA) and MLP experts, JetMoE's own aux_loss_coef; its gate
    # returns the logits fifth.
    "jetmoe": dict(hidden_size=32, num_hidden_layers=2, num_key_value_heads=2, kv_channels=8,
                   intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
                   vocab_size=VOCAB, max_position_embeddings=64),
    # Llama4TextExperts (not fused per expert); the router returns the logits second.
    "llama4_text": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=8, intermediate_size=48,
                        intermediate_size_mlp=48, num_local_experts=4, num_experts_per_tok=1,
                        vocab_size=VOCAB, max_position_embeddings=64, attention_chunk_size=16,
                        interleave_moe_layer_step=1, router_aux_loss_coef=0.01),
}


def one_process(family):
    """paraxis' first training step on a world of one against the model's own loss with
    ``output_router_logits=True`` (which adds its load-balancing loss where it has one)."""
    from moe_tiny_models import plan_of
    from transformers import AutoConfig, AutoModelForCausalLM

    import paraxis

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **TINY[family]))
    ids = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(1))
    ref = copy.deepcopy(model).eval()
    with torch.no_grad():
        own = ref(input_ids=ids, labels=ids, output_router_logits=True, use_cache=False)
    engine = paraxis.parallelize(model, plan=plan_of(model),
                                 config=paraxis.ParallelConfig.from_kwargs(),
                                 train={"steps": 1, "lr": 1e-3, "seq_length": S})
    try:
        kept = engine.ctx.extras["expert"].kept
        metrics = engine.train_step({"input_ids": ids, "labels": ids})
    finally:
        engine.close()
    own_aux = getattr(own, "aux_loss", None)
    return {"kept": kept, "loss": metrics["loss"], "aux": metrics["moe/aux_loss"],
            "entropy": metrics["moe/router_entropy"], "own": float(own.loss),
            "own_has_aux": own_aux is not None}


@pytest.mark.parametrize("family", sorted(TINY))
def test_unshardable_experts_are_kept_whole_at_expert_1(worlds, family):
    out = worlds.run(1, one_process, family)[0]
    assert out["kept"], out  # every block left to the model's own forward
    assert out["entropy"] > 0  # its router still watched
    # JetMoE's own loss holds its load-balancing loss; Llama 4's has none (paraxis
    # reports its Switch loss beside the language-model loss, as for every MoE family).
    trained = out["loss"] + out["aux"] if out["own_has_aux"] else out["loss"]
    assert_losses_close([trained], [out["own"]], f"{family} one-process loss")


def test_extra_router_classes_give_statistics_over_the_real_experts():
    from paraxis_moe.router import RouterLosses
    from paraxis_moe.stats import LayerStats

    experts = 4
    logits = torch.randn(6, experts + 1)  # ZAYA: E experts and a skip class
    stats = LayerStats(experts)
    stats.add_router(logits)
    probs = torch.softmax(logits, -1)
    torch.testing.assert_close(stats.values["prob_sum"].float(), probs[:, :experts].sum(0))
    losses = RouterLosses(experts, 1, aux_coef=0.0)
    losses.record(logits)  # no loss to compute: nothing recorded
    assert losses.local() is None
    with pytest.raises(ValueError, match="load-balancing loss is not defined"):
        RouterLosses(experts, 1, aux_coef=0.01).record(logits)
