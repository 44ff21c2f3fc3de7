"""Bytes each rank sends per optimizer step, by axis, and the link each axis crosses.

Bus convention (NCCL tests; paraxis.runtime.collectives counts the same way): a ring all-reduce
of S bytes moves 2S(n-1)/n per rank, an all-gather or reduce-scatter S(n-1)/n, an
all-to-all the bytes sent to other ranks, send/recv the message. Activation elements
are 2 bytes except under fp32 (``Workload.element_size``); gradients and weights on the
data axis travel as ``Workload.grad_wire_bytes`` and ``weight_bytes``.

* data (ZeRO 0-2): 2Ψ(N-1)/N of gradient bytes Ψ, once per step (all-reduce, or
  reduce-scatter plus all-gather: the same volume; ZeRO section 7). ZeRO-3: 3Ψ(N-1)/N,
  weights all-gathered in forward and again in backward (a plain embedding lookup's
  table in forward only: its backward reads no weight), gradients reduce-scattered;
  with m microbatches the gathers repeat per microbatch: (2m+1)Ψ(N-1)/N; beside a
  pipeline a stage gathers once per step and keeps its units: 2Ψ(N-1)/N. ZeRO-3's
  gathers move the compute dtype (bf16 under ``train.precision`` bf16). Under HSDP
  (``zero_shard`` = N of the D data ranks) those stay in the shard group and the
  rank's gradient shards, Ψ/N, are all-reduced across the D/N groups: 2(Ψ/N)(R-1)/R
  with R = D/N (``data_replica``, its own link).
* tensor: 8·b·s·h·(t-1)/t elements per layer per microbatch: Megatron-LM's 4 all-reduces
  of the b·s·h layer output per layer (g after attention and after the MLP in forward,
  f before each in backward; Shoeybi et al., arXiv:1909.08053, section 3), 2(t-1)/t each.
  A mixture-of-experts layer without a dense (shared) MLP has only attention's 2:
  paraxis leaves its MoE block outside the tensor plan. Under sequence parallelism the
  experts, whole on each tensor rank (``expert_tensor`` 1), saw only their rank's tokens,
  so their gradients are all-reduced once per step, as the norms' are.
  Sequence parallelism swaps each for an all-gather plus a reduce-scatter, the same
  volume (Korthikanti et al., section 4.2.2). Recompute replays forward collectives:
  +1 all-reduce per layer for paraxis's selective (the attention block with its
  projections), +2 for full.
* pipeline: b·s·h per stage boundary per microbatch each way (activation forward,
  its gradient backward); divided by t with sequence parallelism (the boundary tensor
  stays sequence-sharded).
* expert: all-to-all dispatch and combine of T·k tokens of h elements, 2·T·k·h·(E-1)/E
  per MoE layer each way (forward, backward); T = b·s tokens per microbatch on the
  rank (/t with sequence parallelism, /C with context).
* expert tensor (``expert_tensor`` = t > 1): each MoE layer's expert rows enter and
  leave the split FFN over the tensor group: under sequence parallelism an all-gather
  of the t ranks' rows and a reduce-scatter of the outputs, without it Megatron's f/g
  (an all-reduce of the output forward, of the input gradient backward); either way
  4·R·h·(t-1)/t per MoE layer per microbatch, forward and backward, R = T·k rows (T
  with sequence parallelism undivided, since the group gathers all t shares; T alone
  at expert degree 1 without a capacity, where the rows are the tokens themselves).
* context: Ulysses (Jacobs et al., arXiv:2309.14509) all-to-alls q, k, v and the output,
  (2h + 2h_kv)·b·s/C·(C-1)/C per layer each way (its 4Nh/P with h_kv = h); ring
  attention (Liu et al., arXiv:2310.01889) passes each rank's K/V block around the ring,
  2·b·s·h_kv·(C-1)/C per layer forward, twice that backward (K/V again and their
  gradients). Heads are split over t first.

Links: ranks are numbered in mesh order ``pipeline, data, expert, context, tensor``
(tensor fastest), ``gpus_per_node`` consecutive ranks per node. A group stays inside a
node ("intra") when the aligned block its members span fits a node; otherwise it
crosses nodes ("inter") and runs at the slower link's speed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from paraxis.config.parallel import AXES, TOKEN_AXES, ParallelConfig
from paraxis.planner.inputs import Workload
from paraxis.planner.memory import BYTES_PER_PARAM, shard_group_sizes
from paraxis.planner.model import LayerCount, ModelCounts
from paraxis.planner.schedule import holds_ends, layout_chunks

__all__ = ["AxisComm", "communication", "link_of"]


@dataclass(frozen=True)
class AxisComm:
    axis: str
    collective: str
    bytes: float  # sent per rank per optimizer step (bus convention)
    group: int  # ranks in the group
    link: str  # "intra" or "inter"
    overlap: str  # how this traffic can hide under compute
    per: str  # what one unit of it is, for explanations


def link_of(degrees: dict[str, int], axes: tuple[str, ...], gpus_per_node: int) -> str:
    """'intra' if every group along ``axes`` lies inside one node, else 'inter'."""
    world = math.prod(degrees.values())
    active = [a for a in axes if degrees.get(a, 1) > 1]
    if world <= gpus_per_node or not active:
        return "intra"
    stride = 1
    strides = {}
    for axis in reversed(AXES):
        strides[axis] = stride
        stride *= degrees.get(axis, 1)
    outer = min(active, key=AXES.index)  # the outermost axis of the group
    span = strides[outer] * degrees[outer]  # aligned block holding each group
    return "intra" if span <= gpus_per_node and gpus_per_node % span == 0 else "inter"


def _stage_layers(counts: ModelCounts, layout: ParallelConfig) -> list[list[int]]:
    return [[i for start, n in chunks for i in range(start, start + n)]
            for chunks in layout_chunks(counts, layout)]


def communication(counts: ModelCounts, layout: ParallelConfig, work: Workload, *,
                  gpus_per_node: int, dense_grad_params: float, expert_grad_params: float,
                  trainable_params: float | None = None) -> list[AxisComm]:
    """Per active axis, bytes the most loaded rank sends per step; ``*_grad_params`` are
    the parameters that rank holds before any ZeRO sharding, ``trainable_params`` those
    of them with a gradient when others are frozen (LoRA's adapters; None: all)."""
    par, sched = layout.parallelism, layout.schedule
    t, p, e, c = par.tensor, par.pipeline, par.expert, par.context
    m, v, el = sched.microbatches, sched.virtual_stages, work.element_size
    deg = layout.degrees
    b, s, h = work.micro_batch, work.seq, counts.hidden_size
    tokens = b * s / c  # this rank's tokens per microbatch
    per_rank = _stage_layers(counts, layout)
    layers = max(len(r) for r in per_rank)
    moe = max(sum(1 for i in r if counts.layers[i].experts) for r in per_rank)

    def link(*axes: str) -> str:
        return link_of(deg, axes, gpus_per_node)

    out: list[AxisComm] = []
    if layout.token_replicas > 1:
        out += _data(layout, work, dense_grad_params, expert_grad_params,
                     link(*TOKEN_AXES), gpus_per_node, trainable_params, counts.lookup)
    if t > 1:
        replays = {"none": 0, "selective": 1, "full": 2}[sched.activation_checkpointing]
        volume = max(_tensor_stage(counts, layout, work, r, layer_ids)
                     for r, layer_ids in enumerate(per_rank))
        op = "all-gather + reduce-scatter" if par.sequence_parallel else "all-reduce"
        out.append(AxisComm("tensor", op, volume, t, link("tensor"),
                            "none: on the critical path inside every layer",
                            f"{4 + replays} per layer per microbatch, plus the "
                            "vocabulary-parallel ends"))
    if p > 1:
        message = tokens * h * el / (t if par.sequence_parallel else 1)
        sends = _pipeline_sends(p, v)
        out.append(AxisComm("pipeline", "send/recv", sends * m * message, p, link("pipeline"),
                            "partly: overlaps other microbatches once the pipeline is full",
                            "one activation forward and one gradient backward per boundary"))
    if e > 1 and moe:
        routed = tokens / (t if par.sequence_parallel else 1) * counts.top_k
        volume = 2 * 2 * routed * h * (e - 1) / e * el * moe * m
        out.append(AxisComm("expert", "all-to-all", volume, e, link("expert"),
                            "none: dispatch waits on routing, combine on the experts",
                            "dispatch + combine per MoE layer, forward and backward"))
    if par.expert_tensor > 1 and moe:
        dispatched = e > 1 or layout.moe.capacity_factor is not None
        rows = tokens * (counts.top_k if dispatched else 1)
        passes = 4 + 2 * (sched.activation_checkpointing == "full")  # forward replayed
        volume = passes * rows * h * (t - 1) / t * el * moe * m
        op = "all-gather + reduce-scatter" if par.sequence_parallel else "all-reduce"
        out.append(AxisComm("expert_tensor", op, volume, t, link("tensor"),
                            "none: the experts wait on their rows",
                            "rows in and outputs out per MoE layer, forward and backward"))
    if c > 1:
        out.append(_context(counts, layout, work, layers, link("context")))
    return out


def _tensor_stage(counts: ModelCounts, layout: ParallelConfig, work: Workload, rank: int,
                  layer_ids: list[int]) -> float:
    """Tensor-axis bytes of pipeline rank ``rank`` per step: Megatron's 4 (+ replays) per
    layer, and at the ends of the model the vocabulary-parallel layers: the embedding's
    all-reduce (reduce-scatter + all-gather under SP) of b·s·h, the head's input
    all-reduced in backward (+ its all-gather forward under SP), the cross-entropy's
    max and (target logit, sum of exp) all-reduces over b·s fp32 values; under SP a
    stage after the first all-gathers the sequence-split input it received, and the
    norms' partial weight gradients are all-reduced once per step."""
    par, sched = layout.parallelism, layout.schedule
    t, m, el, sp = par.tensor, sched.microbatches, work.element_size, par.sequence_parallel
    ring = (t - 1) / t
    tokens = work.micro_batch * work.seq / par.context
    sbh = tokens * counts.hidden_size * el
    replays = {"none": 0, "selective": 1, "full": 2}[sched.activation_checkpointing]
    moe_only = sum(1 for i in layer_ids if counts.layers[i].experts
                   and not _has_dense_mlp(counts, counts.layers[i]))
    mlp = 2 + (sched.activation_checkpointing == "full")  # the MLP's, replays included
    per_mb = ((4 + replays) * len(layer_ids) - mlp * moe_only) * 2 * sbh * ring
    first, last = holds_ends(sched.pipeline_schedule, par.pipeline, rank)
    if first:
        per_mb += 2 * sbh * ring
    elif sp:  # a later stage gathers the sequence-split activations it received
        per_mb += sbh * ring
    if last:
        per_mb += (3 if sp else 2) * sbh * ring + 3 * 2 * tokens * 4 * ring
    once = 0.0
    if sp:  # norms (vectors) are replicated over tensor ranks that saw different tokens
        vectors = sum(counts.layers[i].vectors for i in layer_ids) \
            + (counts.final if last else 0)
        if par.expert_tensor == 1:  # whole experts that saw only this rank's tokens
            vectors += sum(counts.layers[i].experts for i in layer_ids) / par.expert
        once = 2 * vectors * BYTES_PER_PARAM[work.precision][1] * ring
    return per_mb * m + once


def _has_dense_mlp(counts: ModelCounts, layer: LayerCount) -> bool:
    """Whether a layer's matrices hold more than attention and a router: a dense or
    shared-expert MLP, which the tensor plan splits."""
    q, kv = counts.num_heads * counts.head_dim, counts.kv_heads * counts.head_dim
    return layer.matrices > counts.hidden_size * (2 * q + 2 * kv + counts.num_experts)


def _data(layout: ParallelConfig, work: Workload, dense: float, expert: float, link: str,
          gpus_per_node: int, trainable: float | None = None,
          lookup: float = 0.0) -> list[AxisComm]:
    """Gradients (and ZeRO's weights) over the replicas: dense over data x expert x
    context, expert parameters over data x context; gradients in
    ``work.grad_wire_bytes``, ZeRO 1-2's gathered fp32 masters in ``work.weight_bytes``,
    ZeRO-3's gathers in the compute dtype (``work.element_size``, issue 36), a plain
    embedding lookup's (``lookup``) for forward only. Under HSDP
    (``zero_shard``) the reduce-scatter and gathers stay inside the shard groups and the
    shards' gradients are all-reduced across them: a second entry, ``data_replica``.
    With frozen parameters (``trainable``: LoRA's adapters, dense) only the trainable
    ones' gradients are reduced and, under ZeRO 1-2, their updated weights gathered;
    ZeRO-3 still gathers every weight (frozen ones are sharded too)."""
    par, m = layout.parallelism, layout.schedule.microbatches
    n_dense, n_expert = shard_group_sizes(layout)
    g, w = work.grad_wire_bytes, work.weight_bytes
    held = dense * (n_dense - 1) / n_dense + expert * (n_expert - 1) / n_expert
    grad = held if trainable is None else trainable * (n_dense - 1) / n_dense
    hsdp = bool(par.zero and par.zero_shard and par.zero_shard < par.data)
    shard_link, replica_link = _hsdp_links(layout, gpus_per_node) if hsdp else (link, link)
    if par.zero == 3:
        gathers = 1 if par.pipeline > 1 else 2 * m  # kept through a pipeline's schedule
        # a plain lookup table is gathered for forward only
        once = lookup / par.tensor * (n_dense - 1) / n_dense * m if gathers > 1 else 0.0
        out = [AxisComm("data", f"all-gather x{gathers} per step + reduce-scatter",
                        (held * gathers - once) * work.element_size + grad * g, n_dense,
                        shard_link,
                        "prefetched under forward and backward compute",
                        "weights gathered per microbatch, gradients once per step"
                        if gathers > 1 else "weights gathered and gradients reduced once "
                        "per step")]
    else:
        op = "all-reduce" if par.zero == 0 else "reduce-scatter + all-gather"
        out = [AxisComm("data", op, grad * (2 * g if par.zero == 0 else g + w), n_dense,
                        shard_link, "bucketed under the backward; the last bucket is exposed",
                        "gradients once per step")]
    if hsdp:
        replicas = par.data // (par.zero_shard or par.data)
        shards = (dense / n_dense + expert / n_expert if trainable is None
                  else trainable / n_dense)  # this rank's shard of each gradient
        out.append(AxisComm("data_replica", "all-reduce of the shards' gradients",
                            2 * shards * (replicas - 1) / replicas * g, replicas,
                            replica_link, "after the reduce-scatter, in the step's tail",
                            "the rank's gradient shards once per step"))
    return out


def _hsdp_links(layout: ParallelConfig, gpus_per_node: int) -> tuple[str, str]:
    """(shard group, replica group) links under HSDP: the shard group is ``zero_shard``
    consecutive data ranks and the expert and context ranks inside them; the replica
    group spans the whole data axis."""
    deg = layout.degrees
    inner = math.prod(deg[a] for a in AXES[AXES.index("data") + 1:])

    def fits(span: int) -> str:
        if layout.world_size <= gpus_per_node:
            return "intra"
        return "intra" if span <= gpus_per_node and gpus_per_node % span == 0 else "inter"

    shard = layout.parallelism.zero_shard or deg["data"]
    return fits(inner * shard), fits(inner * deg["data"])


def _context(counts: ModelCounts, layout: ParallelConfig, work: Workload, layers: int,
             link: str) -> AxisComm:
    t, c = layout.parallelism.tensor, layout.parallelism.context
    b, s, h = work.micro_batch, work.seq, counts.hidden_size
    h_kv = counts.kv_heads * counts.head_dim / t
    if layout.parallelism.context_mode == "ulysses":
        per_layer = 2 * (2 * h / t + 2 * h_kv) * b * s / c * (c - 1) / c
        op, overlap = "all-to-all", "none: attention waits on its heads"
    else:
        per_layer = 3 * 2 * b * s * h_kv * (c - 1) / c
        op = "ring send/recv"
        overlap = "yes: the next K/V block moves under this block's attention"
    volume = per_layer * work.element_size * layers * layout.schedule.microbatches
    return AxisComm("context", op, volume, c, link, overlap, "per layer per microbatch")


def _pipeline_sends(p: int, v: int) -> int:
    """Messages the busiest rank sends per microbatch: forward out of every chunk but the
    last global stage, backward out of every chunk but the first."""
    stages = p * v
    return max(sum((k < stages - 1) + (k > 0) for k in range(r, stages, p)) for r in range(p))
