"""Context parallelism on Hugging Face families through ``parallelize``, against one
process: 20 steps at sequence 256, fp32; per-step losses and gradient norms, an
evaluation loss and the gathered final weights at the shared tolerance
(tests/hf_parity.py, paraxis.testing.tolerance).

Ring and Ulysses on 2 and 4 context ranks, and context 2 with data 2, tensor 2 (with
and without sequence parallel) and pipeline 2, on Llama, Qwen2 (q/k/v biases) and
Mistral with a sliding window that does not fall on shard boundaries. Debug models:
hidden 32, 2 layers, 4 heads / 2 kv heads, so Ulysses over 4 ranks repeats kv heads.
"""

import pytest
from hf_parity import compare

STEPS, SEQ, BATCH = 20, 256, 4
FAMILIES = {
    "llama": {"max_position_embeddings": SEQ},
    "qwen2": {"max_position_embeddings": SEQ},
    "mistral": {"max_position_embeddings": SEQ, "sliding_window": 100},
}
LAYOUTS = [
    pytest.param({"context": 2}, {}, id="ring2"),
    pytest.param({"context": 2}, {"context_mode": "ulysses"}, id="ulysses2"),
    pytest.param({"context": 4}, {}, id="ring4"),
    pytest.param({"context": 4}, {"context_mode": "ulysses"}, id="ulysses4"),
    pytest.param({"context": 2, "data": 2}, {}, id="ring2-data2"),
    pytest.param({"context": 2, "tensor": 2}, {"context_mode": "ulysses"},
                 id="ulysses2-tensor2"),
    pytest.param({"context": 2, "pipeline": 2}, {"microbatches": 2}, id="ring2-pipeline2"),
]


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize(("degrees", "options"), LAYOUTS)
def test_context_parallel_matches_one_process(worlds, family, degrees, options):
    compare(worlds, family, degrees, overrides=FAMILIES[family], steps=STEPS, seq=SEQ,
            batch=BATCH, **options)


@pytest.mark.parametrize("mode", ["ring", "ulysses"])
def test_context_with_sequence_parallel_tensor(worlds, mode):
    """Tensor x sequence parallel cuts each context shard again and gathers it at every
    block's input; Ulysses then splits the tensor rank's heads over context."""
    compare(worlds, "llama", {"context": 2, "tensor": 2}, overrides=FAMILIES["llama"],
            steps=STEPS, seq=SEQ, batch=BATCH, sequence_parallel=True, context_mode=mode)


def test_context_with_pipeline_ulysses_and_data(worlds):
    """Stages pass sequence-sharded hidden states; position ids reach every stage."""
    compare(worlds, "qwen2", {"context": 2, "pipeline": 2}, overrides=FAMILIES["qwen2"],
            steps=STEPS, seq=SEQ, batch=BATCH, microbatches=2, context_mode="ulysses")


@pytest.mark.parametrize("family", ["roberta", "xlm-roberta-xl"])
def test_positions_the_model_makes_itself_follow_the_shard(worlds, family):
    """The RoBERTa family makes its own positions when given none (from padding_idx + 1,
    skipping pads): each rank's shard gets those of its place in the whole row, made by
    the model's own function (0..s-1 cut by the layout trained 4e-3 off one process)."""
    from paraxis_coverage import available_checks, run_family
    from paraxis_hf.families import build_family, causal_lm_types

    checks = [c for c in available_checks() if c.name == "context=2"]
    row = run_family(build_family(family, causal_lm_types()[family]), checks, worlds)
    assert row.cells["context=2"].status == "pass", row.cells["context=2"].cell()
