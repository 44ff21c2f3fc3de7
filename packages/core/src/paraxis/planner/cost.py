"""Seconds of one microbatch on one rank, operation by operation (issue 38).

Each kind of work is timed at the share of the device the efficiency table
(:mod:`paraxis.planner.efficiency`) gives for its size, on the rank's own shapes
(``m = b·s/C`` tokens; widths split by the tensor degree):

* GEMMs: every linear of a layer, as the model calls it (a Llama layer: q, k, v, o,
  gate, up, down), ``F = 2·m·n·k`` FLOPs per call at ``gemm.at(F)`` of the peak; the
  backward runs two GEMMs of the same FLOPs per forward one (input and weight
  gradients). Routed experts: ``E/e`` local experts, each over its share of the routed
  rows (balanced); the vocabulary projection on the last stage.
* attention: the core a fused kernel runs, causal: ``2·b·(s/C)·s·(H/t)·Q`` forward
  FLOPs (half the ``4·b·s²·H·Q`` of full attention), forward + backward = 3.5 x forward
  as FlashAttention counts, at ``attention.at(block)`` (block: s/C under ring, s
  under Ulysses).
* elementwise: the layer's non-GEMM bytes per token (norms, rotary, activations,
  residuals, casts; :class:`~paraxis.planner.efficiency.Elementwise`) at
  ``memory_efficiency`` of the HBM bandwidth, plus ``op_s`` per operation; the head's
  loss reads and writes about 28 bytes per logit (fp32 log-softmax, its gradient, casts).
* launch: the host's ``launch_s`` per operation, exposed only where it exceeds the
  device time it launches (eager PyTorch queues kernels ahead of the device).
* recompute: ``selective`` replays the attention block's forward (q, k, v, o GEMMs, the
  core, its elementwise share), ``full`` the whole layer's forward (a third of its
  GEMMs and elementwise bytes, the attention forward).

Per step, :func:`optimizer_seconds`: the optimizer's pass over the parameters this rank
steps (memory-bound: 2K + 16 bytes per parameter, K the optimizer state) and, with m
microbatches, m - 1 accumulations of each local gradient (the table's ``accumulate``
bytes per parameter).
"""

from __future__ import annotations

from dataclasses import dataclass

from paraxis.config.parallel import ParallelConfig
from paraxis.planner.efficiency import Efficiency
from paraxis.planner.inputs import Workload
from paraxis.planner.memory import BYTES_PER_PARAM, held_params, rank_layers
from paraxis.planner.model import LayerCount, ModelCounts
from paraxis.planner.schedule import holds_ends

__all__ = ["Compute", "optimizer_seconds", "rank_compute"]

ATTENTION_FWD_BWD = 3.5  # FlashAttention's convention: backward 2.5 x forward
LOSS_BYTES_PER_LOGIT = 28.0


@dataclass(frozen=True)
class Compute:
    """Device seconds of one microbatch on one rank, by kind (``expert``: the part of
    ``gemm`` in routed experts; ``tensor_linear``: the part in tensor-split linears)."""

    gemm: float = 0.0
    attention: float = 0.0
    elementwise: float = 0.0
    launch: float = 0.0
    recompute: float = 0.0
    expert: float = 0.0
    tensor_linear: float = 0.0

    @property
    def total(self) -> float:
        return self.gemm + self.attention + self.elementwise + self.launch + self.recompute

    @property
    def backward(self) -> float:
        """The backward's share (two of three GEMM passes, 2.5 of 3.5 attention ones,
        two thirds of the rest): what gradient reductions can hide under."""
        return (2 * (self.gemm + self.elementwise) / 3 + self.attention * 2.5 / 3.5
                + self.recompute)

    def __add__(self, other: Compute) -> Compute:
        return Compute(*(a + b for a, b in zip(self._values(), other._values(), strict=True)))

    def _values(self) -> tuple[float, ...]:
        return (self.gemm, self.attention, self.elementwise, self.launch, self.recompute,
                self.expert, self.tensor_linear)


