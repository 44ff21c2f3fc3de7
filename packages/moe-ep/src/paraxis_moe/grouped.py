"""How a rank's local experts compute their rows: one grouped matmul per projection, or
the model's per-expert loop.

transformers 5.x gives every ``@use_experts_implementation`` experts module two ways of
its own, picked by ``config._experts_implementation``: ``grouped_mm`` (rows sorted by
expert, one ``torch.nn.functional.grouped_mm`` / ``torch._grouped_mm`` per projection
over the experts' row ranges) and ``eager`` (the family's loop over the experts hit).
Where torch's grouped kernel cannot run (a torch without it, or a dtype it lacks:
float64 on CPU), :func:`padded_bmm_forward` is the grouped form: each expert's rows
padded to the busiest expert's count and one ``torch.bmm`` per projection (the layout
of Megatron-Core's ``SequentialMLP`` → ``GroupedMLP`` before grouped GEMM kernels, and
of capacity-based dispatch, where every expert holds ``C`` rows anyway). Padding rows
are zeros whose outputs are never gathered, so they add no gradient.

Which is faster is measured, not assumed (``benchmarks/moe_grouped.py``, RESULTS.md):
:data:`GROUPED_DEFAULT` records, per device type and dtype, whether the grouped form beat
the loop at both 4 and 16 local experts over the whole spread of rounds; where it did
not, the loop is the default (:func:`local_kernel`). Where nothing was measured (GPUs:
the development machine has none), the model's own choice stands, transformers'
``grouped_mm`` by default.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["GROUPED_DEFAULT", "grouped_mm_available", "local_kernel", "padded_bmm_forward"]

# (device type, dtype) -> the grouped form beat the per-expert loop (RESULTS.md, "Grouped
# expert GEMMs", x86_64 2 cores, torch 2.13, one thread: grouped / loop 0.66 and 0.34 at
# 4 and 16 local experts in fp32, 0.63 and 0.24 in bf16, padded bmm 0.86 and 0.40 in fp64).
GROUPED_DEFAULT: dict[tuple[str, torch.dtype], bool] = {
    ("cpu", torch.float32): True,
    ("cpu", torch.bfloat16): True,
    ("cpu", torch.float64): True,
}


def grouped_mm_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch's grouped matmul runs here: present in this torch, and not float64
    (no kernel has it)."""
    present = hasattr(torch.nn.functional, "grouped_mm") or hasattr(torch, "_grouped_mm")
    return present and dtype in (torch.float32, torch.bfloat16, torch.float16)


def local_kernel(experts: Any) -> str:
    """What the local experts run: ``"model"`` (the model's own implementation, as its
    config picks it), ``"padded_bmm"`` where the model would run transformers'
    ``grouped_mm`` but torch has no kernel here, or ``"eager"`` (the model's loop) where
    the grouped form was measured slower. An implementation other than ``grouped_mm``
    set on the model's config is its choice and is kept."""
    implementation = getattr(getattr(experts, "config", None), "_experts_implementation", None)
    if implementation not in (None, "grouped_mm"):
        return "model"
    weight = next(experts.parameters(recurse=False))
    if not GROUPED_DEFAULT.get((weight.device.type, weight.dtype), True):
        return "eager"
    return "model" if grouped_mm_available(weight.device, weight.dtype) else "padded_bmm"


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            transposed: bool) -> torch.Tensor:
    """``(E, C, in) -> (E, C, out)`` with weights ``(E, out, in)`` (``(E, in, out)``
    when ``transposed``) and biases ``(E, out)``."""
    out = torch.bmm(x, weight if transposed else weight.transpose(1, 2))
    return out if bias is None else out + bias.unsqueeze(1)


def padded_bmm_forward(experts: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                       top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts module's function (``experts(hidden, top_k_index, top_k_weights)``)
    as two batched matmuls over ``(E, C, ·)`` padded rows, ``C`` the busiest expert's
    rows. The gate, activation, biases, transposed layout and post-expert norm are the
    module's own (``_apply_gate``, ``act_fn``, ``has_bias``, ``is_transposed``)."""
    e, k = experts.num_experts, top_k_index.shape[-1]
    ids = top_k_index.reshape(-1)
    order = torch.argsort(ids, stable=True)
    sorted_ids = ids[order]
    counts = torch.bincount(sorted_ids, minlength=e)
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.arange(ids.numel(), device=ids.device) - starts[sorted_ids]
    capacity = int(counts.max()) if ids.numel() else 0
    rows = hidden_states[order // k]
    padded = rows.new_zeros(e, capacity, rows.shape[-1]).index_put((sorted_ids, slot), rows)
    bias = getattr(experts, "gate_up_proj_bias" if experts.has_gate else "up_proj_bias", None)
    weight = experts.gate_up_proj if experts.has_gate else experts.up_proj
    up = _linear(padded, weight, bias if experts.has_bias else None, experts.is_transposed)
    act = experts._apply_gate(up) if experts.has_gate else experts.act_fn(up)
    down_bias = getattr(experts, "down_proj_bias", None) if experts.has_bias else None
    out = _linear(act, experts.down_proj, down_bias, experts.is_transposed)
    if getattr(experts, "has_post_expert_norm", False):
        out = experts.post_expert_norm(out)
    picked = out[sorted_ids, slot] * top_k_weights.reshape(-1)[order].unsqueeze(-1)
    result = torch.zeros_like(picked).index_copy(0, order, picked)
    return result.view(-1, k, result.shape[-1]).sum(1).to(hidden_states.dtype)
