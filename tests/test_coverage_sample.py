"""The coverage matrix's fixed sample, in ``nox -s tests``: families with a quirk that a
shard or a stage must keep, through the matrix's own runner (the reference on a world
of one, each check on two ranks: every parameter's gradient, per-step loss and gradient
norm at the shared tolerance, and the shard proof of each sharding layout).
``nox -s coverage`` runs every family and rewrites docs/coverage.md."""

import pytest

from paraxis_coverage import available_checks, run_family
from paraxis_coverage.runner import OWN_LOSS
from paraxis_hf.families import build_family, causal_lm_types

SAMPLE = {
    "gemma2": "scaled embeddings, attention and logit softcapping, sliding-window layers",
    "smollm3": "NoPE layers, tied embeddings",
    "phi3": "fused qkv and gate_up projections (colwise_gather_output)",
    "qwen2": "biases on q, k and v",
    "gpt_neox": "parallel attention and MLP, its own module names",
    "mixtral": "mixture of experts: experts kept whole under tensor parallelism, router "
               "loss per microbatch under a pipeline, each tensor rank routing its "
               "sequence shard under SP",
    "deepseek_v3": "DeepSeek-V3 routing (sigmoid, correction bias, sequence-wise loss); "
                   "a dense first layer, so a stage may hold no biased router; multi-head "
                   "latent attention the tensor plan leaves whole, run on the whole "
                   "sequence on every tensor rank under SP",
    "kimi_linear": "linear attention (KDA) and short convolutions the tensor plan leaves "
                   "whole, run on the whole sequence on every tensor rank under SP; "
                   "experts kept whole",
    "nemotron_h": "hybrid Mamba / attention / MoE layers whose block is always named "
                  "'mixer': under SP the MoE one routes its rank's tokens (not run whole), "
                  "its experts split over tensor (expert_tensor)",
    "qwen3_5_moe_text": "gated delta-net linear attention whose projections the tensor "
                        "plan shards (colwise_gather_output) without entering it: run "
                        "whole under SP, those projections entering as Megatron's f",
}
# The columns this package answers for (expert and context belong to their axes).
COLUMNS = (OWN_LOSS, "data=2", "tensor=2", "tensor=2 SP", "pipeline=2")
# Cells refused at parallelize time, by design, with words the reason must hold.
REFUSED: dict[tuple[str, str], str] = {
    ("nemotron_h", "pipeline=2"): "NemotronHForCausalLM has no pipeline-parallel plan"}


@pytest.mark.parametrize("family", sorted(SAMPLE))
def test_a_family_with_a_quirk_passes_every_column(worlds, family):
    checks = [c for c in available_checks() if c.name in COLUMNS]
    row = run_family(build_family(family, causal_lm_types()[family]), checks, worlds)
    for column in COLUMNS:
        cell, reason = row.cells[column], REFUSED.get((family, column))
        if reason is None:
            assert cell.status == "pass", (SAMPLE[family], column, cell.cell())
            if column.startswith(("tensor", "pipeline")):  # the shard proof said so, at
                assert "of the model, as the" in cell.detail, cell.cell()  # the share due
        else:
            assert cell.status == "refused" and reason in cell.detail, (column, cell.cell())


def test_a_family_without_plans_is_refused_with_the_reason(worlds):
    checks = [c for c in available_checks() if c.name in COLUMNS]
    row = run_family(build_family("gpt2", "GPT2LMHeadModel"), checks, worlds)
    assert row.cells[OWN_LOSS].status == row.cells["data=2"].status == "pass"
    for column, axis in [("tensor=2", "tensor"), ("pipeline=2", "pipeline")]:
        cell = row.cells[column]
        assert cell.status == "refused", cell
        assert f"GPT2LMHeadModel has no {axis}-parallel plan" in cell.detail


# Cells whose runs part from one process by reduction noise the model amplifies (a first
# AdamW step normalizes gradients at the noise floor): each fails the per-step comparison
# and passes only as ill-conditioned, with the evidence (paraxis_coverage.drift).
ILL_CONDITIONED = {"gemma4_text": ("tensor=2", "context=2"), "gemma3n_text": ("context=2",)}


@pytest.mark.parametrize("family", sorted(ILL_CONDITIONED))
def test_an_ill_conditioned_family_passes_from_the_reference_weights(worlds, family):
    columns = ILL_CONDITIONED[family]
    checks = [c for c in available_checks() if c.name in columns]
    assert [c.name for c in checks] == list(columns)
    row = run_family(build_family(family, causal_lm_types()[family]), checks, worlds)
    for column in columns:
        cell = row.cells[column]
        assert cell.status == "explained", (column, cell.cell())
        assert "ill-conditioned: from the reference's weights each step agrees" in cell.detail


# Families whose tensor=2 SP cell failed with a shape error the probe caught (one
# column, through the matrix's runner: per-parameter gradients and the shard proof).
SEQUENCE_PARALLEL = {
    "dory": "a looped model calling its first layer twice per forward (the split is "
            "made once per forward)",
    "inkling_text": "a row-parallel head (rowwise_split_input: gathered sequence, logits "
                    "all-reduced) and shared experts weighted by a (batch x sequence, 1) "
                    "tensor beside the (batch, sequence, hidden) input, gathered per sample",
}


@pytest.mark.parametrize("family", sorted(SEQUENCE_PARALLEL))
def test_a_family_passes_tensor_parallel_with_sequence_parallelism(worlds, family):
    checks = [c for c in available_checks() if c.name == "tensor=2 SP"]
    row = run_family(build_family(family, causal_lm_types()[family]), checks, worlds)
    cell = row.cells["tensor=2 SP"]
    assert cell.status == "pass", (SEQUENCE_PARALLEL[family], cell.cell())
    assert "of the model, as the" in cell.detail, cell.cell()
