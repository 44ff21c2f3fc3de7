"""Step time and MFU, a first-order estimate from FLOPs, bytes and link speeds.

Model FLOPs per token are PaLM's 6N + 12·L·H·Q·T (arXiv:2204.02311, appendix B), the
accounting of :mod:`paraxis.engine.metrics`, with N the non-embedding parameters a token runs
through (top-k of the experts). Recomputation costs time but is not model FLOPs (HFU,
not MFU): selective adds the attention block's forward (its projections, 2·N_attn, and
the core, 4·L·H·Q·T), full a whole forward (2N + 4·L·H·Q·T).

    compute   = tokens x FLOPs per token / (world x peak)   kernels at the given peak
    in-layer  = tensor, expert and Ulysses traffic / link    exposed (inside each layer)
              + ring traffic beyond the attention compute it hides under
    step      = (compute + in-layer) / (1 - bubble)
              + pipeline sends / link                        exposed (conservative)
              + data: what the backward cannot hide, at least the last bucket;
                ZeRO-3: what forward + backward cannot hide, at least the first gather
    MFU       = model FLOPs / (step x world x peak)

Pass the FLOP/s your kernels reach (e.g. 0.6 x the datasheet) for a realistic time; at
the datasheet peak the step time is a lower bound and MFU an upper bound.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from paraxis.config.parallel import ParallelConfig
from paraxis.engine.metrics import flops_per_token
from paraxis.planner.comm import AxisComm
from paraxis.planner.inputs import Hardware, Workload
from paraxis.planner.memory import MiB
from paraxis.planner.model import ModelCounts

__all__ = ["StepEstimate", "estimate_step", "model_flops_per_token"]

IN_LAYER = ("tensor", "expert", "expert_tensor", "context")


@dataclass(frozen=True)
class StepEstimate:
    compute_s: float  # model FLOPs only
    recompute_s: float
    bubble_s: float
    exposed_s: dict[str, float] = field(default_factory=dict)
    step_s: float = 0.0
    mfu: float = 0.0
    tokens_per_s: float = 0.0

    def components(self) -> dict[str, float]:
        """Seconds by cause, for explaining why one layout is slower than another."""
        return {"compute": self.compute_s, "recompute": self.recompute_s,
                "bubble": self.bubble_s, **self.exposed_s}


def model_flops_per_token(counts: ModelCounts, seq: int) -> float:
    return flops_per_token(counts.active_non_embedding, counts.num_layers, counts.num_heads,
                           counts.head_dim, seq)


def _recompute_flops_per_token(counts: ModelCounts, seq: int, mode: str) -> float:
    core = 4.0 * counts.num_layers * counts.num_heads * counts.head_dim * seq
    if mode == "full":
        return 2.0 * counts.active_non_embedding + core
    if mode == "selective":
        q, kv = counts.num_heads * counts.head_dim, counts.kv_heads * counts.head_dim
        attn_params = counts.num_layers * counts.hidden_size * (2 * q + 2 * kv)
        return 2.0 * attn_params + core
    return 0.0


def estimate_step(counts: ModelCounts, layout: ParallelConfig, work: Workload,
                  comm: list[AxisComm], bubble: float, hw: Hardware) -> StepEstimate:
    """Seconds per optimizer step on ``hw`` (whose peak and bandwidths must be set)."""
    assert hw.peak_flops and hw.intra_bw and hw.inter_bw, "estimate_step needs a timed Hardware"
    world = layout.world_size
    tokens = work.global_batch * work.seq
    flops = tokens * model_flops_per_token(counts, work.seq)
    compute = flops / (world * hw.peak_flops)
    recompute = tokens * _recompute_flops_per_token(
        counts, work.seq, layout.schedule.activation_checkpointing) / (world * hw.peak_flops)
    attention = tokens * 12.0 * counts.num_layers * counts.num_heads * counts.head_dim \
        * work.seq / (world * hw.peak_flops)
    exposed: dict[str, float] = {}
    for a in comm:
        seconds = a.bytes / (hw.intra_bw if a.link == "intra" else hw.inter_bw)
        if a.axis == "context" and layout.parallelism.context_mode == "ring":
            seconds = max(0.0, seconds - attention)
        elif a.axis in ("data", "data_replica"):  # HSDP's second data entry
            seconds = _data_exposed(a, layout, seconds, compute + recompute)
        exposed[a.axis] = seconds
    in_layer = sum(s for axis, s in exposed.items() if axis in IN_LAYER)
    busy = compute + recompute + in_layer
    bubble_s = busy * bubble / (1.0 - bubble)
    step = busy + bubble_s + exposed.get("pipeline", 0.0) + exposed.get("data", 0.0) \
        + exposed.get("data_replica", 0.0)
    return StepEstimate(compute, recompute, bubble_s, exposed, step,
                        flops / (step * world * hw.peak_flops), tokens / step)


def _data_exposed(a: AxisComm, layout: ParallelConfig, seconds: float, busy: float) -> float:
    par, m = layout.parallelism, layout.schedule.microbatches
    if par.zero == 3:
        return max(seconds - busy, seconds / (2 * m + 1 if par.pipeline == 1 else 2))
    backward = busy * 2.0 / 3.0  # backward is about twice the forward
    bucket_share = min(1.0, par.bucket_mb * MiB * 2 / max(a.bytes, 1.0))
    return max(seconds - backward, seconds * bucket_share)
