"""Through ``parallelize`` in one process (the expert axis applies to every MoE model,
at expert degree 1 too): paraxis's loss, language model plus router losses, equals the
model's own loss with ``output_router_logits=True``; the coefficients follow the ``moe``
section; every ``moe/`` metric is reported each step."""

import copy

import pytest
import torch

pytest.importorskip("transformers")

from moe_tiny_models import build, plan_of

import paraxis
from paraxis.testing.tolerance import assert_losses_close

FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "ernie4_5_moe", "olmoe", "gpt_oss"]
METRICS = ("moe/aux_loss", "moe/z_loss", "moe/tokens_assigned", "moe/tokens_dropped",
           "moe/dropped_fraction", "moe/load_imbalance", "moe/dispatch_bytes",
           "moe/dispatch_s", "moe/expert_compute_s", "moe/router_entropy")


def one_process(family, moe):
    model = build(family, layers=2)
    ref = copy.deepcopy(model)
    engine = paraxis.parallelize(model, plan=plan_of(model), moe=moe,
                                 train={"seq_length": 8, "lr": 1e-3})
    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        own = ref(input_ids=ids, labels=ids, output_router_logits=True, use_cache=False)
    lse = torch.logsumexp(torch.cat(own.router_logits).float(), -1).square().mean()
    m = engine.train_step(ids)
    last = engine.ctx.extras["expert"].last_step
    engine.close()
    return m, float(own.loss), float(own.aux_loss), float(lse), last


@pytest.mark.parametrize("family", FAMILIES)
def test_loss_plus_router_loss_is_the_models_own(worlds, family):
    m, own, _, _, last = worlds.run(1, one_process, family, {})[0]
    assert_losses_close([m["loss"] + m["moe/aux_loss"]], [own], "LM + router loss")
    assert m["moe/aux_loss"] > 0 and m["moe/z_loss"] == 0.0
    for key in METRICS:
        assert key in m, key
    assert m["moe/tokens_assigned"] == 2 * 4 * 8 * 2 and m["moe/tokens_dropped"] == 0
    blocks = list(last)
    assert len(blocks) == 2 and last[blocks[0]]["assigned"].numel() == 4
    assert m[f"moe/{blocks[1]}/assigned/3"] == float(last[blocks[1]]["assigned"][3])


def test_coefficients_follow_the_moe_section(worlds):
    m, _, aux, z, _ = worlds.run(1, one_process, "mixtral",
                                         {"aux_loss_coef": 0.5, "z_loss_coef": 1e-2})[0]
    assert_losses_close([m["moe/aux_loss"], m["moe/z_loss"]], [0.5 * aux, 1e-2 * z],
                        "router losses")
    off = worlds.run(1, one_process, "mixtral", {"aux_loss_coef": 0})[0][0]
    assert off["moe/aux_loss"] == 0.0
