"""The planner's equations against the papers' own figures, without processes.

A figure printed with few digits is matched within 1% or within half a unit of its last
printed digit, whichever is wider (the paper's rounding is not our error).
"""

import pytest

from paraxis.planner.evaluate import make_layout
from paraxis.planner.inputs import Workload
from paraxis.planner.memory import layer_activation_bytes, model_state_bytes, rank_memory
from paraxis.planner.model import LayerCount, ModelCounts


def close(ours: float, paper: float, last_digit: float) -> bool:
    return abs(ours - paper) <= max(0.01 * abs(paper), last_digit / 2)


# ZeRO (Rajbhandari et al., arXiv:1910.02054), Table 1: per-device model-state memory in
# GB of a 7.5B-parameter model, mixed-precision Adam (K = 12), by data-parallel degree.
ZERO_TABLE_1 = {  # N_d: (baseline, P_os, P_os+g, P_os+g+p)
    1: (120, 120, 120, 120),
    4: (120, 52.5, 41.3, 30),
    16: (120, 35.6, 21.6, 7.5),
    64: (120, 31.4, 16.6, 1.88),
    256: (120, 30.4, 15.4, 0.47),
    1024: (120, 30.1, 15.1, 0.12),
}


@pytest.mark.parametrize("n", sorted(ZERO_TABLE_1))
def test_zero_model_states_match_table_1(n):
    for stage, paper in enumerate(ZERO_TABLE_1[n]):
        ours = sum(model_state_bytes(7.5e9, zero=stage, n_dense=n)) / 1e9
        digit = 0.01 if paper < 10 else 0.1
        assert close(ours, paper, digit), (n, stage, ours, paper)


def test_zero_expert_parameters_shard_over_data_x_context_only():
    # Dense over data x expert x context = 8, experts over data x context = 2.
    w, g, o = model_state_bytes(8e9, 4e9, zero=3, n_dense=8, n_expert=2)
    assert (w, g, o) == (2 * (1e9 + 2e9), 2 * (1e9 + 2e9), 12 * (1e9 + 2e9))
    assert sum(model_state_bytes(1e9, zero=0, n_dense=4, precision="fp32")) == 16e9


# Korthikanti et al. (arXiv:2205.05198): Table 3's GPT-3 175B (a = 96, h = 12288, L = 96,
# s = 2048, t = 8, p = 8), micro-batch 1. Per-layer bytes are their Table 2 formulas at
# this configuration: sbh = 25,165,824 and 5as/h = 80 (section 5 states the 80).
S, B, H, A, T, L = 2048, 1, 12288, 96, 8, 96
SBH = S * B * H
KORTHIKANTI_TABLE_2 = {  # (t, sequence parallel, recompute): bytes per layer
    (1, False, "none"): SBH * (34 + 80),  # 2.869 GB
    (8, False, "none"): SBH * (10 + 24 / 8 + 80 / 8),  # 579 MB
    (8, True, "none"): SBH * (34 / 8 + 80 / 8),  # 359 MB
    (8, False, "selective"): SBH * (10 + 24 / 8),  # 327 MB
    (8, True, "selective"): SBH * 34 / 8,  # 107 MB
    (1, False, "full"): SBH * 2,  # 50.3 MB
}


@pytest.mark.parametrize("key", sorted(KORTHIKANTI_TABLE_2, key=str))
def test_korthikanti_per_layer_activations_gpt3(key):
    t, sp, recompute = key
    ours = layer_activation_bytes(s=S, b=B, h=H, a=A, t=t, sp=sp, recompute=recompute)
    assert ours == pytest.approx(KORTHIKANTI_TABLE_2[key], rel=0.01)


def test_korthikanti_stated_savings_gpt3():
    assert 5 * A * S / H == 80  # section 5
    none = layer_activation_bytes(s=S, b=B, h=H, a=A)
    selective = layer_activation_bytes(s=S, b=B, h=H, a=A, recompute="selective")
    assert 1 - selective / none == pytest.approx(0.70, abs=0.005)  # "70%" (section 5)
    baseline = layer_activation_bytes(s=S, b=B, h=H, a=A, t=T)
    both = layer_activation_bytes(s=S, b=B, h=H, a=A, t=T, sp=True, recompute="selective")
    assert baseline / both > 5  # "reduces activation memory by 5x" (abstract)


def test_fp32_activations_double_all_but_the_dropout_masks():
    ours = layer_activation_bytes(s=S, b=B, h=H, a=A, element=4)
    assert ours == SBH * (66 + 9 * A * S / H)  # 16e+2 and 2e+1 at e = 4


def gpt3_counts(layers: int = L) -> ModelCounts:
    layer = LayerCount(matrices=12 * H * H, vectors=13 * H, experts=0)
    return ModelCounts(family="gpt", embedding=(51200 + S) * H, layers=(layer,) * layers,
                       final=2 * H, head=0, tied=True, non_embedding=layers * layer.total,
                       hidden_size=H, num_heads=A, kv_heads=A, head_dim=H // A,
                       vocab_size=51200, max_seq=S)


@pytest.mark.parametrize(("recompute", "per_layer_units"), [("none", 34 + 80),
                                                            ("selective", 34)])
def test_first_stage_holds_all_layers_activations_equation_5_and_6(recompute,
                                                                   per_layer_units):
    # Eq. 5 / Eq. 6: under 1F1B the first stage keeps p microbatches of L/p layers,
    # (sbhL/t)(34 + 5as/h) with sequence parallelism, 34·sbhL/t with selective recompute.
    work = Workload(seq=S, global_batch=64, micro_batch=1)
    layout = make_layout({"data": 1, "tensor": T, "pipeline": 8},
                         {"sequence_parallel": True, "activation_checkpointing": recompute},
                         work)
    ours = rank_memory(gpt3_counts(), layout, work, 0).activations
    assert ours == pytest.approx(SBH * L / T * per_layer_units, rel=0.01)


def test_interleaving_scales_first_stage_activations_by_1_plus_p_minus_1_over_pv():
    # Section 4.2.3: interleaved 1F1B multiplies the first stage's activations by
    # (1 + (p-1)/(p·m)) for m model chunks per rank (our v).
    work = Workload(seq=S, global_batch=64, micro_batch=1)
    plain = make_layout({"pipeline": 8}, {}, work)
    inter = make_layout({"pipeline": 8}, {"pipeline_schedule": "interleaved_1f1b",
                                          "virtual_stages": 2}, work)
    counts = gpt3_counts()
    ratio = (rank_memory(counts, inter, work, 0).activations
             / rank_memory(counts, plain, work, 0).activations)
    assert ratio == pytest.approx(1 + 7 / (8 * 2), rel=1e-9)
