"""The one parity tolerance every paraxis test uses, and why it is what it is.

The budget of one step's numbers is :data:`paraxis.parallel.numerics.REDUCTION_RTOL` (1e-5): a
parallel run sums the same terms as its one-process reference in another order, and in
fp32 two orders of a sum of up to 2.5·10^4 terms differ by ≲ u·√n ≈ 1e-5 relative (the
derivation is in :mod:`paraxis.parallel.numerics`, shared with paraxis's own checks).

* :data:`STEP_RTOL` (1e-5): the loss, the gradient norm and the first step's gradients.
  Later steps' losses use it too: over the ≤ 20-step runs of this suite the weights
  differ by far less than a loss can resolve (next bullet), so the loss noise stays one
  step's. *Derived* (u·√n for the suite's reductions, n ≤ 2.5·10^4).

* Gradients are compared per parameter (:func:`assert_gradients_close`): the norm of
  the difference may be ``STEP_RTOL`` of the parameter's own gradient norm, and never
  less than ``STEP_RTOL`` x :data:`GRAD_FLOOR` of the largest parameter's gradient norm.
  The rounding of a sum is set by the terms it adds, not by its result: a gradient that
  nearly cancels (a bias before a norm) carries its layer's rounding, which the floor
  admits. A 2x gradient is a relative error of 1, a hundred thousand times over.
  Losses, norms and weights after Adam cannot see such a defect (Adam is invariant to a
  gradient's scale; a norm weight at 1e-3 of the global norm moves the norm by 1.5e-6
  when doubled), which is why every parity test compares these.
  *Derived* as above; the floor's 1e-3 is a choice, not a measurement.

* Weights after Adam do not obey a relative bound. Adam divides every update by the
  running RMS of its gradient, so an element whose gradient sits at the noise floor of
  the reduction (|g| ≈ u·√n·max|g|) gets an update of either sign: reduction-order noise
  becomes up to a whole ``lr`` per step on that element. Any *real* defect is normalized
  the same way and moves an element by about ``lr`` per step too, so the useful bound is
  a fraction of ``lr`` per step: :func:`weight_atol` allows :data:`ADAM_FRACTION` (1%) of
  one step per step taken, a hundredth of what a defect does, and :data:`WEIGHT_RTOL`
  (1e-4, ten times a step's budget) for the elements far from zero. We saw 0.05% of a
  step per step on a 2-core machine (2.2e-6 after 4 steps at lr 1e-3), twenty times
  inside the bound. *Empirical*: 1% is a choice with a hundredfold margin on both sides
  (measured noise 20x below it, a defect 100x above it), not a derivation.

* Low precision (``train.precision`` bf16 or fp16, both runs in it). A result rounded
  to bf16 carries a relative error of up to u = 2^-8 (fp16: 2^-11). A layout adds no
  arithmetic; it moves where results are rounded: a row-parallel GEMM's partial outputs
  are each rounded before their sum, a pipeline stage's output crosses in the low
  dtype (one process keeps its residual stream in fp32), a data rank's weight gradient
  is rounded before the reduction rather than after. An element meets at most
  :data:`~paraxis.parallel.numerics.LAYOUT_ROUNDINGS` = 4 such moved roundings on its
  way through a block (projection, attention output, MLP in and out). From that count:

  - *gradients*, per parameter as above, and the gradient norm:
    :func:`precision_rtol`, 4u of the parameter's norm (:data:`BF16_RTOL` 1.6e-2,
    :data:`FP16_RTOL` 2.0e-3). Measured on the six layouts of
    tests/test_precision_parity.py (``-s`` prints them): at most 1.0e-2 in bf16 and
    1.2e-3 in fp16 (tensor 2 + SP, 2.6u and 2.5u). A doubled gradient is 1.0.
  - *losses*: :func:`loss_rtol`. A moved rounding changes a logit z by the difference of
    two roundings, rms sqrt(2/3)·u·|z| (uniform errors); four, sqrt(8/3)·u·|z|. A token's
    loss, logsumexp(z) - z_y, moves by <softmax(z) - e_y, dz>, so by sqrt(8/3)·u·s rms
    for logits of rms s (|softmax - e_y| ≈ 1 while no class dominates, as near the
    initialization every parity run starts from), and the mean over N scoring tokens of
    such independent moves by sqrt(8/3)·u·s/sqrt(N). Three of those standard
    deviations, relative to the loss L, are allowed. The bound scales with s/L: a loss
    near ln(vocabulary) hardly feels its logits' rounding (s ≈ 0.11 against L ≈ 4.9 for
    the debug models), which the old bound, 4u = 1.6e-2 for any mean, ignored along with
    the average over tokens, so a run that did not train at all passed it (issue 32).
    The fp32 step's 1e-5 stays the floor (the mean is still an fp32 sum). For the debug
    models and 112 tokens: 4.2e-5 in bf16, 5.3e-6 (so 1e-5) in fp16; measured over four
    SGD steps at rate 0.1 on the six layouts, at most 1.5e-5 (pipeline 2, expert 2) and
    2.0e-6. A rate of 1e-12 instead of 0.1 moves bf16 losses by 3.2e-4 to 3.9e-4 there,
    and under Adam a rate of 1e-12 instead of 1e-3 by up to 1.5e-3 over 20 steps (issue
    32): 8 and 35 times the bound. Under plain SGD at 1e-3 on random tokens the loss
    cannot see the rate (1.6e-5 at most, measured: a batch's gradient hardly lowers the
    next random batch's loss); the weights can (next).
  - *weights after SGD steps* (:func:`assert_sgd_weights_close`, in fp32 too, with
    ``STEP_RTOL``): w_k - w_0 =
    -sum_t lr_t·g_t, so two runs differ by sum_t lr_t·dg_t, and with |dg_t| ≤ rtol·|g_t|
    per parameter (and steps whose gradients point alike, as a few steps at a small rate
    take) by at most rtol times the displacement |w_k - w_0|, with the gradients' floor.
    The fp32 masters add their own rounding: each step both runs round w + update, and
    where the updates differ the results may differ by an ulp (≤ 2·2^-24·|w|), so
    2k·2^-24·|w| after k steps. A defect in the step (a wrong rate, a doubled or
    unscaled gradient, a skipped update) changes the displacement by its own size, a
    relative error of 1. Momentum, clipping and weight decay keep the update linear in
    the gradients, so the rule holds with them (the precision tests turn them off, so
    that the displacement is the gradients' alone). Adam breaks the linearity (it
    divides by the gradient's RMS, so rounding near zero becomes a whole update), which
    is why its weights get the absolute bound above in fp32 and are not compared in low
    precision. Measured: at most 0.62 of the bound (tensor 2 + SP, bf16); a rate of
    1e-12 is 64 times over it at rate 0.1 (59 at 1e-3 in bf16, 297 in fp16), a norm
    weight's gradient doubled in the steps 16.5 times.
  - *fp16 against fp32* (:func:`rtol_against_fp32`): every rounding counts, not only
    the moved ones. A layer rounds an element about ten times forward (GEMM inputs and
    outputs of q/k/v, the scores, the probabilities, the attention output, o_proj, gate
    and up, their product, down) and as often backward, independently, so
    u·sqrt(20·layers + 2) with the head's two: 3.2e-3 for two fp16 layers. Measured
    9.7e-4 (one process) and 1.2e-3 (tensor 2 x pipeline 2); without the unscale a
    gradient is 2^16 = 6.6e4 too large, and without the loss scale (back-propagating
    the bare loss, as the engine's fp32_backward did) 7.2e-3 off, lost to underflow.

Tolerances are not tuned per test or per machine: a test that needs another number has
found a defect or a different kind of arithmetic (a compiled optimizer), and says so
next to its own, derived, constant.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from paraxis.parallel.numerics import (
    BF16_RTOL,
    BF16_UNIT_ROUNDOFF,
    FP16_RTOL,
    FP32_UNIT_ROUNDOFF,
    LAYOUT_ROUNDINGS,
    REDUCTION_RTOL,
    UNIT_ROUNDOFF,
)

__all__ = ["ADAM_FRACTION", "BF16_RTOL", "BF16_UNIT", "FP16_RTOL", "FP64_RTOL", "GRAD_FLOOR",
           "LOSS_SIGMAS", "STEP_RTOL", "WEIGHT_RTOL",
           "assert_gradients_close", "assert_losses_close", "assert_sgd_weights_close",
           "assert_step_close", "assert_weights_close", "gradient_errors", "loss_rtol",
           "precision_rtol", "rtol_against_fp32", "sgd_weight_errors", "weight_atol"]

STEP_RTOL = REDUCTION_RTOL
BF16_UNIT = BF16_UNIT_ROUNDOFF
WEIGHT_RTOL = 10 * STEP_RTOL
ADAM_FRACTION = 1e-2
# Kernels checked in float64 against a float64 reference of another order (blockwise
# attention merged by log-sum-exp against one softmax; a model's logits through another
# attention path): u = 2^-53 ≈ 1.1e-16, so the sums differ by u·√n ≈ 2e-14, and the exp
# and log of the merges and their backward amplify that by at most ~1e4 on the tests'
# inputs. 1e-10 (relative, and absolute for elements near zero) keeps four orders of
# margin and is still a million times tighter than fp32 rounding, so a kernel that
# silently fell back to fp32 arithmetic fails.
FP64_RTOL = 1e-10
# The share of the largest gradient element below which an element's rounding is its
# layer's, not its own (see the module docstring).
GRAD_FLOOR = 1e-3
# Standard deviations of the loss's rounding noise a low-precision loss may differ by.
LOSS_SIGMAS = 3
# Roundings an element meets per transformer layer, forward or backward, in fp16 or bf16
# arithmetic (listed in the module docstring).
ROUNDINGS_PER_LAYER = 10


def precision_rtol(precision: str) -> float:
    """Per-parameter gradients (and the gradient norm, and SGD weights' displacement) of
    a layout against one process, both in ``precision``."""
    return {"fp32": STEP_RTOL, "bf16": BF16_RTOL, "fp16": FP16_RTOL}[precision]


def loss_rtol(precision: str, *, logit_rms: float, loss: float, tokens: int) -> float:
    """A mean loss over ``tokens`` scoring tokens of a layout against one process, both in
    ``precision``, for logits of rms ``logit_rms`` and a loss near ``loss`` (see the
    module docstring); never below the fp32 step's."""
    if precision == "fp32":
        return STEP_RTOL
    spread = (math.sqrt(2 * LAYOUT_ROUNDINGS / 3) * UNIT_ROUNDOFF[precision] * logit_rms
              / math.sqrt(max(tokens, 1)))
    return max(STEP_RTOL, LOSS_SIGMAS * spread / loss)


def rtol_against_fp32(precision: str, *, layers: int) -> float:
    """Per-parameter gradients computed in ``precision`` against fp32 ones, for a model
    of ``layers`` transformer layers (see the module docstring)."""
    roundings = 2 * ROUNDINGS_PER_LAYER * layers + 2
    return UNIT_ROUNDOFF[precision] * math.sqrt(roundings)


def weight_atol(lr: float, steps: int) -> float:
    """Absolute tolerance on weights after ``steps`` Adam steps of peak rate ``lr``."""
    return ADAM_FRACTION * lr * max(steps, 1)


def assert_losses_close(losses: Sequence[float], reference: Sequence[float],
                        what: str = "per-step losses", *, rtol: float = STEP_RTOL) -> None:
    torch.testing.assert_close(torch.tensor(list(losses), dtype=torch.float64),
                               torch.tensor(list(reference), dtype=torch.float64),
                               rtol=rtol, atol=0.0, msg=lambda m: f"{what}: {m}")


def assert_step_close(got: torch.Tensor, want: torch.Tensor, what: str = "tensor") -> None:
    """One step's numbers (outputs, gradients before any Adam step): relative to the
    largest element, which sets the rounding of the sums that made them."""
    scale = float(want.detach().abs().max()) if want.numel() else 0.0
    torch.testing.assert_close(got, want, rtol=STEP_RTOL, atol=STEP_RTOL * scale,
                               msg=lambda m: f"{what}: {m}")


def assert_weights_close(got: torch.Tensor, want: torch.Tensor, *, lr: float, steps: int,
                         what: str = "weights") -> None:
    torch.testing.assert_close(got, want, rtol=WEIGHT_RTOL, atol=weight_atol(lr, steps),
                               msg=lambda m: f"{what}: {m}")


def gradient_errors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                    ) -> dict[str, float]:
    """Each parameter's difference in norm over its own gradient's norm, or over
    :data:`GRAD_FLOOR` of the largest one's where that is more (see the module
    docstring): what :func:`assert_gradients_close` holds below ``rtol``."""
    norms = {name: float(w.double().norm()) for name, w in want.items()}
    floor = GRAD_FLOOR * max(norms.values(), default=0.0)
    return {name: float((got[name].double() - w.double()).norm())
            / max(norms[name], floor, 1e-30) for name, w in want.items()}


