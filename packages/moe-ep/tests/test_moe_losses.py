"""Router losses split over ranks against the model's own: a 2-layer tiny model with
every MoE block expert parallel, each rank its own sequences; the sum over ranks of each
rank's loss part must equal the loss transformers computes (``output_router_logits=True``,
``load_balancing_loss_func`` times ``router_aux_loss_coef``) on all sequences in one
process, and the summed gradients of the parts must equal that loss's gradient. Also:
logits of the whole model, and the per-layer, per-expert counts reduced over ranks."""

import copy

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")

from moe_tiny_models import NUM_EXPERTS, TOP_K, build

from paraxis.runtime.grid import DENSE_REPLICA_AXES, Grid
from paraxis.testing.tolerance import assert_losses_close, assert_step_close
from paraxis_moe import ExpertParallel, MoEConfig
from paraxis_moe.router import AUX_LOSS, Z_LOSS

LAYERS, B, S = 2, 2, 8


def _router_params(model):
    return [p for name, p in model.named_parameters()
            if ".mlp.gate." in name or ".mlp.router." in name]


def losses_parity(family, z_coef, data):
    """``data`` x ``world / data`` expert ranks; every rank holds distinct tokens."""
    n, r = dist.get_world_size(), dist.get_rank()
    grid = Grid.build({"data": data, "expert": n // data})
    model = build(family, layers=LAYERS)
    ref = copy.deepcopy(model)
    coef = model.config.router_aux_loss_coef
    ep = ExpertParallel(model, ["model.layers.*.mlp"], grid.group("expert"),
                        moe=MoEConfig(z_loss_coef=z_coef),
                        token_group=grid.group(DENSE_REPLICA_AXES))
    g = torch.Generator().manual_seed(7)
    ids = [torch.randint(0, 64, (B, S), generator=g) for _ in range(n)]

    out = ref(input_ids=torch.cat(ids), output_router_logits=True)
    lse = torch.logsumexp(torch.cat(out.router_logits).float(), -1)
    want = {AUX_LOSS: coef * out.aux_loss, Z_LOSS: z_coef * lse.square().mean()}
    want_grads = torch.autograd.grad(want[AUX_LOSS] + want[Z_LOSS], _router_params(ref))

    logits = model(input_ids=ids[r]).logits
    want_logits = out.logits[r * B:(r + 1) * B].detach()
    assert_step_close(logits.detach(), want_logits, "logits")
    parts = ep.losses.parts()
    assert sorted(parts) == sorted([AUX_LOSS, Z_LOSS])
    values = torch.stack([parts[AUX_LOSS], parts[Z_LOSS]]).detach()
    dist.all_reduce(values)
    grads = torch.autograd.grad(sum(parts.values()), _router_params(model))
    errors = {}
    for name, got in ((AUX_LOSS, values[0]), (Z_LOSS, values[1])):
        assert_losses_close([float(got)], [float(want[name])], name)
        expected = float(want[name].detach())
        errors[name] = abs(float(got) - expected) / expected
    for i, (got, expected) in enumerate(zip(grads, want_grads, strict=True)):
        got = got.clone()
        dist.all_reduce(got)
        scale = float(expected.abs().max())
        assert_step_close(got, expected, f"router gradient {i}")
        errors[f"grad{i}"] = float((got - expected).abs().max()) / scale

    # The counts, reduced over ranks, are the whole batch's routing, layer by layer.
    metrics = ep.step_metrics()
    for layer, layer_logits in enumerate(out.router_logits):
        chosen = torch.topk(torch.softmax(layer_logits, -1), TOP_K, -1).indices
        counts = torch.bincount(chosen.reshape(-1), minlength=NUM_EXPERTS)
        got = [metrics[f"moe/model.layers.{layer}.mlp/assigned/{e}"] for e in range(NUM_EXPERTS)]
        assert got == counts.tolist()
    assert metrics["moe/tokens_assigned"] == LAYERS * n * B * S * TOP_K
    assert metrics["moe/tokens_dropped"] == 0
    grid.destroy()
    return errors


@pytest.mark.parametrize(("n", "data"), [(2, 1), (4, 1), (4, 2)])
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss", "olmoe"])
def test_loss_parts_sum_to_the_models_own_loss(worlds, n, data, family):
    out = worlds.run(n, losses_parity, family, 1e-3, data)
    worst = {k: max(o[k] for o in out) for k in out[0]}
    print(f"{family} data={data} expert={n // data}: relative errors " +
          ", ".join(f"{k} {v:.1e}" for k, v in worst.items()))
