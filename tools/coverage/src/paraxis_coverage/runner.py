"""Run the matrix: every family through the reference and every check, on worlds kept
alive across families.

Two worlds serve the whole run (one rank for the reference, two for the checks), as the
``worlds`` fixture of the test suite does: starting processes per check would cost more
than the checks. A check whose ranks raised different errors (or some raised and some
did not) is followed by a fresh world of its size, because a rank may have been left in
a collective; a world that does not answer within the timeout is killed and restarted,
and the cell says so. Checks
``parallelize`` refuses before any process group exists (a missing plan, a config rule)
are answered here, by the same code, without the ranks.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from paraxis.testing.distributed import RankFailure
from paraxis_coverage.cells import Check, Outcome
from paraxis_coverage.checks import (
    compare,
    own_loss,
    parallel_run,
    preflight_refusal,
    reference_run,
    settle,
    split_explained,
)
from paraxis_coverage.drift import anchored_run, drift_explained, exact_run, recorded_run
from paraxis_hf.families import Family, build_family

__all__ = ["CHECK_TIMEOUT", "OWN_LOSS", "Prepared", "Row", "prepare", "run_checks",
           "run_family", "run_matrix"]

CHECK_TIMEOUT = 240.0  # seconds for one check on a loaded 2-core machine (typically 2-10)
OWN_LOSS = "own loss"


@dataclasses.dataclass
class Row:
    family: Family
    cells: dict[str, Outcome] = dataclasses.field(default_factory=dict)
    seconds: float = 0.0


# One task at a time per world: the next family's reference runs on the world of one in a
# thread (run_matrix) while a check's drift runs may use it too; a world answers its
# tasks in order, so two threads sharing one would take each other's results.
_WORLD_LOCKS: dict[int, threading.Lock] = {1: threading.Lock(), 2: threading.Lock()}


def _run(worlds: Any, size: int, fn: Callable[..., Any], *args: Any,
         timeout: float) -> list[dict[str, Any]]:
    """``fn`` on the world of ``size``; a world that failed as a whole (a rank died, did
    not answer) is restarted by the pool on next use, and reported as every rank's error."""
    try:
        with _WORLD_LOCKS.setdefault(size, threading.Lock()):
            return worlds.run(size, fn, *args, timeout=timeout)
    except RankFailure as exc:
        lines = [ln for ln in str(exc).splitlines() if ln.strip()]
        reason = next((ln for ln in lines if "did not answer" in ln), lines[-1] if lines else "")
        return [{"error": f"the world failed: {reason.strip()}"[:240]}] * size


def _maybe_out_of_step(results: list[dict[str, Any]]) -> bool:
    """Whether a check may have left a rank inside a collective: some ranks raised and
    others did not, or they raised different errors. Ranks that all raised the same
    error stopped at the same point (a shape error every rank meets, a refusal worded
    as a ValueError), so the world goes on serving."""
    errors = [r.get("error") for r in results]
    return any(errors) and len(set(errors)) > 1


@dataclasses.dataclass
class Prepared:
    """A family with its reference run (or none: not text-only, not built)."""

    family: Family
    reference: dict[str, Any] | None
    seconds: float
    # microbatches -> the one-process run with that gradient accumulation
    accumulated: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)


def prepare(family: Family, worlds: Any, *, timeout: float = CHECK_TIMEOUT,
            checks: Iterable[Check] = ()) -> Prepared:
    """The references on the world of one: own loss, then the per-step history; for a
    model with experts, also one per microbatch count a check runs (its router loss is
    per forward)."""
    start = time.perf_counter()
    ref, accumulated = None, {}
    if family.built:
        ref = _run(worlds, 1, reference_run, family.model_type, family.overrides,
                   timeout=timeout)[0]
        counts = {c.microbatches for c in checks} - {1} if "expert" in family.plans else ()
        for mb in sorted(counts):
            accumulated[mb] = _run(worlds, 1, reference_run, family.model_type,
                                   family.overrides, mb, timeout=timeout)[0]
    return Prepared(family, ref, time.perf_counter() - start, accumulated)


def _reference_for(prepared: Prepared, check: Check) -> dict[str, Any]:
    """The reference ``check`` is compared with: the one-process run, or, for a model
    with experts under a check that runs microbatches, one process running the same
    microbatches (its router loss is per forward; see ``checks.reference_run``)."""
    return prepared.accumulated.get(check.microbatches, prepared.reference or {})


def _data_only(check: Check) -> bool:
    """A data-parallel check alone: its ranks hold the batch's consecutive shares, as
    one process accumulating ``world`` microbatches does."""
    return set(check.kwargs) == {"data"} and check.world > 1


def _has_experts(model: Any) -> bool:
    """MoE blocks (an ``experts`` child): their router loss is per forward, so one
    process accumulating microbatches is another function than data parallel's."""
    from torch import nn

    return any(isinstance(getattr(m, "experts", None), nn.Module) for m in model.modules())


