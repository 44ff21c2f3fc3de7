"""The parity probe's rules that need no ranks (issue 32): the global microbatches its
reference runs the router loss on, the coefficient it weights the model's own router
loss by, and each parameter's slack under a bf16 reduction."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from paraxis import ParallelConfig
from paraxis.engine.probe import ParityError, Probe
from paraxis.engine.probe_model import global_microbatches, own_router_coef
from paraxis.parallel.batch import Batch
from paraxis.parallel.numerics import BF16_UNIT_ROUNDOFF, REDUCTION_RTOL, bf16_wire_rtol


@pytest.mark.parametrize(("shards", "microbatches"), [(1, 1), (1, 2), (2, 1), (2, 2), (4, 2)])
def test_global_microbatches_are_what_the_ranks_run(shards, microbatches):
    """Microbatch i of every rank holding distinct samples, as the engine cuts each
    rank's share (``Batch.chunk``) of the probe batch (consecutive rows per rank)."""
    rows = 2 * shards * microbatches
    ids = torch.arange(rows).unsqueeze(1).repeat(1, 4)
    per = rows // shards
    ranks = [Batch.from_user(ids[r * per:(r + 1) * per]).chunk(microbatches)
             for r in range(shards)]
    want = [sorted(int(x) for r in range(shards) for x in ranks[r][i].input_ids[:, 0])
            for i in range(microbatches)]
    got = [sorted(g.tolist()) for g in global_microbatches(rows, shards, microbatches)]
    assert got == want


def test_the_router_coefficient_is_the_models_own_unless_the_run_overrides_it():
    model = nn.Linear(2, 2)
    model.router_aux_loss_coef = 0.02
    assert own_router_coef(model, ParallelConfig())[0] == 0.02
    jetmoe = nn.Linear(2, 2)
    jetmoe.aux_loss_coef = 0.01
    assert own_router_coef(jetmoe, ParallelConfig())[0] == 0.01
    override = ParallelConfig.model_validate({"moe": {"aux_loss_coef": 0.5}})
    assert own_router_coef(model, override)[0] == 0.5
    # What the reference cannot hold is left out on both sides, and said.
    coef, said = own_router_coef(nn.Linear(2, 2), ParallelConfig())
    assert coef is None and "no router_aux_loss_coef" in said
    z_loss = ParallelConfig.model_validate({"moe": {"z_loss_coef": 1e-3}})
    coef, said = own_router_coef(model, z_loss)
    assert coef is None and "z-loss" in said


# The debug Llama's smallest norm weight holds 8.7e-4 of the gradient's norm
# (tests/test_planted_gradient.py); a probe of two parameters with those shares.
SHARE = 8.7e-4


def _engine(reduce_dtype: str, ranks: int = 2) -> SimpleNamespace:
    config = SimpleNamespace(parallelism=SimpleNamespace(reduce_dtype=reduce_dtype),
                             token_replicas=ranks)
    return SimpleNamespace(config=config, plan=SimpleNamespace(model_class="Llama"))


def _probe() -> Probe:
    norms = {"norm.weight": SHARE, "embed.weight": (1 - SHARE**2) ** 0.5}
    return Probe(torch.zeros(1, 1), 1.0, norms, rtol=REDUCTION_RTOL)


def test_bf16_reduction_slack_is_relative_to_each_parameters_own_norm():
    probe = _probe()
    doubled = dict(probe.grad_norms, **{"norm.weight": 2 * SHARE})
    with pytest.raises(ParityError, match=r"gradient of norm\.weight"):
        probe._compare_gradients(_engine("bf16"), "data 2", doubled)
    # The old slack, 2^-7 of the parameter's norm plus 2^-7 of the whole, passed it.
    old_slack = 2 * BF16_UNIT_ROUNDOFF * (SHARE + probe.grad_norm)
    assert old_slack >= SHARE
    # The wire's own rounding passes: every element off by u of itself, in one sense...
    rounded = {n: v * (1 + bf16_wire_rtol(2)) for n, v in probe.grad_norms.items()}
    probe._compare_gradients(_engine("bf16"), "data 2", rounded)
    # ...and an fp32 reduction is held to fp32's budget.
    with pytest.raises(ParityError):
        probe._compare_gradients(_engine("fp32"), "data 2", rounded)


def test_the_wire_budget_grows_with_the_ranks_adding_in_bf16():
    """Each part rounded once, then ``ranks - 1`` additions rounded: ranks x u."""
    assert bf16_wire_rtol(2) == 2 * BF16_UNIT_ROUNDOFF
    assert bf16_wire_rtol(8) == 8 * BF16_UNIT_ROUNDOFF
    probe = _probe()
    off = {n: v * (1 + 5 * BF16_UNIT_ROUNDOFF) for n, v in probe.grad_norms.items()}
    with pytest.raises(ParityError):
        probe._compare_gradients(_engine("bf16", ranks=2), "data 2", off)
    probe._compare_gradients(_engine("bf16", ranks=8), "data 8", off)
