"""A failing cell judged again: a wrong layout, or a model whose training one process
cannot reproduce itself to the tolerance?

The checks compare trajectories: each run takes its own steps, so by step 2 the runs
stand at different weights. AdamW's first step moves every element by about
``lr * g / (|g| + eps)``: an element whose gradient sits at the reduction noise floor
(|g| ≈ 1e-7 where the largest is 0.1) gets a step that depends on the noise, and a model
whose later gradients are sensitive to such elements parts from any other summation order
within a step or two. Gemma 4 and Gemma-3n are such models (docs/architecture.md,
section 11, has the numbers). A failing cell of a layout that runs (every rank has a
history) passes as *ill-conditioned* only when all three hold:

1. **anchored**: run again with every step starting from the reference's own weights
   (:func:`set_weights` through each parameter's placement), the layout's first-step
   gradients (per parameter), loss, gradient norm and router loss equal the
   reference's at the shared tolerance at every step (:func:`checks.compare`). The
   gradients are right wherever the reference went; only the trajectories part.
2. **one process is no better**: one process in float64 (the same model, batches and
   optimizer, every sum exact to ~1e-16) differs from the float32 reference by more
   than the tolerance. The reference itself cannot hold its trajectory to the
   tolerance, so it cannot judge another float32 order against it.
3. **as close as the reference**: at every step the layout's loss and gradient norm
   (and router loss, where the model has one) are no farther from float64 than twice
   the float32 reference is, plus a step's tolerance (two float32 runs each within e
   of the exact one differ by at most 2e).

Otherwise the cell stays as it was. A defect shows in (1), at weights both share.
"""

from __future__ import annotations

from typing import Any

import torch

from paraxis_coverage.cells import Outcome
from paraxis_coverage.checks import _guarded, compare, histories

__all__ = ["anchored_run", "drift_explained", "exact_run", "recorded_run"]


def _mb(microbatches: int) -> dict[str, Any]:
    return {"microbatches": microbatches} if microbatches > 1 else {}


def recorded_run(model_type: str, overrides: dict[str, Any],
                 microbatches: int = 1) -> dict[str, Any]:
    """On a world of one: the reference again, with the weights each step starts from."""
    return _guarded(model_type, overrides, _mb(microbatches), own=False, record=True)


def exact_run(model_type: str, overrides: dict[str, Any],
              microbatches: int = 1) -> dict[str, Any]:
    """On a world of one: the reference in float64."""
    return _guarded(model_type, overrides, _mb(microbatches), own=False,
                    dtype=torch.float64)


def anchored_run(model_type: str, overrides: dict[str, Any], kwargs: dict[str, Any],
                 anchors: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
    """On the check's world: each step from ``anchors`` (the reference's weights)."""
    return _guarded(model_type, overrides, kwargs, own=False, anchors=anchors)


def _largest(got: dict[str, Any], want: dict[str, Any]) -> tuple[float, str]:
    """The largest relative difference of ``got``'s per-step series (losses, norms, a
    router loss) from ``want``'s."""
    return max((abs(a - b) / max(abs(b), 1e-30), f"{what} at step {step}")
               for key, what in histories(want)
               for step, (a, b) in enumerate(zip(got[key], want[key], strict=True), 1))


def _as_close(result: dict[str, Any], reference: dict[str, Any],
              exact: dict[str, Any]) -> bool:
    from paraxis.testing.tolerance import STEP_RTOL

    return all(abs(a - e) <= 2 * abs(r - e) + STEP_RTOL * abs(e)
               for key, _ in histories(exact)
               for a, r, e in zip(result[key], reference[key], exact[key], strict=True))


def drift_explained(reference: dict[str, Any], exact: dict[str, Any],
                    anchored: list[dict[str, Any]], results: list[dict[str, Any]],
                    cell: Outcome) -> Outcome:
    """``cell`` judged again (the module docstring's three conditions): a pass that says
    so with the numbers, or ``cell`` unchanged."""
    runs = [reference, exact, *anchored, *results]
    if cell.status != "fail" or not anchored or any("losses" not in r for r in runs):
        return cell
    if compare(reference, anchored).status != "pass":
        return cell
    if compare(exact, [reference]).status != "fail":
        return cell
    if not all(_as_close(r, reference, exact) for r in results):
        return cell
    at_weights, where = max(_largest(r, reference) for r in anchored)
    own, own_where = _largest(reference, exact)
    mine, mine_where = max(_largest(r, exact) for r in results)
    return Outcome("explained", "ill-conditioned: from the reference's weights each step "
                   f"agrees (largest {at_weights:.1e}, {where}); one process in float32 is "
                   f"{own:.1e} off float64 ({own_where}), this layout {mine:.1e} "
                   f"({mine_where}); against float32: {cell.detail}")