def assert_gradients_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                           *, rtol: float = STEP_RTOL) -> None:
    """Every parameter's gradient, in norm (see the module docstring). The message names
    each parameter that differs with its relative error."""
    bad = [f"{name} (relative error {err:.2e}, gradient norm "
           f"{float(want[name].double().norm()):.3g})"
           for name, err in gradient_errors(got, want).items() if not err <= rtol]
    assert not bad, f"{len(bad)} parameter gradient(s) differ from one process: " + \
        "; ".join(bad[:6])


def sgd_weight_errors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                      initial: dict[str, torch.Tensor], *, rtol: float, steps: int,
                      ) -> dict[str, float]:
    """Each parameter's difference in norm over what plain SGD steps allow it (see the
    module docstring): ``rtol`` of its displacement from ``initial`` (floored at
    :data:`GRAD_FLOOR` of the largest), plus the fp32 masters' rounding over ``steps``.
    1 is the bound."""
    moved = {name: float((w.double() - initial[name].double()).norm())
             for name, w in want.items()}
    floor = GRAD_FLOOR * max(moved.values(), default=0.0)
    out = {}
    for name, w in want.items():
        rounding = 2 * steps * FP32_UNIT_ROUNDOFF * float(w.double().norm())  # an ulp a step
        allowed = rtol * max(moved[name], floor) + rounding
        out[name] = float((got[name].double() - w.double()).norm()) / max(allowed, 1e-30)
    return out


def assert_sgd_weights_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                             initial: dict[str, torch.Tensor], *, rtol: float,
                             steps: int) -> None:
    """Weights after ``steps`` plain SGD steps from ``initial``, per parameter in norm
    (see the module docstring). The message names each parameter that differs with its
    error relative to its displacement."""
    bad = []
    for name, share in sgd_weight_errors(got, want, initial, rtol=rtol, steps=steps).items():
        if not share <= 1:
            moved = float((want[name].double() - initial[name].double()).norm())
            diff = float((got[name].double() - want[name].double()).norm())
            bad.append(f"{name} ({diff / max(moved, 1e-30):.2e} of its displacement "
                       f"{moved:.3g}, {share:.3g} times what is allowed)")
    assert not bad, f"{len(bad)} parameter(s) differ from one process after {steps} SGD " \
        "steps: " + "; ".join(bad[:6])
