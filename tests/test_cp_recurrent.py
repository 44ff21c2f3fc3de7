"""Recurrent layers under context parallelism (issue 35) through ``parallelize``, against
one process: per-parameter first-step gradients, 20 steps of losses and gradient
norms, an evaluation loss and the final weights at the shared tolerance
(tests/hf_parity.py, paraxis.testing.tolerance), fp32.

Each rank runs its chunks of every Mamba / gated-delta-rule / convolution layer from a
zero state and passes the boundary state (and the convolution's last inputs) across
ranks (paraxis_seq.recurrent). Families: Bamba and Nemotron-H (Mamba-2 hybrids with
attention; Nemotron-H with MoE and MLP layers), Qwen3-Next (gated delta rule, MoE),
Mamba (a pure Mamba-1 SSM). Debug models (paraxis_hf.debug): hidden 32, 2 to 4 layers.
"""

import pytest
from hf_parity import compare

STEPS, SEQ, BATCH = 20, 128, 4
FAMILIES = {
    "bamba": {"max_position_embeddings": SEQ},
    "nemotron_h": {"max_position_embeddings": SEQ},
    "qwen3_next": {"max_position_embeddings": SEQ},
    "mamba": {},
}
LAYOUTS = [
    pytest.param({"context": 2}, {}, id="ring2"),
    pytest.param({"context": 4}, {}, id="ring4"),
]


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize(("degrees", "options"), LAYOUTS)
def test_recurrent_context_matches_one_process(worlds, family, degrees, options):
    compare(worlds, family, degrees, overrides=FAMILIES[family], steps=STEPS, seq=SEQ,
            batch=BATCH, **options)
