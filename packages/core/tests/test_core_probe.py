"""The parity probe's rules that need no ranks (issue 32): the global microbatches its
reference runs the router loss on and the coefficient it weights the model's own router
loss by."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from paraxis import ParallelConfig
from paraxis.engine.probe import global_microbatches, own_router_coef
from paraxis.parallel.batch import Batch


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
