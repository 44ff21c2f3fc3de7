"""The checks of the matrix: each a layout over two ranks, trained a few steps and
compared step by step with one process.

The reference runs on a world of one: first the model's own ``labels=`` loss must equal
the one-process paraxis loss on the same batch (``own loss``), then it takes the first
batch's gradients and trains :data:`STEPS` steps. Each check runs ``parallelize`` with
its degrees on a world of two, takes the same gradients and trains the same global
batches; every parameter's gradient (gathered through the placements; the router's
load-balancing loss's included, as a training step back-propagates it), the per-step
losses, gradient norms and router losses (``moe/aux_loss``, for a model with experts)
must agree at the shared tolerance
(:mod:`paraxis.testing.tolerance`), and a layout that shards must prove it did (the
*shard proof*: parameters sharded or layers handed to the other stage, on every rank,
and each rank's parameter bytes equal to what its placements claim, below the whole
model's, and equal to what the plan and degrees give: :mod:`paraxis_coverage.shares`).

A cell has one of four statuses: *pass*; *explained*, a pass with a stated cause for a
difference (an ill-conditioned model: see :func:`split_explained`), counted apart;
*refused*, a layout ``parallelize`` declines with its reason (no plan, an attention kind
a stage cannot run, a combination an axis does not support); *fail*, a difference the
parity probe or the run found, or a crash (a :class:`~paraxis.engine.probe.ParityError`
or a :class:`~paraxis.parallel.stages.StageParityError`, the pipeline stage check's crash
or other logits, is a defect caught, never a refusal; a known cause is refused at
preflight, :mod:`paraxis_hf.limits`).

Functions here run on the ranks of a :class:`paraxis.testing.DistributedWorld`; they
catch every exception so one family's failure leaves the world usable, and say so.
"""

from __future__ import annotations

import gc
import math
from typing import Any

import torch

from paraxis_coverage.cells import (
    AUX_LOSS,
    BATCH,
    HISTORY,
    IGNORED,
    LR,
    SHARDING,
    STEPS,
    Check,
    Outcome,
)
from paraxis_coverage.shares import expected_on_rank, proven, whole_layout
from paraxis_coverage.weights import full_weights, set_weights

__all__ = ["compare", "first_step", "histories", "own_loss", "parallel_run",
           "preflight_refusal", "reference_run", "settle", "shard_proof", "split_explained"]

def _first_line(exc: BaseException) -> str:
    from paraxis_hf.shrink import first_line

    return first_line(exc)


def _reason(exc: BaseException) -> str:
    """A refusal's reason as paraxis words it: a config error's problems, a plan
    error's message (no type name: every refusal is one of the two)."""
    problems = getattr(exc, "problems", None)
    text = "; ".join(str(p) for p in problems) if problems else str(exc)
    return " ".join(text.split())[:300]


