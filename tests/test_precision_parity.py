"""Precision parity that can fail (issue 32): bf16 and fp16 runs against one process in
the same precision, and fp16's gradients against fp32's.

* Six layouts (data 2, ZeRO-3, tensor 2 + SP, pipeline 2, expert 2, context 2; in bf16
  also ZeRO-1, ZeRO-2 and tensor 2 + SP with the overlapped ring) train plain SGD (no
  momentum, clipping or weight decay) against one process in the same precision: the
  first step's per-parameter gradients, per-step losses and gradient norms, an eval loss
  and the weights after the steps, each at its derived tolerance
  (paraxis.testing.tolerance: the loss's from the logits' rounding averaged over the
  tokens, the weights' relative to how far SGD moved them). SGD's update is the
  gradient times the rate, so a wrong rate, a doubled gradient or a skipped update
  moves the weights by their whole displacement, where Adam would hide the scale.
  ``pytest -s`` prints the worst differences against what is allowed.
* fp16: the gradients the optimizer steps (scaled backward, unscaled) against fp32's
  on the same weights, per parameter; the engine's ``fp32_backward`` in fp16 gives the
  same; a missing unscale fails.

Mixtral routes every token to all four experts here (top-4 of 4): a top-2 router is
discontinuous, and in low precision a layout can round two experts' near-equal scores
the other way and send a token elsewhere (3 of 1,536 routings over six bf16 SGD steps,
1 in fp16, measured on expert 2), moving a whole token's term between experts rather
than a rounding. Expert selection is compared where no such flip happens, in fp32
(tests/test_moe_models.py).
"""

from __future__ import annotations

import pytest
import torch
from hf_parity import compare

import paraxis
from paraxis import ParallelConfig
from paraxis.testing.parity import (
    assemble,
    local_gradients,
    random_token_shares,
    stepped_gradients,
)
from paraxis.testing.tolerance import (
    BF16_RTOL,
    assert_gradients_close,
    gradient_errors,
    rtol_against_fp32,
    sgd_weight_errors,
)
from paraxis_hf import DEBUG_CONFIGS, build_debug_model

STEPS = 4
# Plain SGD at a rate where a step moves the loss more than a layout does (a rate of
# 1e-3 moves it by less: 2e-5 over six steps, measured; the weights still see it).
SGD = {"optimizer": "sgd", "optimizer_kwargs": {"momentum": 0.0}, "grad_clip": 0.0,
       "weight_decay": 0.0, "lr": 0.1}
EVERY_TOKEN_TO_EVERY_EXPERT = {"num_experts_per_tok": 4}
LAYOUTS = {
    "data2": ("llama", {"data": 2}, {}),
    "zero3": ("llama", {"data": 2}, {"zero": 3}),
    "tensor2_sp": ("llama", {"tensor": 2}, {"sequence_parallel": True}),
    "pipeline2": ("llama", {"pipeline": 2}, {"microbatches": 2}),
    "expert2": ("mixtral", {"expert": 2}, {}),
    "context2": ("llama", {"context": 2}, {}),
}
BF16_ONLY = {
    "zero1": ("llama", {"data": 2}, {"zero": 1}),
    "zero2": ("llama", {"data": 2}, {"zero": 2}),
    "tensor2_sp_overlap": ("llama", {"tensor": 2},
                           {"sequence_parallel": True, "tensor_overlap": "on"}),
}
CASES = [(p, layout) for p in ("bf16", "fp16") for layout in LAYOUTS] + \
    [("bf16", layout) for layout in BF16_ONLY]


@pytest.mark.parametrize("precision,layout", CASES, ids=[f"{p}-{lay}" for p, lay in CASES])
def test_sgd_matches_one_process_in_the_same_precision(worlds, precision, layout):
    family, degrees, options = {**LAYOUTS, **BF16_ONLY}[layout]
    overrides = EVERY_TOKEN_TO_EVERY_EXPERT if family == "mixtral" else None
    compare(worlds, family, degrees, overrides=overrides, steps=STEPS,
            recipe={**SGD, "precision": precision}, **options)


