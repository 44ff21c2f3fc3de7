"""Activation checkpointing with every axis, on Qwen3 (q/k norms), against one process.

Recomputation used to crash on pipeline stages (``embed_tokens is not an nn.Module`` on
stage 1: the layer lookup assumed the whole model). Each stage now wraps only the layers
it runs, so full and selective recomputation train at parity with pipeline, tensor +
sequence parallel and data parallel, and all three together.
"""

import pytest
from hf_parity import compare

FOUR_LAYERS = {"num_hidden_layers": 4}


@pytest.mark.parametrize("mode", ["full", "selective"])
@pytest.mark.parametrize("degrees", [
    {"pipeline": 2},
    {"tensor": 2, "sequence_parallel": True},
    {"data": 2},
], ids=lambda d: "x".join(f"{k}{v}" for k, v in d.items() if k != "sequence_parallel"))
def test_recomputation_with_each_axis(worlds, mode, degrees):
    compare(worlds, "qwen3", degrees, overrides=FOUR_LAYERS, microbatches=4,
            activation_checkpointing=mode, steps=6)


def test_recomputation_with_every_axis_at_once(worlds):
    compare(worlds, "qwen3", {"pipeline": 2, "tensor": 2, "sequence_parallel": True,
                              "data": 2},
            overrides=FOUR_LAYERS, microbatches=2, activation_checkpointing="selective",
            steps=4)