def _train(model_type: str, overrides: dict[str, Any], kwargs: dict[str, Any],
           own: bool, *, dtype: torch.dtype | None = None, record: bool = False,
           anchors: list[dict[str, torch.Tensor]] | None = None) -> dict[str, Any]:
    """Train :data:`STEPS` steps; ``dtype`` casts the model first, ``record`` keeps the
    weights each step starts from (a world of one), ``anchors`` sets them before each
    step (see :mod:`paraxis_coverage.drift`)."""
    import paraxis
    from paraxis import ConfigError, ParallelConfig, PlanError
    from paraxis.engine.probe import ParityError
    from paraxis.parallel.stages import StageParityError
    from paraxis.testing.parity import local_gradients
    from paraxis_hf.families import build_model
    from paraxis_hf.shrink import SEQ, VOCAB

    model = build_model(model_type, overrides)
    if dtype is not None:
        model = model.to(dtype)
    whole = _parameter_bytes(model.parameters())
    layout = whole_layout(model)
    g = torch.Generator().manual_seed(3)
    batches = []
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        labels = ids.clone()
        labels[0, :IGNORED] = -100
        batches.append((ids, labels))
    result: dict[str, Any] = {}
    if own:  # the model's own loss, before paraxis touches it
        result.update(_own_losses(model, *batches[0]))
    try:
        engine = paraxis.parallelize(model, config=ParallelConfig.from_kwargs(**kwargs), train={
            "steps": STEPS, "lr": LR, "warmup_steps": 1, "seq_length": SEQ})
    except (ParityError, StageParityError) as exc:  # a defect the probe or the stage
        return {"defect": _reason(exc)}  # check caught: a failure, never a refusal
    except (PlanError, ConfigError) as exc:
        return {"refused": _reason(exc)}
    try:
        index, count = engine.grid.sample_shard()
        part = slice(index * BATCH // count, (index + 1) * BATCH // count)
        shares = [{"input_ids": ids[part], "labels": labels[part]} for ids, labels in batches]
        if own:
            result["paraxis"] = engine.eval_step(shares[0])
        result["proof"] = shard_proof(engine, whole, layout)
        result["grads"] = local_gradients(engine, shares[0])
        history = []
        for step, share in enumerate(shares):
            if anchors is not None or record:
                if anchors is not None:
                    set_weights(engine.model, anchors[step])
                if record:
                    result.setdefault("weights", []).append(full_weights(engine.model))
            history.append(engine.train_step(share))
        result["losses"] = [m["loss"] for m in history]
        result["norms"] = [m["grad_norm"] for m in history]
        result["aux"] = [m.get(AUX_LOSS) for m in history]
    finally:
        engine.close()
    return result


def _parameter_bytes(params: Any) -> int:
    seen = {id(p): p for p in params}
    return sum(p.numel() * p.element_size() for p in seen.values())


def shard_proof(engine: Any, whole: int, layout: dict[str, Any] | None = None
                ) -> dict[str, Any]:
    """What this rank holds against the whole model: parameters its placements shard,
    layers and entries handed to other pipeline stages, the bytes it holds, the bytes
    its placements claim, the experts left whole on every tensor rank, and (given the
    whole model's ``layout``) the bytes the plan and the degrees say it should hold
    (:func:`paraxis_coverage.shares.expected_share`)."""
    from paraxis.parallel.placement import placement_of
    from paraxis.parallel.standins import Absent, SkipLayer
    params = list({id(p): p for p in engine.model.parameters()}.values())
    records = [placement_of(p) for p in params]
    kept = engine.plan.extra.get("experts_kept_whole", ())
    return {"expected": expected_on_rank(engine, layout), "held": {
        n: p.numel() * p.element_size() for n, p in engine.model.named_parameters()},
        "sharded": {a: sum(a in r.sharded_axes for r in records) for a in SHARDING},
        "handed_over": sum(isinstance(m, SkipLayer | Absent) for m in engine.model.modules()),
        "bytes": _parameter_bytes(params),
        "claimed": sum(math.prod(r.local_shape) * p.element_size()
                       for r, p in zip(records, params, strict=True)),
        "whole": whole,
        "experts_replicated_over_tensor": len(kept) if engine.grid.size("tensor") > 1
        and engine.config.parallelism.expert_tensor == 1 else 0,
        "experts_sharded_over_tensor": sum({"expert", "tensor"} <= set(r.sharded_axes)
                                           for r in records),
    }


def _own_losses(model: Any, ids: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """The model's ``labels=`` loss; also with the labels shifted beforehand, for the
    few families whose loss does not shift them (``own_shifted``: XLNet, XLM, TrOCR
    compare each position's logits with its own label, the caller shifting)."""
    from paraxis.parallel.batch import shift_labels

    model.eval()
    with torch.no_grad():
        own = {"own": float(model(input_ids=ids, labels=labels, use_cache=False).loss),
               "own_shifted": float(model(input_ids=ids, labels=shift_labels(labels),
                                          use_cache=False).loss)}
    model.train()
    return own


def settle() -> None:
    """Collect garbage, then freeze what is left (imported modules, caches) out of the
    collector's reach: every later full collection (``Engine.close`` runs one per check,
    the world's worker one per task) then scans only the objects made since: about
    0.01 s instead of 0.5 s with transformers imported, most of a tiny model's check."""
    gc.collect()
    gc.freeze()


def _guarded(model_type: str, overrides: dict[str, Any], kwargs: dict[str, Any],
             own: bool, **options: Any) -> dict[str, Any]:
    settle()
    try:
        return _train(model_type, overrides, kwargs, own, **options)
    except Exception as exc:
        return {"error": _first_line(exc)}


def reference_run(model_type: str, overrides: dict[str, Any],
                  microbatches: int = 1) -> dict[str, Any]:
    """On a world of one: the model's own loss, paraxis' and the per-step history, with
    the batch cut into ``microbatches`` (gradient accumulation). A router's
    load-balancing loss is computed per forward, as transformers computes it per call,
    so a layout that runs microbatches (a pipeline) is compared with one process running
    the same ones (as ``tests/hf_parity.py`` does)."""
    kwargs = {"microbatches": microbatches} if microbatches > 1 else {}
    return _guarded(model_type, overrides, kwargs, own=microbatches == 1)


def parallel_run(model_type: str, overrides: dict[str, Any],
                 kwargs: dict[str, Any]) -> dict[str, Any]:
    """On the check's world: the per-step history under ``kwargs`` (or why not)."""
    return _guarded(model_type, overrides, kwargs, own=False)


def preflight_refusal(model: Any, check: Check, plugin_manager: Any) -> Outcome | None:
    """``parallelize``'s checks before any process group (config rules, missing plans),
    run here without ranks by the same function: the refusal a world of two would give."""
    from paraxis import ConfigError, ParallelConfig, PlanError
    from paraxis.config.run import TrainSection
    from paraxis.engine.apply import preflight
    from paraxis_hf.shrink import SEQ

    config = ParallelConfig.from_kwargs(**check.kwargs)
    try:
        preflight(model, config, train=TrainSection(seq_length=SEQ), world_size=check.world,
                  plugin_manager=plugin_manager)
    except (PlanError, ConfigError) as exc:
        return Outcome("refused", _reason(exc))
    except Exception as exc:  # a defect in a rule, said as a failure
        return Outcome("fail", _first_line(exc))
    return None


def compare(reference: dict[str, Any], results: list[dict[str, Any]],
            check: Check | None = None) -> Outcome:
    """A check's cell from the reference and every rank's result: the per-parameter
    gradients, the per-step losses and gradient norms, then the shard proof."""
    from paraxis.testing.parity import assert_same_gradients
    from paraxis.testing.tolerance import assert_losses_close

    refused = {r["refused"] for r in results if "refused" in r}
    errors = [r.get("error") or r["defect"] for r in results if "error" in r or "defect" in r]
    if refused and not errors and len(refused) == 1 and len(results) == len(
            [r for r in results if "refused" in r]):
        return Outcome("refused", refused.pop())
    if errors or refused:
        return Outcome("fail", (errors or sorted(refused))[0])
    if "grads" in reference and all("grads" in r for r in results):
        try:
            assert_same_gradients([r["grads"] for r in results], reference["grads"])
        except AssertionError as exc:
            return Outcome("fail", " ".join(str(exc).split())[:300])
    for r in results:
        for key, what in histories(reference):
            got = r.get(key) or [None] * len(reference[key])
            try:
                assert None not in got, f"no {what} reported"
                assert_losses_close(got, reference[key], what)
            except AssertionError:
                return Outcome("fail", _mismatch(what, got, reference[key]))
    return proven(check, results)


def histories(reference: dict[str, Any]) -> list[tuple[str, str]]:
    """The :data:`HISTORY` series compared with ``reference``: losses and gradient norms
    always, a router loss where the model has one (the engine reports it)."""
    return [(key, what) for key, what in HISTORY if key != "aux" or (
        reference.get(key) and None not in reference[key])]


def first_step(run: dict[str, Any]) -> dict[str, Any]:
    """``run`` cut to what it computes at the weights every run starts from: the
    per-parameter gradients of the first batch and each series' first step."""
    out = {key: run[key][:1] for key, _ in HISTORY if run.get(key)}
    if "grads" in run:
        out["grads"] = run["grads"]
    return out


def split_explained(reference: dict[str, Any], split: dict[str, Any],
                    results: list[dict[str, Any]], cell: Outcome, parts: int) -> Outcome:
    """A ``data`` check's failing cell, judged again against ``split``: one process
    accumulating the same ``parts`` shares of each batch the ranks hold (gradient
    accumulation: the data ranks' arithmetic exactly, summed in another order than the
    whole batch). It passes as ill-conditioned (a reduction-order difference of ~1e-7
    grown past the tolerance within the steps, not a mistrained model) only if

    1. at step 1, from the weights every run starts from, the split run and the ranks
       equal one process on whole batches: every parameter's gradient, the loss, the
       gradient norm (and router loss). Order can only matter after a step; a defect
       shared by the ranks and the split run (both accumulate) shows here (issue 32);
    2. the ranks equal the split run at every step;
    3. the split run does *not* equal one process on whole batches.

    Anything else keeps ``cell``."""
    if cell.status != "fail" or "losses" not in split or "losses" not in reference:
        return cell
    if "grads" not in reference or any("grads" not in r for r in (split, *results)):
        return cell  # step 1 cannot be held to per-parameter agreement
    start = first_step(reference)
    for run in ([split], results):  # each run's ranks assembled apart
        if compare(start, [first_step(r) for r in run]).status != "pass":
            return cell
    if compare(split, results).status != "pass":
        return cell
    itself = compare(reference, [split])
    if itself.status != "fail":
        return cell
    return Outcome("explained", f"ill-conditioned: equal to one process accumulating the same "
                   f"{parts} shares, which equals one process on whole batches at step 1 "
                   f"(every parameter's gradient) and differs from it later by more than "
                   f"the tolerance ({itself.detail}); ranks against whole batches: "
                   f"{cell.detail}")


def _mismatch(what: str, got: list[float], want: list[float]) -> str:
    """The first step whose value differs beyond the tolerance, said with numbers."""
    from paraxis.testing.tolerance import STEP_RTOL

    for step, (a, b) in enumerate(zip(got, want, strict=True), 1):
        if a is None:
            return f"{what} at step {step} not reported, one process {b:.7g}"
        rel = abs(a - b) / max(abs(b), 1e-30)
        if not rel <= STEP_RTOL:
            return (f"{what} at step {step} is {a:.7g}, one process {b:.7g} "
                    f"(relative difference {rel:.1e} > {STEP_RTOL:.0e})")
    return f"{what}: {got} against {want}"


def own_loss(reference: dict[str, Any]) -> Outcome:
    """The ``own loss`` cell: paraxis' one-process loss against the model's ``labels=``."""
    from paraxis.testing.tolerance import assert_losses_close

    if "refused" in reference:
        return Outcome("refused", reference["refused"])
    if "error" in reference:
        return Outcome("fail", reference["error"])
    try:
        assert_losses_close([reference["paraxis"]], [reference["own"]], "one-process loss")
    except AssertionError:
        pass
    else:
        return Outcome("pass")
    try:  # a family whose labels= expects next-token labels already shifted
        assert_losses_close([reference["paraxis"]], [reference["own_shifted"]], "shifted")
    except (AssertionError, KeyError):
        return Outcome("fail", _mismatch("paraxis' loss (against labels=)",
                                         [reference["paraxis"]], [reference["own"]]))
    return Outcome("pass", "its labels= does not shift: equal to it on shifted labels")