def test_the_sgd_weight_bound_takes_the_masters_rounding_not_a_lost_update():
    """Without processes: four SGD steps of a small update on fp32 weights, rounded each
    step. Another run whose updates differ by half the gradients' tolerance passes
    (its fp32 roundings included); one whose last update is lost fails."""
    g = torch.Generator().manual_seed(0)
    initial = torch.randn(64, 64, generator=g) * 0.02
    updates = [torch.randn(64, 64, generator=g) * 1e-5 for _ in range(STEPS)]
    want, near, lost = initial.clone(), initial.clone(), initial.clone()
    for i, update in enumerate(updates):
        want += update
        near += update * (1 + BF16_RTOL / 2 * torch.randn(64, 64, generator=g).clamp(-1, 1))
        lost += 0 if i == STEPS - 1 else update
    errors = {name: sgd_weight_errors({"w": got}, {"w": want}, {"w": initial},
                                      rtol=BF16_RTOL, steps=STEPS)["w"]
              for name, got in (("near", near), ("lost", lost))}
    assert errors["near"] <= 1 < errors["lost"], errors


# ---- fp16's gradients against fp32's ----------------------------------------------------

FP16_SGD = {**SGD, "precision": "fp16", "steps": 1, "seq_length": 16}


def fp16_gradients(degrees, options, skip_unscale=False):
    """One fp16 step's gradients as the optimizer steps them, as ``fp32_backward`` takes
    them in fp16, and in fp32, on the same weights and batch; and the loss scale."""
    import paraxis.engine.optim as optim

    unscale = optim.unscale_and_check
    if skip_unscale:  # the planted defect: the overflow check without the unscale
        optim.unscale_and_check = lambda params, inv_scale, grid: unscale(params, 1.0, grid)
    try:
        config = ParallelConfig.from_kwargs(**degrees, **options)
        model = build_debug_model("llama")
        engine = paraxis.parallelize(model, config=config, train=FP16_SGD)
        share = random_token_shares(engine, steps=1, batch=8, seq=16,
                                    vocab=model.config.vocab_size)[0]
        fp32 = local_gradients(engine, share)
        in_fp16 = local_gradients(engine, share, in_precision=True)
        with stepped_gradients(engine) as stepped:
            scale = engine.train_step(share)["loss_scale"]
        engine.close()
    finally:
        optim.unscale_and_check = unscale
    return stepped, in_fp16, fp32, scale


FP16_LAYOUTS = {"one_process": ({}, {}),
                "tensor2_sp_pipeline2": ({"tensor": 2, "pipeline": 2},
                                         {"sequence_parallel": True, "microbatches": 2})}


def _fp16_against_fp32(worlds, layout, skip_unscale=False):
    degrees, options = FP16_LAYOUTS[layout]
    size = ParallelConfig.from_kwargs(**degrees, **options).world_size
    out = worlds.run(size, fp16_gradients, degrees, options, skip_unscale)
    stepped, in_fp16, fp32 = (assemble([o[i] for o in out]) for i in range(3))
    layers = DEBUG_CONFIGS["llama"]["num_hidden_layers"]
    return stepped, in_fp16, fp32, out[0][3], rtol_against_fp32("fp16", layers=layers)


@pytest.mark.parametrize("layout", list(FP16_LAYOUTS))
def test_fp16_steps_the_fp32_gradients(worlds, layout):
    """What the optimizer steps under fp16 is the fp32 gradient within fp16's rounding,
    parameter by parameter; the loss scale (2^16) was in effect, so an unscale missing
    or applied twice would be off by 2^16."""
    stepped, in_fp16, fp32, scale, rtol = _fp16_against_fp32(worlds, layout)
    assert scale == 2.0**16, scale
    assert stepped.keys() == fp32.keys(), "the step was skipped or missed parameters"
    assert_gradients_close(stepped, fp32, rtol=rtol)
    # The parity harness's first-step gradients in fp16 are these (same arithmetic).
    assert all(torch.equal(in_fp16[k], stepped[k]) for k in stepped)


def test_a_missing_unscale_fails(worlds):
    """The planted defect: the overflow check runs, the unscale does not. Every gradient
    the optimizer steps is then the loss scale times too large."""
    stepped, _, fp32, scale, rtol = _fp16_against_fp32(worlds, "one_process",
                                                       skip_unscale=True)
    with pytest.raises(AssertionError, match="differ from one process"):
        assert_gradients_close(stepped, fp32, rtol=rtol)
    worst = max(gradient_errors(stepped, fp32).values())
    assert abs(worst - (scale - 1)) <= rtol * scale, (worst, scale)
