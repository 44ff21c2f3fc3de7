"""The activation-bytes counter the plan will be checked against."""

import torch
from torch import nn

from paraxis.planner.measure import SavedActivations


def test_counts_each_saved_storage_once_and_skips_parameters():
    torch.manual_seed(0)
    lin = nn.Linear(16, 32, bias=False)
    x = torch.randn(4, 16, requires_grad=True)
    with SavedActivations(exclude=lin.parameters()) as saved:
        y = lin(x)  # saves x (and the weight, excluded)
        z = torch.tanh(y)  # saves its output
        (z * z).sum()  # saves z twice: one storage
    assert saved.bytes == 4 * 16 * 4 + 4 * 32 * 4
    with SavedActivations() as everything:
        lin(x)
    assert everything.bytes == 4 * 16 * 4 + 32 * 16 * 4


def test_checkpointed_region_counts_only_its_input():
    from torch.utils.checkpoint import checkpoint

    block = nn.Sequential(nn.Linear(8, 64), nn.GELU(), nn.Linear(64, 8))
    x = torch.randn(2, 8, requires_grad=True)
    with SavedActivations(exclude=block.parameters()) as plain:
        block(x)
    with SavedActivations(exclude=block.parameters()) as kept:
        checkpoint(block, x, use_reentrant=False)
    assert kept.bytes < plain.bytes
