"""Bytes resident on one rank: model states, activations, communication buffers.

Model states follow ZeRO (Rajbhandari et al., arXiv:1910.02054, section 3 and Table 1):
mixed precision keeps 2 bytes of weights and 2 of gradients per parameter plus K = 12 of
optimizer state (fp32 master weights, Adam momentum and variance); fp32 training keeps
4 + 4 + 8, and so does paraxis under ``train.precision`` bf16 or fp16 (its parameters
are the fp32 master weights and autocast makes the 2-byte copies per use,
:mod:`paraxis.engine.precision`), so under ZeRO-1 it holds 8 + 8/N where the paper's
scheme holds 4 + 12/N. Another optimizer than Adam changes K (SGD with momentum: 4).
ZeRO stage 1 divides the optimizer term by the data-parallel degree N, stage 2 also
the gradients, stage 3 also the weights. Dense parameters are replicated, hence sharded,
over data x expert x context; expert parameters over data x context (DESIGN
section 2), and split over the tensor group when ``expert_tensor`` > 1.

Activations per layer follow Korthikanti et al. (arXiv:2205.05198, Table 2), bytes for
2-byte activations and 1-byte dropout masks (s sequence, b microbatch, h hidden, a heads,
t tensor degree)::

    no parallelism               sbh(34 + 5as/h)
    tensor parallel              sbh(10 + 24/t + 5as/(ht))
    tensor + sequence parallel   sbh(34/t + 5as/(ht))
    selective recompute          the same without the 5as/h attention-core term
    full recompute               2sbh (the layer input only; /t with sequence parallel)

Written for element size e: 10 = 4e + 2 (norm inputs, attention and MLP inputs, two
dropout masks), 24 = 12e, 5 = 2e + 1 (scores, softmax, its dropout mask), so fp32
doubles all but the masks. A mixture-of-experts layer keeps its MLP terms (19 of the 34)
once per routed copy of a token (top-k). Context parallelism divides by C (each rank
keeps its s/C queries against all keys). The last stage adds the output layer's inputs
and fp32 logits, 4sbv/t (section 4.3).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from paraxis.config.parallel import ParallelConfig
from paraxis.planner.activations import (
    exact_head_bytes,
    exact_layer_bytes,
    exact_stage_bytes,
    is_exact,
)
from paraxis.planner.inputs import Workload
from paraxis.planner.model import LayerCount, ModelCounts
from paraxis.planner.schedule import alive_units, holds_ends, last_stage_alive, layout_chunks

__all__ = ["BYTES_PER_PARAM", "Memory", "held_params", "layer_activation_bytes",
           "model_state_bytes", "rank_layers", "rank_memory", "shard_group_sizes"]

MiB = 2**20
# (weights, gradients, optimizer state) bytes per parameter; ZeRO's 2 + 2 + K, K = 12.
BYTES_PER_PARAM = {"mixed": (2, 2, 12), "fp32": (4, 4, 8), "bf16": (4, 4, 8),
                   "fp16": (4, 4, 8)}
TERMS = ("parameters", "gradients", "optimizer", "activations", "buffers")


def model_state_bytes(dense: float, expert: float = 0.0, *, zero: int, n_dense: int,
                      n_expert: int = 1, precision: str = "mixed",
                      optimizer_bytes: float | None = None, whole: float = 0.0,
                      trainable: float | None = None) -> tuple[float, ...]:
    """(weights, gradients, optimizer) bytes of one rank holding ``dense`` and ``expert``
    parameters, ZeRO stage ``zero`` over shard groups of ``n_dense`` / ``n_expert``
    ranks (``optimizer_bytes`` per parameter replaces Adam's K), and ``whole`` more
    parameters ZeRO never shards (a word embedding tied across pipeline stages, whose
    gradient is summed over the two after ZeRO's reduction:
    :func:`paraxis_zero.whole.keep_whole`; the dry run found it whole, issue 32).

    Every rank holds 1/n of each sharded tensor: a fused expert tensor with fewer local
    experts than ranks is split along a dimension that has enough rows
    (:func:`paraxis_zero.layout.shard_dim`, issue 36; before, it was split along its
    experts and one rank kept all of it, which this function modelled). Dense matrices'
    padding (rows not a multiple of ``n``) is left out. Under HSDP
    (``parallelism.zero_shard``) ``n_dense`` and ``n_expert`` are the shard groups', not
    the replicas'. ``trainable``: of ``dense``, the parameters with a gradient (a LoRA
    run's adapters, :mod:`paraxis.planner.lora`); the others, ``whole`` too, are frozen:
    weights only (DESIGN section 10)."""
    w, g, k = BYTES_PER_PARAM[precision]
    k = k if optimizer_bytes is None else optimizer_bytes

    def held(stage: int) -> float:  # the rank's share once ZeRO stage `stage` shards it
        if zero >= stage:
            return dense / n_dense + expert / n_expert
        return dense + expert

    if trainable is not None:
        def own(stage: int) -> float:
            return trainable / n_dense if zero >= stage else trainable

        return w * (held(3) + whole), g * own(2), k * own(1)
    return w * (held(3) + whole), g * (held(2) + whole), k * (held(1) + whole)


def shard_group_sizes(layout: ParallelConfig) -> tuple[int, int]:
    """(dense, expert) ranks ZeRO splits a parameter over: the gradient-sync groups
    (data x expert x context; data x context), or under HSDP the same with data
    narrowed to ``zero_shard`` ranks."""
    par = layout.parallelism
    narrowed = layout.token_replicas // par.data * (par.zero_shard or par.data)
    return narrowed, narrowed // par.expert


def layer_activation_bytes(*, s: int, b: int, h: int, a: int, t: int = 1,
                           sp: bool = False, recompute: str = "none", element: int = 2,
                           context: int = 1, top_k: int = 1) -> float:
    """Bytes one transformer layer keeps for its backward (Korthikanti et al., Table 2);
    ``top_k`` > 1 for a mixture-of-experts layer."""
    sbh = s * b * h
    shard = t if sp else 1  # what tensor parallelism alone leaves whole, SP splits
    if recompute == "full":
        return element * sbh / shard / context
    outside = (4 * element + 2) / shard  # 10 at e = 2
    inside = 12 * element / t  # 24 at e = 2
    extra = (top_k - 1) * ((element + 1) / shard + 8 * element / t)  # routed MLP copies
    per_sbh = outside + inside + extra
    if recompute != "selective":
        per_sbh += (2 * element + 1) * a * s / (h * t)  # 5as/(ht) at e = 2
    return sbh * per_sbh / context


@dataclass(frozen=True)
class Memory:
    """Bytes on one pipeline rank (any of its data/tensor/... peers holds the same)."""

    stage: int
    parameters: float
    gradients: float
    optimizer: float
    activations: float
    buffers: float
    notes: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def total(self) -> float:
        return sum(getattr(self, k) for k in TERMS)

    @property
    def largest(self) -> tuple[str, float]:
        return max(((k, getattr(self, k)) for k in TERMS), key=lambda kv: kv[1])

    def as_dict(self) -> dict[str, float]:
        return {**{k: getattr(self, k) for k in TERMS}, "total": self.total}


def rank_layers(counts: ModelCounts, layout: ParallelConfig, rank: int) -> list[LayerCount]:
    """The layers pipeline rank ``rank`` holds (all its chunks')."""
    return [counts.layers[i] for start, n in layout_chunks(counts, layout)[rank]
            for i in range(start, start + n)]


def held_params(counts: ModelCounts, layers: list[LayerCount], first: bool, last: bool,
                 t: int, e: int, p: int, etp: int = 1) -> tuple[float, float]:
    """(dense, expert) parameters this rank holds: matrices and the vocabulary split over
    tensor, norms and biases whole; experts split over expert, and over ``etp`` tensor
    ranks (``expert_tensor``; 1: whole on each tensor rank; measured by ``paraxis plan
    --dry-run``); a tied head is a second copy on the last stage when the embedding
    lives on another one."""
    # An adapter's side its base does not split is whole (paraxis.planner.lora)
    dense = sum(c.matrices / t + c.vectors + c.adapters_whole * (1 - 1 / t) for c in layers)
    expert = sum(c.experts / (e * etp) for c in layers)
    if first:
        dense += counts.embedding / t
    if last:
        head = counts.embedding if counts.tied and not first else counts.head
        dense += head / t + counts.final
    return dense, expert


def rank_memory(counts: ModelCounts, layout: ParallelConfig, work: Workload,
                rank: int = 0) -> Memory:
    """Bytes on pipeline rank ``rank`` (0 is the first stage)."""
    par, sched = layout.parallelism, layout.schedule
    t, p, e = par.tensor, par.pipeline, par.expert
    v, m = sched.virtual_stages, sched.microbatches
    chunks = layout_chunks(counts, layout)[rank]
    layers = rank_layers(counts, layout, rank)
    first, last = holds_ends(sched.pipeline_schedule, p, rank)
    dense, expert = held_params(counts, layers, first, last, t, e, p, par.expert_tensor)
    # ZeRO keeps an embedding tied across pipeline stages whole, on the first and last.
    tied = counts.embedding / t if counts.tied and p > 1 and (first or last) else 0.0
    n_dense, n_expert = shard_group_sizes(layout)
    trainable = rank_trainable(counts, layers, t)
    weights, grads, optim = model_state_bytes(
        dense - tied, expert, whole=tied, zero=par.zero, n_dense=n_dense,
        n_expert=n_expert, precision=work.precision, optimizer_bytes=work.optimizer_bytes,
        trainable=trainable)

    alive = alive_units(sched.pipeline_schedule, p, m, v, rank)
    acts = _activations(counts, layout, work, rank, alive)
    buffers, notes = _buffers(counts, layout, work, layers)
    notes.update(layers=len(layers), alive_microbatches=alive, chunks=len(chunks))
    return Memory(rank, weights, grads, optim, acts, buffers, notes)


def rank_trainable(counts: ModelCounts, layers: list[LayerCount], t: int) -> float | None:
    """The parameters with a gradient among ``layers`` on one tensor rank when others
    are frozen (a LoRA run's adapters); None when every parameter trains."""
    if not counts.lora_rank:
        return None
    return sum((c.adapters - c.adapters_whole) / t + c.adapters_whole for c in layers)


def most_trainable(counts: ModelCounts, layout: ParallelConfig) -> float | None:
    """The most :func:`rank_trainable` parameters a pipeline rank holds (None when every
    parameter trains)."""
    if not counts.lora_rank:
        return None
    t = layout.parallelism.tensor
    return max(rank_trainable(counts, rank_layers(counts, layout, r), t) or 0.0
               for r in range(layout.parallelism.pipeline))


def _activations(counts: ModelCounts, layout: ParallelConfig, work: Workload, rank: int,
                 alive: int) -> float:
    """Activation bytes on pipeline rank ``rank`` with ``alive`` microbatch units held:
    counted from the layer structure when :mod:`~paraxis.planner.activations` knows it,
    else Korthikanti's per-layer constants."""
    par, sched = layout.parallelism, layout.schedule
    t, p, c = par.tensor, par.pipeline, par.context
    shape = dict(s=work.seq, b=work.micro_batch, t=t, sp=par.sequence_parallel,
                 recompute=sched.activation_checkpointing, element=work.element_size,
                 context=c)
    if is_exact(counts):
        ulysses = c > 1 and par.context_mode == "ulysses"
        dense_layer = exact_layer_bytes(counts, **shape, ulysses=ulysses)
        dispatched = par.expert > 1 or layout.moe.capacity_factor is not None
        moe_layer = exact_layer_bytes(counts, **shape, moe=True, ulysses=ulysses,
                                      etp=par.expert_tensor, dispatched=dispatched)
    else:
        dense_layer = layer_activation_bytes(**shape, h=counts.hidden_size,
                                             a=counts.num_heads)
        moe_layer = layer_activation_bytes(**shape, h=counts.hidden_size,
                                           a=counts.num_heads, top_k=counts.top_k)
    per_chunk = []
    for start, n in layout_chunks(counts, layout)[rank]:
        moe = sum(1 for i in range(start, start + n) if counts.layers[i].experts)
        per_chunk.append(moe * moe_layer + (n - moe) * dense_layer)
    # Alive units are taken from the rank's chunks in turn (warm-up runs chunk by chunk).
    acts = sum(per_chunk) / len(per_chunk) * alive
    last_alive = last_stage_alive(sched.pipeline_schedule, p, sched.microbatches)
    last = holds_ends(sched.pipeline_schedule, p, rank)[1]
    if is_exact(counts):
        sp = par.sequence_parallel
        acts += alive * exact_stage_bytes(counts, work, t=t, sp=sp, context=c,
                                          first=rank == 0)
        if last:
            acts += last_alive * exact_head_bytes(counts, work, t=t, sp=sp, context=c)
        return acts
    if last:
        sbh = work.seq * work.micro_batch * counts.hidden_size
        shard = t if par.sequence_parallel else 1
        logits = 4 * work.seq * work.micro_batch * counts.vocab_size / t
        acts += (2 * work.element_size * sbh / shard + logits) / c * last_alive
    return acts


def _buffers(counts: ModelCounts, layout: ParallelConfig, work: Workload,
             layers: list[LayerCount]) -> tuple[float, dict[str, Any]]:
    """Data-parallel bucket (zero 0-2), ZeRO-3's gathered layers (the one running and the
    ``zero_prefetch`` prefetched) in the compute dtype and as many layers' gradients in
    flight in their reduce-scatters, pipeline receive buffers (an
    activation and a gradient). Beside a pipeline, ZeRO-2 and 3 hold the stage's whole
    gradients through the schedule, and ZeRO-3 every layer of the stage gathered."""
    par = layout.parallelism
    t, e = par.tensor, par.expert * par.expert_tensor  # what splits the experts
    grad = BYTES_PER_PARAM[work.precision][1]
    out: dict[str, Any] = {}
    params = [c.matrices / t + c.vectors + c.experts / e for c in layers]
    trainable = rank_trainable(counts, layers, t)
    graded = sum(params) if trainable is None else trainable
    if layout.token_replicas > 1:
        if par.zero < 3:  # one bucket in flight, never more than the gradients it holds
            out["data_bucket"] = min(par.bucket_mb * MiB, graded * grad)
        elif layers and par.pipeline > 1:  # gathered once per step, kept (issue 36)
            out["zero3_gathered"] = sum(params) * work.element_size
        elif layers:  # in the compute dtype (issue 36)
            out["zero3_gathered"] = (1 + par.zero_prefetch) * max(params) * work.element_size
            # as many units' whole gradients in flight in their reduce-scatters
            out["zero3_reducing"] = (1 + par.zero_prefetch) * max(params) * grad
        if par.zero >= 2 and par.pipeline > 1:
            out["zero_whole_grads"] = sum(params) * grad
    if par.pipeline > 1:
        shard = t if par.sequence_parallel else 1
        out["pipeline_recv"] = 2 * work.micro_batch * work.seq * counts.hidden_size \
            * work.element_size / shard / par.context
    return sum(out.values()), {"buffers": out}