def _split_experts(model: Any, check: Check, plugin_manager: Any) -> tuple[Check, str]:
    """A tensor column on a mixture-of-experts family splits each expert's FFN over the
    tensor group too (``expert_tensor`` = the tensor degree, Megatron-Core's default),
    where ``parallelize`` accepts it; elsewhere the experts stay whole on every tensor
    rank, and the returned words say why."""
    degree = int(check.kwargs.get("tensor", 1))
    if check.axis != "tensor" or degree == 1 or not _has_experts(model):
        return check, ""
    split = dataclasses.replace(check, kwargs={**check.kwargs, "expert_tensor": degree})
    refusal = preflight_refusal(model, split, plugin_manager)
    if refusal is None:
        return split, ""
    return check, f"expert_tensor {degree} refused: {refusal.detail}"


def _judge_drift(prepared: Prepared, check: Check, results: list[dict[str, Any]],
                 cell: Outcome, worlds: Any, *, timeout: float) -> Outcome:
    """A failing run judged from the reference's weights and against float64
    (:mod:`paraxis_coverage.drift`): three more runs, for failing cells only."""
    family = prepared.family
    mb = check.microbatches if check.microbatches in prepared.accumulated else 1
    recorded = _run(worlds, 1, recorded_run, family.model_type, family.overrides, mb,
                    timeout=timeout)[0]
    if "weights" not in recorded:
        return cell
    exact = _run(worlds, 1, exact_run, family.model_type, family.overrides, mb,
                 timeout=timeout)[0]
    anchored = _run(worlds, check.world, anchored_run, family.model_type, family.overrides,
                    check.kwargs, recorded.pop("weights"), timeout=timeout)
    if _maybe_out_of_step(anchored):
        worlds.restart(check.world)
    return drift_explained(recorded, exact, anchored, results, cell)


def run_checks(prepared: Prepared, checks: Iterable[Check], worlds: Any, *,
               timeout: float = CHECK_TIMEOUT) -> Row:
    """The row of a prepared family: each check against its reference."""
    from paraxis.engine.plugins import make_plugin_manager
    from paraxis_hf.families import build_model

    start = time.perf_counter()
    family, ref = prepared.family, prepared.reference
    row = Row(family)
    if ref is None:
        return row
    model, pm = build_model(family.model_type, family.overrides), make_plugin_manager()
    row.cells[OWN_LOSS] = own_loss(ref)
    for check in checks:
        began = time.perf_counter()
        check, kept_whole = _split_experts(model, check, pm)
        refusal = preflight_refusal(model, check, pm)
        if refusal is not None:
            row.cells[check.name] = refusal
            continue
        want = _reference_for(prepared, check)
        if "losses" not in want:
            row.cells[check.name] = Outcome("fail", "one process cannot train it: "
                                            + (want.get("error") or want.get("refused", "")))
            continue
        results = _run(worlds, check.world, parallel_run, family.model_type,
                       family.overrides, check.kwargs, timeout=timeout)
        cell = compare(want, results, check)
        if cell.status == "fail" and _data_only(check) and not _has_experts(model):
            split = _run(worlds, 1, reference_run, family.model_type, family.overrides,
                         check.world, timeout=timeout)[0]
            cell = split_explained(want, split, results, cell, check.world)
        if cell.status == "fail" and all("losses" in r for r in results):
            cell = _judge_drift(prepared, check, results, cell, worlds, timeout=timeout)
        if kept_whole and cell.status == "pass":
            cell = dataclasses.replace(cell, detail=f"{cell.detail} ({kept_whole})")
        row.cells[check.name] = dataclasses.replace(cell, seconds=time.perf_counter() - began)
        if _maybe_out_of_step(results):
            worlds.restart(check.world)
    row.seconds = prepared.seconds + time.perf_counter() - start
    return row


def run_family(family: Family, checks: Iterable[Check], worlds: Any, *,
               timeout: float = CHECK_TIMEOUT) -> Row:
    """One row: the reference on one rank, then each check (see the module docstring)."""
    checks = list(checks)
    return run_checks(prepare(family, worlds, timeout=timeout, checks=checks), checks,
                      worlds, timeout=timeout)


def run_matrix(types: dict[str, str], checks: list[Check], worlds: Any, *,
               timeout: float = CHECK_TIMEOUT, done: dict[str, Row] | None = None,
               progress: Callable[[Row], None] | None = None) -> list[Row]:
    """Every type's row, in order. The next family is built and its reference run (on
    the world of one) while this one's checks run on the world of two: the worlds are
    separate processes, and on a shared machine more runnable processes get a larger
    share of it."""
    done = done or {}
    todo = [(t, c) for t, c in types.items() if t not in done]

    def ahead(model_type: str, class_name: str) -> Prepared:
        settle()
        return prepare(build_family(model_type, class_name), worlds, timeout=timeout,
                       checks=checks)

    rows, future = [], None
    with ThreadPoolExecutor(max_workers=1) as pool:
        if todo:
            future = pool.submit(ahead, *todo[0])
        index = {t: i for i, (t, _) in enumerate(todo)}
        for model_type in types:
            row = done.get(model_type)
            if row is None:
                assert future is not None
                prepared = future.result()
                i = index[model_type] + 1
                future = pool.submit(ahead, *todo[i]) if i < len(todo) else None
                row = run_checks(prepared, checks, worlds, timeout=timeout)
            rows.append(row)
            if progress is not None:
                progress(row)
    return rows
