"""Plans that name parameters and regions (transformers' MoE and MLA styles), and
parameters whose gradient is partial without the plan saying so: each against one
process, on real gloo ranks, through ``parallelize`` (per-step losses, gradient norms
and gathered weights at the shared tolerance)."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import paraxis
from paraxis import ModelPlan
from paraxis.models.tiny import TINY_PLAN, TinyConfig, TinyTransformer
from paraxis.testing.parity import assert_same_weights, local_shards
from paraxis.testing.tolerance import assert_losses_close

CFG = TinyConfig(vocab_size=61, hidden_size=32, num_layers=2, num_heads=4,
                 intermediate_size=64, seq_length=16)
STEPS, LR, EXPERTS = 4, 1e-3, 4


class LearnedActivation(nn.Module):
    """An activation with its own parameters (as xIELU's alphas in Apertus): between the
    column- and the row-parallel layer it sees this rank's features only."""

    def __init__(self):
        super().__init__()
        self.alpha = nn.Parameter(torch.tensor([0.8]))
        self.beta = nn.Parameter(torch.tensor([0.3]))

    def forward(self, x):
        return self.alpha * F.gelu(x) + self.beta * x


class MLPWithLearnedActivation(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.up = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.act = LearnedActivation()
        self.down = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down(self.act(self.up(x)))


class Experts(nn.Module):
    """3-D expert weights as transformers stores them: gate_up (E, 2I, H), down (E, H, I)."""

    def __init__(self, cfg):
        super().__init__()
        i, h = cfg.intermediate_size // 2, cfg.hidden_size
        self.gate_up_proj = nn.Parameter(torch.randn(EXPERTS, 2 * i, h) * 0.2)
        self.down_proj = nn.Parameter(torch.randn(EXPERTS, h, i) * 0.2)

    def forward(self, hidden, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden)
        for e in range(EXPERTS):
            pos, tok = torch.where(top_k_index.T.eq(e))
            gate, up = F.linear(hidden[tok], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[e]) * top_k_weights[tok, pos, None]
            out.index_add_(0, tok, y)
        return out


class SharedExpert(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.up = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class MoE(nn.Module):
    """Router (replicated, on this rank's tokens under sequence parallelism) -> experts
    (a region over split expert weights) + a shared expert (column / row modules), laid
    out as transformers' MoE blocks are."""

    def __init__(self, cfg):
        super().__init__()
        self.router = nn.Linear(cfg.hidden_size, EXPERTS, bias=False)
        self.experts = Experts(cfg)
        self.shared = SharedExpert(cfg)

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        weights, index = torch.topk(self.router(flat).softmax(-1), 2, dim=-1)
        return self.experts(flat, index, weights).view_as(x) + self.shared(x)


def _model(kind):
    torch.manual_seed(0)
    model = TinyTransformer(CFG)
    for layer in model.layers:
        layer.mlp = MLPWithLearnedActivation(CFG) if kind == "activation" else MoE(CFG)
    return model


PLANS = {
    "activation": dataclasses.replace(TINY_PLAN, tensor={
        **{k: v for k, v in TINY_PLAN.tensor.items() if ".mlp." not in k},
        "layers.*.mlp.up": "colwise", "layers.*.mlp.down": "rowwise"}),
    "moe": dataclasses.replace(TINY_PLAN, tensor={
        **{k: v for k, v in TINY_PLAN.tensor.items() if ".mlp." not in k},
        "layers.*.mlp.experts.gate_up_proj": "packed_colwise",
        "layers.*.mlp.experts.down_proj": "rowwise",
        "layers.*.mlp.experts": "moe_tp_experts",
        "layers.*.mlp.shared.up": "colwise", "layers.*.mlp.shared.down": "rowwise"}),
}


def train(kind, degrees):
    engine = paraxis.parallelize(_model(kind), plan=PLANS[kind], **degrees, train={
        "steps": STEPS, "lr": LR, "warmup_steps": 1, "seq_length": CFG.seq_length})
    g = torch.Generator().manual_seed(1)
    history = []
    for _ in range(STEPS):
        m = engine.train_step(torch.randint(0, CFG.vocab_size, (4, CFG.seq_length),
                                            generator=g))
        history.append((m["loss"], m["grad_norm"]))
    shards = local_shards(engine.model)
    engine.close()
    return history, shards


@pytest.mark.parametrize(("kind", "degrees"), [
    ("activation", {"tensor": 2}),
    ("moe", {"tensor": 2}),
    ("moe", {"tensor": 2, "sequence_parallel": True}),
])
def test_parameter_styles_regions_and_unmarked_partial_gradients(worlds, kind, degrees):
    ref, ref_shards = worlds.run(1, train, kind, {})[0]
    for history, _ in (out := worlds.run(2, train, kind, degrees)):
        assert_losses_close([h[0] for h in history], [h[0] for h in ref])
        assert_losses_close([h[1] for h in history], [h[1] for h in ref], "gradient norms")
    assert_same_weights([s for _, s in out], ref_shards, lr=LR, steps=STEPS)


def detected(kind):
    engine = paraxis.parallelize(_model(kind), plan=PLANS[kind], tensor=2,
                                 train={"seq_length": CFG.seq_length})
    names = sorted(rec.name for p in engine.model.parameters()
                   if "tensor" in (rec := paraxis.placement_of(p)).partial)
    engine.close()
    return names


def test_the_activation_parameters_are_found_partial_and_nothing_else(worlds):
    # The parity probe's backward finds them; norms outside the split region stay whole.
    for names in worlds.run(2, detected, "activation"):
        assert names == [f"layers.{i}.mlp.act.{p}" for i in range(2) for p in ("alpha", "beta")]


def moe_shards(style):
    plan = dataclasses.replace(PLANS["moe"], tensor={**PLANS["moe"].tensor,
                                                     "layers.*.mlp.experts.down_proj": style})
    engine = paraxis.parallelize(_model("moe"), plan=plan, tensor=2, verify=False,
                                 train={"seq_length": CFG.seq_length})
    shapes = {paraxis.placement_of(p).name: tuple(p.shape)
              for p in engine.model.parameters() if "experts" in paraxis.placement_of(p).name}
    engine.close()
    return shapes


def test_parameter_styles_split_the_documented_dimension(worlds):
    shapes = worlds.run(2, moe_shards, "rowwise")[0]
    assert shapes["layers.0.mlp.experts.gate_up_proj"] == (EXPERTS, 32, 32)  # 2 x I/2
    assert shapes["layers.0.mlp.experts.down_proj"] == (EXPERTS, 32, 16)  # I/2 inputs


def test_a_one_dimensional_rowwise_parameter_is_refused(worlds):
    plan = ModelPlan("TinyTransformer", tensor={"layers.*.attn_norm.weight": "rowwise"})
    for message in worlds.run(2, _refuse_plan, plan):
        assert "rowwise' on a 1-D parameter" in message


def _refuse_plan(plan):
    try:
        paraxis.parallelize(TinyTransformer(CFG), plan=plan, tensor=2, verify=False,
                            train={"seq_length": CFG.seq_length})
    except paraxis.PlanError as exc:
        return str(exc)
    return ""


class ScaledHead(nn.Linear):
    """A head with a learned scale per output feature (Dory's LM head)."""

    def __init__(self, cfg):
        super().__init__(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, cfg.vocab_size))

    def forward(self, x):
        return super().forward(x) * self.scale


def _scaled_head_model():
    torch.manual_seed(0)
    model = TinyTransformer(CFG)
    model.head = ScaledHead(CFG)
    return model


def train_scaled_head(degrees):
    engine = paraxis.parallelize(_scaled_head_model(), plan=TINY_PLAN, **degrees, train={
        "steps": STEPS, "lr": LR, "warmup_steps": 1, "seq_length": CFG.seq_length})
    g = torch.Generator().manual_seed(1)
    history = [engine.train_step(torch.randint(0, CFG.vocab_size, (4, CFG.seq_length),
                                               generator=g))["loss"] for _ in range(STEPS)]
    shards = local_shards(engine.model)
    engine.close()
    return history, shards


def test_a_column_modules_own_per_feature_parameters_are_split_with_it(worlds):
    # The vocabulary (61) is padded to 62; the scale's padding row is never used.
    ref, ref_shards = worlds.run(1, train_scaled_head, {})[0]
    out = worlds.run(2, train_scaled_head, {"tensor": 2})
    for losses, _ in out:
        assert_losses_close(losses, ref)
    assert_same_weights([s for _, s in out], ref_shards, lr=LR, steps=STEPS)