class _Timer:
    """The rank's shapes and the table's rates."""

    def __init__(self, counts: ModelCounts, layout: ParallelConfig, work: Workload,
                 eff: Efficiency, peak: float):
        par = layout.parallelism
        self.counts, self.eff, self.peak, self.work = counts, eff, peak, work
        self.t, self.e, self.c, self.etp = par.tensor, par.expert, par.context, par.expert_tensor
        self.sp, self.ulysses = par.sequence_parallel, par.context_mode == "ulysses"
        self.m = work.micro_batch * work.seq / self.c  # tokens per microbatch on the rank
        self.recompute = layout.schedule.activation_checkpointing
        self.ew = eff.elementwise_for(work.precision)
        self.q = counts.num_heads * counts.head_dim
        self.kv = counts.kv_heads * counts.head_dim

    def gemm(self, flops: float, calls: float = 1.0) -> float:
        """Forward seconds of ``calls`` GEMMs of ``flops`` each."""
        if flops <= 0 or calls <= 0:
            return 0.0
        return calls * flops / (self.eff.compute_share(self.eff.gemm, flops) * self.peak)

    def memory(self, nbytes: float, ops: float) -> float:
        bw = self.eff.device.memory_bw * self.eff.memory_efficiency
        return nbytes / bw + ops * self.eff.op_s

    def attention(self) -> tuple[float, float]:
        """(forward + backward, forward) seconds of one layer's attention core."""
        c, w = self.counts, self.work
        heads = c.num_heads / self.t / (self.c if self.ulysses else 1)
        queries = w.seq if self.ulysses else w.seq / self.c
        fwd = 2.0 * w.micro_batch * queries * w.seq * heads * c.head_dim  # causal half
        block = w.seq if self.ulysses else w.seq / self.c
        total = ATTENTION_FWD_BWD * fwd / (self.eff.compute_share(self.eff.attention, block)
                                           * self.peak)
        return total, total / ATTENTION_FWD_BWD

    def layer(self, layer: LayerCount) -> Compute:
        c, t, m, h = self.counts, self.t, self.m, self.counts.hidden_size
        attn_fwd = (self.gemm(2 * m * h * self.q / t) + 2 * self.gemm(2 * m * h * self.kv / t)
                    + self.gemm(2 * m * self.q * h / t))
        mlp_fwd = self._dense_mlp(layer)
        expert_fwd, expert_bytes = self._experts(layer)
        core, core_fwd = self.attention()
        ew = self.ew
        shard = t if self.sp else 1
        intermediate = (c.intermediate_size or 4 * h) if mlp_fwd else 0
        attn_bytes = m * (ew.hidden * h / 2 / shard + (ew.query * self.q + ew.kv * self.kv) / t)
        nbytes = attn_bytes + m * (ew.hidden * h / 2 / shard + ew.intermediate * intermediate / t) \
            + expert_bytes + ew.per_weight * (layer.matrices / t + layer.experts / (
                self.e * self.etp))
        elementwise = self.memory(nbytes, ew.ops)
        gemm = 3 * (attn_fwd + mlp_fwd + expert_fwd)
        extra = {"none": 0.0,
                 "selective": attn_fwd + core_fwd + self.memory(attn_bytes / 3, ew.ops / 6),
                 "full": gemm / 3 + core_fwd + elementwise / 3}[self.recompute]
        device = gemm + core + elementwise + extra
        launch = max(0.0, ew.ops * (1 + (extra > 0) / 3) * self.eff.launch_s - device)
        return Compute(gemm, core, elementwise, launch, extra, 3 * expert_fwd,
                       3 * (attn_fwd + mlp_fwd))

    def _dense_mlp(self, layer: LayerCount) -> float:
        """Forward seconds of the layer's dense (or shared-expert) MLP: its matrices
        beyond attention's and the router's, as 3 GEMMs when gated, else 2."""
        c, h = self.counts, self.counts.hidden_size
        rest = layer.matrices - h * (2 * self.q + 2 * self.kv) - h * c.num_experts
        if rest <= 0:
            return 0.0
        i = c.intermediate_size or 4 * h
        calls = 3 if abs(rest - 3 * h * i) < abs(rest - 2 * h * i) else 2
        return self.gemm(2 * self.m * rest / calls / self.t, calls)

    def _experts(self, layer: LayerCount) -> tuple[float, float]:
        """(forward GEMM seconds, elementwise bytes) of the routed experts: the rank's
        tokens (its 1/t under sequence parallelism: the block is outside the tensor
        plan), k rows each, over E/e local experts (gathered over t with expert_tensor)."""
        c = self.counts
        if not layer.experts or not c.num_experts:
            return 0.0, 0.0
        tokens = self.m / (self.t if self.sp else 1)
        rows = tokens * c.top_k * (self.etp if self.sp and self.etp > 1 else 1)
        local = c.num_experts / self.e
        per_expert = layer.experts / c.num_experts / self.etp
        router = self.gemm(2 * tokens * c.hidden_size * c.num_experts)
        width = c.expert_intermediate or c.intermediate_size or 4 * c.hidden_size
        nbytes = rows * (self.ew.intermediate * width / self.etp + 8 * c.hidden_size)
        return router + self.gemm(2 * rows / local * per_expert / 3, 3 * local), nbytes

    def head(self) -> Compute:
        c, m = self.counts, self.m
        gemm = 3 * self.gemm(2 * m * c.hidden_size * c.vocab_size / self.t)
        loss = self.memory(m * LOSS_BYTES_PER_LOGIT * c.vocab_size / self.t, 12)
        return Compute(gemm=gemm, elementwise=loss, tensor_linear=gemm)


def rank_compute(counts: ModelCounts, layout: ParallelConfig, work: Workload,
                 eff: Efficiency, peak: float, rank: int = 0) -> Compute:
    """Device seconds of one microbatch on pipeline rank ``rank``."""
    timer = _Timer(counts, layout, work, eff, peak)
    total = Compute()
    for layer in rank_layers(counts, layout, rank):
        total = total + timer.layer(layer)
    if holds_ends(layout.schedule.pipeline_schedule, layout.parallelism.pipeline, rank)[1]:
        total = total + timer.head()
    return total


def optimizer_seconds(counts: ModelCounts, layout: ParallelConfig, work: Workload,
                      eff: Efficiency, rank: int = 0) -> float:
    """The optimizer step and gradient accumulation of pipeline rank ``rank``, per step."""
    par, p = layout.parallelism, layout.parallelism.pipeline
    first, last = holds_ends(layout.schedule.pipeline_schedule, p, rank)
    dense, expert = held_params(counts, rank_layers(counts, layout, rank), first, last,
                                par.tensor, par.expert, p, par.expert_tensor)
    n_dense, n_expert = layout.token_replicas, max(1, layout.token_replicas // par.expert)
    stepped = dense / n_dense + expert / n_expert if par.zero else dense + expert
    k = work.optimizer_bytes if work.optimizer_bytes is not None \
        else BYTES_PER_PARAM[work.precision][2]
    accumulate = eff.elementwise_for(work.precision).accumulate * (dense + expert) \
        * (layout.schedule.microbatches - 1)
    return ((2 * k + 16) * stepped + accumulate) / (eff.device.memory_bw * eff.memory_efficiency)
