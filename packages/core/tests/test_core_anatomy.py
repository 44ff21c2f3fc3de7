"""The model's anatomy (paraxis.parallel.anatomy): read from the plan, from the module tree
when there is no plan, declared by the model, or absent with the reason; the same
answers on a pipeline stage cut from the model. No processes."""

import pytest
from torch import nn

from paraxis.models.tiny import TINY_PLAN, TinyConfig, TinyTransformer
from paraxis.parallel.anatomy import Anatomy, find_anatomy
from paraxis.parallel.model_plan import ModelPlan, PlanError
from paraxis.parallel.stages import build_stage


def test_the_tiny_model_read_from_its_pipeline_plan():
    model = TinyTransformer(TinyConfig(num_layers=4))
    a = find_anatomy(model, TINY_PLAN)
    assert (a.layers, a.num_layers, a.embedding, a.before, a.after, a.head, a.tied,
            a.origin) == ("layers", 4, "embed", (), ("norm",), "head", False, "plan")
    part = a.parts[0]
    assert (part.attention, part.mixers, part.mlp, part.experts, part.norms) == (
        ("attn",), (), ("mlp",), (), ("attn_norm", "mlp_norm"))
    assert (part.rms_norms, part.gated_mlp) == (2, False)
    assert a.sequence_mixers_of(3) == ("layers.3.attn",)
    assert [i for i, _ in a.owned_layers(model)] == [0, 1, 2, 3]


class _Calls:
    def logits(self, model, **kwargs):
        return TinyTransformer.forward(model, **kwargs)

    def hidden(self, model, **kwargs):
        return TinyTransformer.hidden_states(model, **kwargs)


def test_a_stage_keeps_the_names_and_the_lookups_skip_its_stand_ins():
    model = TinyTransformer(TinyConfig(num_layers=4))
    a = find_anatomy(model, TINY_PLAN)
    first = build_stage(model, a, (0, 2), first=True, last=False, calls=_Calls())
    last = build_stage(model, a, (2, 4), first=False, last=True, calls=_Calls())
    assert [i for i, _ in a.owned_layers(first)] == [0, 1]
    assert [i for i, _ in a.owned_layers(last)] == [2, 3]
    assert a.embedding_of(first) is model.embed and a.head_of(first) is None
    assert a.embedding_of(last) is None and a.head_of(last) is model.head


class _Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(4, 4)


class _GatedDeltaNet(nn.Module):  # a linear attention, whatever its child name says
    def __init__(self):
        super().__init__()
        self.in_proj = nn.Linear(4, 4)


class _RMSNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(nn.init.ones_(nn.Linear(4, 1).weight[0]))


class _Layer(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.input_layernorm = _RMSNorm()
        if kind == "attention":
            self.self_attn = _Attention()
        else:
            self.linear_attn = _GatedDeltaNet()
        self.post_attention_layernorm = _RMSNorm()
        self.mlp = nn.Module()
        self.mlp.experts = nn.Linear(4, 8)  # a block holding routed experts
        self.mlp.gate = nn.Linear(4, 2)


class _Hybrid(nn.Module):
    """Qwen3-Next's shape without a plan: attention and linear-attention layers."""

    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(10, 4)
        self.layers = nn.ModuleList([_Layer("linear"), _Layer("attention")])
        self.lm_head = nn.Linear(4, 10, bias=False)
        self.lm_head.weight = self.embed_tokens.weight

    def get_input_embeddings(self):
        return self.embed_tokens


def test_the_fallbacks_read_a_model_without_a_plan():
    a = find_anatomy(_Hybrid())
    assert (a.layers, a.embedding, a.head, a.tied, a.origin) == (
        "layers", "embed_tokens", "lm_head", True, "search")
    assert a.parts[0].mixers == ("linear_attn",) and a.parts[0].attention == ()
    assert a.parts[1].attention == ("self_attn",) and a.parts[1].mixers == ()
    assert a.expert_blocks == ("layers.0.mlp", "layers.1.mlp")
    assert a.routed == ("layers.0.mlp.experts", "layers.1.mlp.experts")
    # an expert block is never a sequence mixer, whatever it is called
    assert all(part.experts == ("mlp",) and "mlp" not in part.sequence_mixers
               for part in a.parts)
    assert a.mixers == ("layers.0.linear_attn",) and a.has_attention


def test_the_plan_names_the_expert_blocks_when_it_has_any():
    plan = ModelPlan("Hybrid", experts=("layers.1.mlp",))
    assert find_anatomy(_Hybrid(), plan).expert_blocks == ("layers.1.mlp",)


def test_no_list_of_layers_says_why_where_layers_are_needed():
    a = find_anatomy(nn.Linear(2, 2))
    assert a.layers is None and a.origin.startswith("none: Linear has no list of layers")
    with pytest.raises(PlanError, match="no list of layers"):
        a.layer_list(nn.Linear(2, 2))


def test_a_model_declares_its_own_anatomy():
    declared = Anatomy(model_class="Mine", layers="blocks", num_layers=1, origin="declared")

    class Mine(nn.Module):
        def paraxis_anatomy(self, plan):
            return declared

    assert find_anatomy(Mine()) is declared
