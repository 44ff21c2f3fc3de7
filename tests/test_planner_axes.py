"""The planner with every axis package installed: core's own tests run with core alone
(the README's test command runs each package by itself), so what the planner takes
from other packages is tested here, where all of them are installed: Hugging Face
models counted on the meta device (paraxis-hf), the simulated pipeline bubble
(paraxis-pp-schedules' ``paraxis_pipeline_bubble`` hook) and the tensor axis's rules
through validation (paraxis-tp-layers)."""

import pytest
import torch

from paraxis import make_plugin_manager
from paraxis.planner.evaluate import make_layout, problems
from paraxis.planner.inputs import Workload
from paraxis.planner.model import ModelCounts, ModelSource, build_on_meta, count_model
from paraxis.planner.schedule import bubble, closed_form_bubble

WORK = Workload(seq=2048, global_batch=64, micro_batch=1)


def llama7b() -> ModelCounts:
    """Llama-2-7B's shape, counted on the meta device."""
    source = ModelSource("llama", {
        "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000}, "test", {})
    return count_model(build_on_meta(source, make_plugin_manager()), "llama")


def close(ours: float, paper: float, last_digit: float) -> bool:
    return abs(ours - paper) <= max(0.01 * abs(paper), last_digit / 2)


# Narayanan et al. (arXiv:2104.04473): parameter counts of their GPT models, V = 51,200,
# s = 2048, from P = 12lh²(1 + 13/(12h) + (V+s)/(12lh)). Table 1 rows 1.7B and 1008.0B;
# the 174.6B GPT-3 of Table 2. Counted exactly on a meta-device GPT-2 of that shape.
NARAYANAN = [  # (billions as printed, heads, hidden, layers)
    (1.7, 24, 2304, 24),
    (174.6, 96, 12288, 96),
    (1008.0, 160, 25600, 128),
]


def test_hf_mixture_of_experts_counts():
    # Mixtral 8x7B: 46.7B parameters, 12.9B active per token (Jiang et al., arXiv:2401.04088
    # and its model card).
    source = ModelSource("mixtral", {
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000,
        "num_local_experts": 8, "num_experts_per_tok": 2}, "test", {})
    with torch.device("meta"):
        c = count_model(build_on_meta(source, make_plugin_manager()), "mixtral")
    assert c.total / 1e9 == pytest.approx(46.7, rel=0.01)
    assert (c.active_non_embedding + c.embedding) / 1e9 == pytest.approx(12.9, rel=0.01)
    assert c.moe_layers == 32 and c.expert_params == 32 * 8 * 3 * 4096 * 14336
    assert not c.tied and c.head == 32000 * 4096


@pytest.mark.parametrize(("billions", "heads", "hidden", "layers"), NARAYANAN)
def test_parameter_counts_match_narayanan(billions, heads, hidden, layers):
    source = ModelSource("gpt2", {"n_embd": hidden, "n_layer": layers, "n_head": heads,
                                  "vocab_size": 51200, "n_positions": 2048}, "test", {})
    counts = count_model(build_on_meta(source, make_plugin_manager()), "gpt2")
    assert close(counts.total / 1e9, billions, 0.1), counts.total
    assert counts.tied and counts.head == 0  # the tied head is counted once
    # The formula expanded in integers: 12lh² + 13lh + (V + s)h.
    formula = 12 * layers * hidden**2 + 13 * layers * hidden + (51200 + 2048) * hidden
    assert counts.total - formula == 2 * hidden  # GPT-2's final norm, all else identical


def test_simulator_agrees_with_the_closed_form_when_installed():
    for schedule, v in (("1f1b", 1), ("gpipe", 1), ("interleaved_1f1b", 2),
                        ("zero_bubble_h1", 1)):
        simulated = bubble(schedule, 4, 8, v)
        assert simulated.source.startswith("simulated")
        assert simulated.fraction == pytest.approx(closed_form_bubble(schedule, 4, 8, v)
                                                   .fraction, abs=0.02)
    assert bubble("1f1b", 4, 8, simulate=False).source == "closed form"


def test_evaluate_problems_come_from_validation():
    layout = make_layout({"tensor": 3}, {}, WORK)
    fields = {p.field for p in problems(llama7b(), layout, WORK, world_size=3)}
    assert {"model.hidden_size", "model.num_attention_heads"} <= fields
    layout = make_layout({"data": 3}, {}, WORK)
    assert [p.field for p in problems(llama7b(), layout, WORK)] == ["global_batch"]
