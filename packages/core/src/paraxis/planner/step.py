"""Step time and MFU: each operation at its measured efficiency, each axis's
communication exposed as the engine overlaps it (issue 38).

Model FLOPs per token are PaLM's 6N + 12·L·H·Q·T (arXiv:2204.02311, appendix B), the
accounting of :mod:`paraxis.engine.metrics` and of torchtitan's and NVIDIA's published
MFU, N the non-embedding parameters a token runs through (top-k of the experts).

    microbatch = GEMMs + attention + elementwise + exposed launches + recompute
                 on the busiest pipeline rank (paraxis.planner.cost)
    busy       = m x microbatch + in-layer communication left exposed
    step       = busy / (1 - bubble) + pipeline fill/drain sends + data exposure
                 + optimizer (memory-bound pass over the rank's shard)
    MFU        = model FLOPs / (step x world x peak)

A collective costs ``collective_s`` per call plus its bus bytes at ``link_efficiency``
of the link; a group spanning nodes runs at min(intra, inter x its members per node):
NCCL's rings cross each node boundary once per channel, one NIC each, so the inter-node
hops share the node's NICs (stas00/ml-engineering, "Inter-node speed depends on
intra-node speed"). What each axis hides, as the engine runs it:

* tensor (and expert_tensor): nothing, unless ``parallelism.tensor_overlap: on``, whose
  ring steps hide under the split linears' GEMMs (all but one step of t); ``auto`` is
  off on NCCL until a GPU run validates it (paraxis.runtime.cuda_paths);
* context: ring K/V hops hide under the other blocks' attention; Ulysses hides nothing;
* expert: nothing, unless ``moe.dispatch_chunks`` c > 1: all but 1/c hides under the
  other chunks' expert GEMMs;
* pipeline: sends overlap other microbatches; the fill and the drain (2(p·v - 1)
  messages) are exposed, with the bubble;
* data, ZeRO 0-2: buckets reduce under the last microbatch's backward (earlier ones
  accumulate under no_sync), at least the last bucket exposed; ZeRO-1/2's all-gather
  of the updated shards follows the optimizer step, exposed; ZeRO-3: each unit's
  all-gather hides under the previous unit's compute with ``zero_prefetch`` >= 1 (all
  exposed at 0), the first exposed, the reduce-scatters under the backward but the last;
  beside a pipeline the units are gathered once per step, under the first microbatch;
* data_replica (HSDP's all-reduce of the gradient shards across shard groups): each
  unit's right after its reduce-scatter, under the rest of the backward but the last.

``overlap`` (the table's) scales every hiding window: 1 on a GPU's separate
communication engines, measured by ``--calibrate`` where compute and communication
share the same cores.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from paraxis.config.parallel import AXES, TOKEN_AXES, ParallelConfig
from paraxis.engine.metrics import flops_per_token
from paraxis.planner.comm import AxisComm
from paraxis.planner.cost import Compute, optimizer_seconds, rank_compute
from paraxis.planner.inputs import Hardware, Workload
from paraxis.planner.memory import MiB, rank_layers
from paraxis.planner.model import ModelCounts

__all__ = ["StepEstimate", "estimate_step", "model_flops_per_token"]

GROUP_AXES = {"data": TOKEN_AXES, "tensor": ("tensor",), "expert_tensor": ("tensor",),
              "pipeline": ("pipeline",), "expert": ("expert",), "context": ("context",)}
IN_LAYER = ("tensor", "expert", "expert_tensor", "context")


@dataclass(frozen=True)
class StepEstimate:
    compute_s: float  # model work per step on the busiest rank (no recompute)
    recompute_s: float
    bubble_s: float
    exposed_s: dict[str, float] = field(default_factory=dict)
    step_s: float = 0.0
    mfu: float = 0.0
    tokens_per_s: float = 0.0
    # Seconds per step by kind: gemm, attention, elementwise, launch, optimizer.
    detail: dict[str, float] = field(default_factory=dict)
    comm_s: dict[str, float] = field(default_factory=dict)  # each axis's whole time
    overlap: dict[str, str] = field(default_factory=dict)  # how each axis hides, in words

    def components(self) -> dict[str, float]:
        """Seconds by cause, for explaining why one layout is slower than another."""
        kinds = {k: v for k, v in self.detail.items() if k != "launch" or v > 0}
        return {**kinds, "recompute": self.recompute_s, "bubble": self.bubble_s,
                **self.exposed_s}


def model_flops_per_token(counts: ModelCounts, seq: int) -> float:
    return flops_per_token(counts.active_non_embedding, counts.num_layers, counts.num_heads,
                           counts.head_dim, seq)


def members_per_node(degrees: dict[str, int], axes: tuple[str, ...], gpus_per_node: int,
                     ) -> int:
    """Members of one group over ``axes`` inside one node (ranks in mesh order, tensor
    fastest, ``gpus_per_node`` consecutive ranks a node)."""
    room, members = gpus_per_node, 1
    for axis in reversed(AXES):
        take = math.gcd(room, degrees.get(axis, 1))
        if axis in axes:
            members *= take
        room //= take
    return members


def _seconds(a: AxisComm, calls: float, layout: ParallelConfig, hw: Hardware) -> float:
    eff = hw.efficiency
    assert hw.intra_bw and hw.inter_bw
    bw = hw.intra_bw
    if a.link == "inter":
        local = members_per_node(layout.degrees, GROUP_AXES.get(a.axis, (a.axis,)),
                                 hw.gpus_per_node)
        bw = min(hw.intra_bw, hw.inter_bw * local)
    return calls * eff.collective_s + a.bytes / (bw * eff.link_efficiency)


def _calls(a: AxisComm, layout: ParallelConfig, layers: int, moe: int) -> float:
    """Collective calls per step on the busiest rank."""
    par, sched, axis = layout.parallelism, layout.schedule, a.axis
    m = sched.microbatches
    replays = {"none": 0, "selective": 1, "full": 2}[sched.activation_checkpointing]
    if axis == "tensor":
        return m * ((4 + replays) * layers + 4)
    if axis == "expert_tensor":
        return m * 4 * moe
    if axis == "expert":
        return m * 4 * moe * layout.moe.dispatch_chunks
    if axis == "context":
        c = par.context
        return m * layers * (3 * (c - 1) if par.context_mode == "ring" else 8)
    if axis == "pipeline":
        return m * 2 * sched.virtual_stages
    if axis == "data_replica":  # HSDP: the shards' gradients, bucketed
        return max(1, math.ceil(a.bytes / (2 * par.bucket_mb * MiB)))
    if par.zero == 3:  # a gather per unit (per microbatch and pass, once beside a pipeline)
        return (layers + 2) * (_zero3_gathers(layout) + 1)  # and one reduce-scatter
    buckets = math.ceil(a.bytes / (2 * par.bucket_mb * MiB))  # ~2 bus bytes per byte held
    return max(1, buckets)


def estimate_step(counts: ModelCounts, layout: ParallelConfig, work: Workload,
                  comm: list[AxisComm], bubble: float, hw: Hardware) -> StepEstimate:
    """Seconds per optimizer step on ``hw`` (peak and link speeds set; its efficiency
    table times each kind of work)."""
    assert hw.peak_flops and hw.intra_bw and hw.inter_bw, "estimate_step needs a timed Hardware"
    eff, par, m = hw.efficiency, layout.parallelism, layout.schedule.microbatches
    p, world = par.pipeline, layout.world_size
    per_rank = [rank_compute(counts, layout, work, eff, hw.peak_flops, r) for r in range(p)]
    busiest = max(range(p), key=lambda r: per_rank[r].total)
    mb = per_rank[busiest]
    held = rank_layers(counts, layout, busiest)
    layers, moe = len(held), sum(1 for c in held if c.experts)
    comm_s = {a.axis: _seconds(a, _calls(a, layout, layers, moe), layout, hw) for a in comm}
    exposed, notes = {}, {}
    for a in comm:
        exposed[a.axis], notes[a.axis] = _exposed(a, comm_s[a.axis], mb, layout, work,
                                                  layers, eff.overlap)
    busy = m * mb.total + sum(s for axis, s in exposed.items() if axis in IN_LAYER)
    bubble_s = busy * bubble / (1.0 - bubble)
    optimizer = max(optimizer_seconds(counts, layout, work, eff, r) for r in range(p))
    step = busy + bubble_s + exposed.get("pipeline", 0.0) + exposed.get("data", 0.0) \
        + exposed.get("data_replica", 0.0) + optimizer
    tokens = work.global_batch * work.seq
    flops = tokens * model_flops_per_token(counts, work.seq)
    detail = {"gemm": m * mb.gemm, "attention": m * mb.attention,
              "elementwise": m * mb.elementwise, "launch": m * mb.launch,
              "optimizer": optimizer}
    compute = m * (mb.gemm + mb.attention + mb.elementwise + mb.launch)
    return StepEstimate(compute, m * mb.recompute, bubble_s, exposed, step,
                        flops / (step * world * hw.peak_flops), tokens / step, detail, comm_s,
                        notes)


def _exposed(a: AxisComm, seconds: float, mb: Compute, layout: ParallelConfig,
             work: Workload, layers: int, overlap: float) -> tuple[float, str]:
    """(exposed seconds per step, how it hides) of one axis; see the module docstring."""
    par, sched = layout.parallelism, layout.schedule
    m = sched.microbatches
    if a.axis in ("tensor", "expert_tensor"):
        if par.tensor_overlap != "on":
            return seconds, f"exposed (tensor_overlap {par.tensor_overlap}: off on NCCL)"
        hidden = overlap * m * mb.tensor_linear
        return max(seconds - hidden, seconds / par.tensor), "ring steps under the GEMMs"
    if a.axis == "context":
        if par.context_mode != "ring":
            return seconds, "exposed (Ulysses all-to-alls wait on the heads)"
        hidden = overlap * m * mb.attention * (par.context - 1) / par.context
        return max(0.0, seconds - hidden), "K/V hops under the other blocks' attention"
    if a.axis == "expert":
        chunks = layout.moe.dispatch_chunks
        if chunks == 1:
            return seconds, "exposed (moe.dispatch_chunks 1)"
        rest = seconds * (chunks - 1) / chunks
        return seconds / chunks + max(0.0, rest - overlap * m * mb.expert), \
            f"{chunks} chunks under the other chunks' expert GEMMs"
    if a.axis == "pipeline":
        fill = 2 * (par.pipeline * sched.virtual_stages - 1)
        sends = max(1, m * 2 * sched.virtual_stages)
        return min(seconds, seconds * fill / sends), \
            "under other microbatches; the fill and the drain exposed"
    return _data_exposed(a, seconds, mb, layout, work, layers, overlap)


def _data_exposed(a: AxisComm, seconds: float, mb: Compute, layout: ParallelConfig,
                  work: Workload, layers: int, overlap: float) -> tuple[float, str]:
    par = layout.parallelism
    g, w = work.grad_wire_bytes, work.weight_bytes
    if a.axis == "data_replica":  # each unit's shards all-reduced after its reduce-scatter
        units = layers + 2
        return max(seconds - overlap * mb.backward, seconds / units), \
            "each unit's shards after its reduce-scatter, under the backward but the last"
    if par.zero == 3:
        units, gathers = layers + 2, _zero3_gathers(layout)
        el = work.element_size  # ZeRO-3 gathers in the compute dtype (issue 36)
        gather = seconds * gathers * el / (gathers * el + g)
        per_unit = gather / (gathers * units)
        scatter = (seconds - gather) / units
        if par.zero_prefetch == 0:
            return gather + scatter, "every all-gather exposed (zero_prefetch 0)"
        window = overlap * mb.total / units  # one unit's forward + backward compute
        if gathers == 1:  # beside a pipeline: gathered once, under the first microbatch
            return per_unit + (units - 1) * max(0.0, per_unit - window / 3) + scatter, \
                "units gathered once per step, under the first microbatch's forward"
        forward = max(0.0, per_unit - window / 3)
        backward = max(0.0, per_unit - 2 * window / 3)
        return per_unit + gathers // 2 * units * (forward + backward) + scatter, \
            "each unit's gather under the previous unit's compute (prefetch)"
    reduce = seconds if par.zero == 0 else seconds * g / (g + w)
    bucket = seconds * min(1.0, par.bucket_mb * MiB * 2 / max(a.bytes, 1.0))
    exposed = max(reduce - overlap * mb.backward, bucket)
    if par.zero == 0:
        return exposed, "buckets under the last microbatch's backward"
    return exposed + seconds - reduce, \
        "buckets under the last backward; the all-gather after the step exposed"


def _zero3_gathers(layout: ParallelConfig) -> int:
    """ZeRO-3's gathers of each unit per step: forward and backward of every microbatch,
    or once per step beside a pipeline, which keeps its units through the schedule
    (planner.comm, issue 36)."""
    return 1 if layout.parallelism.pipeline > 1 else 2 * layout.schedule.microbatches
