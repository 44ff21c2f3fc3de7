"""The tensor axis' own configuration rules, checked before any process group exists
(through the ``paraxis_validate_config`` hook)."""

from __future__ import annotations

import fnmatch
from typing import Any

from torch import nn

from paraxis.config.errors import Problem
from paraxis.config.parallel import SPLIT_BACKWARD_SCHEDULES, ParallelConfig
from paraxis.config.rules import divides, divisors
from paraxis.config.shape import ModelShape

__all__ = ["check_split_widths", "check_tensor"]

# Styles that split a linear layer's width with no padding, and the width they split:
# (attribute, packed blocks). Padded styles (gathered outputs, the vocabulary) are not
# here: any width splits.
_UNPADDED = {"colwise": ("out_features", 1), "packed_colwise": ("out_features", 2),
             "rowwise": ("in_features", 1), "rowwise_split_input": ("in_features", 1)}


def check_tensor(config: ParallelConfig, model: ModelShape | None) -> list[Problem]:
    par = config.parallelism
    t = par.tensor
    problems: list[Problem] = []
    if par.sequence_parallel and t == 1:
        problems.append(Problem(
            "parallelism.sequence_parallel", True, "shards activations over the tensor axis, "
            "which has degree 1", "set parallelism.tensor > 1 or sequence_parallel: false"))
    problems += _check_overlap(config)
    if model is None or t == 1:
        return problems
    divides(problems, "model.hidden_size", model.hidden_size, t, "tensor")
    divides(problems, "model.num_attention_heads", model.num_attention_heads, t, "tensor")
    divides(problems, "model.intermediate_size", model.intermediate_size, t, "tensor")
    if model.kv_heads is not None and model.kv_heads % t:
        # Replicating kv heads over tensor ranks would make their gradients partial sums
        # over sub-groups of the tensor group; paraxis rejects it instead (documented).
        problems.append(Problem(
            "model.num_key_value_heads", model.kv_heads,
            f"must be divisible by the tensor degree {t} (kv heads are split, never "
            "replicated)", f"choose tensor among {divisors(model.kv_heads)}"))
    if model.vocab_size is not None and model.vocab_size < t:
        problems.append(Problem(
            "model.vocab_size", model.vocab_size,
            f"must be at least the tensor degree {t} (it is padded to a multiple of it)",
            "lower parallelism.tensor"))
    if par.sequence_parallel:
        divides(problems, "model.seq_length", model.seq_length, t * par.context,
                "tensor x context")
    return problems


def _check_overlap(config: ParallelConfig) -> list[Problem]:
    """``tensor_overlap: on`` where it cannot apply (paraxis_tp.overlap)."""
    par = config.parallelism
    if par.tensor_overlap != "on":
        return []
    if not par.sequence_parallel:
        return [Problem("parallelism.tensor_overlap", "on", "overlaps sequence parallel's "
                        "all-gathers and reduce-scatters with the GEMMs; without "
                        "sequence_parallel there are none", "set sequence_parallel: true, "
                        "or tensor_overlap: auto")]
    schedule = config.schedule.pipeline_schedule
    if par.pipeline > 1 and schedule in SPLIT_BACKWARD_SCHEDULES:
        return [Problem("parallelism.tensor_overlap", "on", f"{schedule} splits the "
                        "backward into input and weight passes, and a fused node (its "
                        "ring transfers, its weight gradients) would run in both; not "
                        "supported", "use another pipeline_schedule, or tensor_overlap: "
                        "auto")]
    return []


def check_split_widths(model: nn.Module, plan: Any, t: int,
                       anatomy: Any = None) -> list[Problem]:
    """Every linear layer the tensor plan splits without padding must split evenly over
    ``t`` ranks: a column (or each packed block) its output features, a row its input
    features. The model shape's rules cover the dense widths (``intermediate_size``...);
    this finds the others, such as a shared expert's FFN, by module, one problem per
    plan entry, before any process group. A LoRA layer (``anatomy.adapters``) is checked
    by its base layer, which is what is split."""
    if t == 1 or plan is None:
        return []
    found: dict[str, Problem] = {}
    for name, module in model.named_modules():
        style = plan.tensor_style(name)
        adapter = anatomy.adapter_of(name) if anatomy is not None else None
        if adapter is not None:
            module = model.get_submodule(adapter.base)
        if style not in _UNPADDED or not isinstance(module, nn.Linear):
            continue
        attr, parts = _UNPADDED[style]
        width = getattr(module, attr)
        pattern = next(p for p in plan.tensor if fnmatch.fnmatchcase(name, p))
        if width % (parts * t) and pattern not in found:
            per = f" in each of its {parts} packed blocks" if parts > 1 else ""
            found[pattern] = Problem(
                f"{name}.{attr}", width,
                f"the tensor plan splits it ({style}) over the tensor degree {t}, which "
                f"does not divide it{per}",
                f"choose tensor among {divisors(width // parts)}, or a plan that keeps "
                "this layer whole")
    return list(found.values())
