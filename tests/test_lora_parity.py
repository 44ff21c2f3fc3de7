"""LoRA through peft at parity with one process on every axis (issue 34, item 2): the
same peft model (Llama with adapters on attention and MLP; Mixtral with adapters on
attention) trained 20 steps on one process and under each layout; the first step's
gradients adapter by adapter, every step's loss and gradient norm, an evaluation loss
and every weight after the last step (the frozen ones must not have moved) agree at the
shared tolerances (tests/hf_parity.py, paraxis.testing.tolerance). One reference run per
model serves every layout.

Planted: a row-parallel base whose adapter is split on the wrong side (B by its rows,
as a column-parallel base's would be, instead of A by its columns) fails the check.
"""

import pytest
from hf_parity import compare

pytest.importorskip("peft")  # paraxis-hf[peft]

STEPS = 20
# Both kinds of base: column-parallel (q, k, v, gate, up) and row-parallel (o, down);
# dropout off, as parity needs.
LLAMA = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0,
         "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                            "down_proj"]}
ATTENTION = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0,
             "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}


@pytest.mark.parametrize(("degrees", "options"), [
    ({"data": 2}, {}),
    ({"tensor": 2}, {"sequence_parallel": True}),
    ({"pipeline": 2}, {"microbatches": 2}),
    ({"context": 2}, {}),
    ({"data": 2, "zero": 1}, {}),
    ({"data": 2, "zero": 2}, {}),
    ({"data": 2, "zero": 3}, {}),
], ids=["data2", "tensor2-sp", "pipeline2", "context2", "zero1", "zero2", "zero3"])
def test_lora_matches_one_process(worlds, degrees, options):
    compare(worlds, "llama", degrees, steps=STEPS, lora=LLAMA, **options)


def test_lora_on_attention_of_mixtral_over_expert_2(worlds):
    compare(worlds, "mixtral", {"expert": 2}, steps=STEPS, lora=ATTENTION)


def test_a_module_to_save_under_tensor_parallelism(worlds):
    """The head trained whole beside the adapters (peft's modules_to_save): the plan's
    style goes to its two copies, the trained one split like the head (4 steps)."""
    saved = {**ATTENTION, "modules_to_save": ["lm_head"]}
    compare(worlds, "llama", {"tensor": 2}, steps=4, lora=saved, sequence_parallel=True)


def test_lora_on_eight_ranks(worlds):
    compare(worlds, "llama", {"data": 2, "tensor": 2, "pipeline": 2}, steps=STEPS,
            lora=LLAMA, microbatches=2)


def _column_rule_on_a_row_base(model, adapter, group, memo, *, style, **row):
    """Planted: a row-parallel base's adapter split as a column-parallel base's is (B by
    its rows, A whole): the wrong side."""
    from paraxis_tp import adapters
    from paraxis_tp.layers import shard_row, sharded_parameter

    base, down, up, _ = adapters._parts(model, adapter, style)
    shard_row(model.get_submodule(adapter.module), group, memo, holders=(base,), **row)
    up.weight = sharded_parameter(up.weight, group, memo)
    up.out_features = up.weight.shape[0]
    return list(down.parameters())


def _adapter_after_the_reduction(model, adapter, group, memo, *, style, **row):
    """Planted: A split by its columns, B whole, but the base reduced alone (tensor
    parallelism applied to the base layer, as a plan matching ``base_layer`` would): the
    adapter's partial sum is never summed over the ranks."""
    from paraxis_tp import adapters
    from paraxis_tp.layers import shard_row, sharded_parameter

    base, down, up, _ = adapters._parts(model, adapter, style)
    shard_row(base, group, memo, **row)
    down.weight = sharded_parameter(down.weight, group, memo, dim=1)
    down.in_features = down.weight.shape[1]
    return list(up.parameters())


PLANTS = {"wrong-side": _column_rule_on_a_row_base,
          "after-reduction": _adapter_after_the_reduction}


def planted_train(plant, *args):
    """hf_parity.train with a row-parallel base's adapter split by ``plant``, and no
    parity probe at parallelize (which refuses both plants first: loss 3.8e-4 off, and
    the shape error), so that the comparison below is what must catch them."""
    import hf_parity

    import paraxis.engine.apply
    import paraxis_tp.apply

    original, probe = paraxis_tp.apply.shard_row_adapter, paraxis.engine.apply.Probe
    paraxis_tp.apply.shard_row_adapter = PLANTS[plant]
    paraxis.engine.apply.Probe = type("NoProbe", (), {"before": staticmethod(
        lambda *a, **k: None)})
    try:
        return hf_parity.train(*args)
    finally:
        paraxis_tp.apply.shard_row_adapter, paraxis.engine.apply.Probe = original, probe


@pytest.mark.parametrize(("plant", "failure"), [
    ("wrong-side", "shapes cannot be multiplied"),  # A whole meets this rank's features
    ("after-reduction", "differ from one process"),  # silent: only the numbers differ
])
def test_a_misplaced_adapter_of_a_row_parallel_base_fails(worlds, plant, failure):
    """Planted: each misplacement of the adapter of o_proj and down_proj fails the
    comparison the layouts above pass."""
    import functools

    from paraxis.testing.distributed import RankFailure

    with pytest.raises((AssertionError, RankFailure)) as failed:
        compare(worlds, "llama", {"tensor": 2}, steps=2, lora=LLAMA,
                worker=functools.partial(planted_train, plant))
    print(f"{plant}: {str(failed.value)[-300:]}")
    assert failure in str(failed.value)
