"""Expert parallel experts: the model's own experts module, holding only this rank's
experts, reached by all-to-all.

The seam is the experts module of transformers 5.x (``@use_experts_implementation``):
``experts(hidden_states, top_k_index, top_k_weights)`` with fused tensors whose dim 0
is the expert (``gate_up_proj``, ``down_proj``, and biases where the family has them).
The block, its router and anything around them (shared experts, scaling factors) stay
the model's code, so the gating semantics stay the model's own.

:func:`shard_experts` slices dim 0 of every fused tensor to this rank's ``E / ep``
experts, updating their placement records in the same step, and swaps the module's
class for a subclass whose forward dispatches (the class swap is how FSDP2's
``fully_shard`` turns a module into an ``FSDPModule``: parameter names, the state dict
and the model's own methods are unchanged). The local experts then run through the
class's own forward on local expert ids with unit weights, the routing weights being
applied on the sender after the combine (as Megatron-Core's dispatcher and transformers'
``AllToAllEP``): the family's activation, ``_apply_gate``, biases, transposed layout and
post-expert norm are the model's code, and ``config._experts_implementation`` picks how
(``grouped_mm``, transformers' default: one ``torch._grouped_mm`` per projection over
the local expert set, which torch 2.13 runs on CPU for fp32/bf16 with 16-byte aligned
rows; ``eager``: a loop over the local experts hit, never over tokens); see
:mod:`paraxis_moe.grouped` for where that is replaced. ``moe.dispatch_chunks`` > 1
overlaps the exchanges of chunks of tokens with the compute (:mod:`paraxis_moe.overlap`).
Compute and exchange seconds are spans of the layer's clock (:mod:`paraxis_moe.stats`:
on CUDA without ``parallelism.stream_timing``, launch times).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from paraxis.config.parallel import AXES
from paraxis.parallel.placement import Placement, has_placement, placement_of, set_placement
from paraxis.runtime.clock import Span
from paraxis.runtime.grid import AxisGroup
from paraxis_moe.capacity import grouped_keep_mask
from paraxis_moe.config import MoEConfig
from paraxis_moe.dispatcher import AllToAllDispatcher, Dispatched
from paraxis_moe.expert_tensor import ExpertTensor, shard_expert_ffn
from paraxis_moe.grouped import local_kernel, padded_bmm_forward
from paraxis_moe.overlap import chunked_exchange, chunked_wanted, counted, merged
from paraxis_moe.stats import BackwardTimer, LayerStats, probe

__all__ = ["ExpertParallelExperts", "UnsupportedMoELayout", "check_experts", "shard_experts"]


class UnsupportedMoELayout(ValueError):
    """A mixture-of-experts module whose layout paraxis does not know how to shard."""


def check_experts(experts: Any, name: str) -> None:
    """Refuse, naming the module, anything but fused per-expert tensors behind the
    ``experts(hidden_states, top_k_index, top_k_weights)`` interface."""
    cls = type(experts).__name__
    if not isinstance(experts, nn.Module):
        raise UnsupportedMoELayout(f"{name}: expected an experts module, found {cls}")
    if not hasattr(experts, "has_gate") or not isinstance(getattr(experts, "num_experts", None),
                                                          int):
        raise UnsupportedMoELayout(
            f"{name} ({cls}) is not a transformers 5.x `@use_experts_implementation` experts "
            "module with fused (num_experts, ...) tensors; paraxis cannot shard it over the "
            "expert axis. Use a transformers version whose model has one, or set expert: 1")
    nested = [n for n, _ in experts.named_parameters() if "." in n]
    wrong = [n for n, p in experts.named_parameters(recurse=False)
             if p.dim() == 0 or p.shape[0] != experts.num_experts]
    if nested or wrong:
        raise UnsupportedMoELayout(
            f"{name} ({cls}): parameters {nested + wrong} are not stacked per expert along "
            f"dim 0 (num_experts={experts.num_experts}); paraxis cannot shard them")


class ExpertParallelExperts(nn.Module):
    """Mixin put in front of the model's experts class by :func:`shard_experts`."""

    dispatcher: AllToAllDispatcher
    moe: MoEConfig
    stats: LayerStats | None
    # False while activation checkpointing recomputes: the exchanges still run (and
    # their bytes count) but the routing counts are not added twice.
    recording: bool
    # Capacity applies per group of T / capacity_groups consecutive tokens: 1 on every
    # rank (its own tokens); n lets one process drop what n ranks would.
    capacity_groups: int = 1
    # Set when each expert's FFN is split over the tensor group (expert_tensor > 1).
    expert_tensor: ExpertTensor | None = None
    # moe.dispatch_chunks resolved once per run (paraxis_moe.overlap.chunked_wanted).
    chunked: bool = False

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        keep = None
        if self.moe.capacity_factor is not None:
            keep = grouped_keep_mask(top_k_index, top_k_weights, self.dispatcher.num_experts,
                                     self.moe, self.capacity_groups)
        timer, moved = None, {}
        counting = self.stats is not None and torch.is_grad_enabled()  # not in evaluation
        if self.chunked:
            return self._chunked(hidden_states, top_k_index, top_k_weights, keep, counting)
        clock = self.dispatcher.clock
        if counting and hidden_states.requires_grad:
            timer = BackwardTimer(lambda label, s: self._backward_segment(label, s, moved),
                                  clock)
        if keep is None and self.dispatcher.group.size == 1:
            return self._alone(hidden_states, top_k_index, top_k_weights, timer, moved)
        d = self.dispatcher.dispatch(hidden_states, top_k_index, keep, timer)
        moved.update(total=d.bytes_out, per_expert=d.bytes_per_expert(),
                     share=self._share(d.recv_counts.sum(0)))
        start = clock.mark()
        out = self._local_experts(d)
        compute = clock.since(start)
        y, combine = self.dispatcher.combine(out, d, top_k_weights, keep, timer)
        if counting:
            exchanges = [s for s in (d.exchange, combine) if s is not None]
            self._record(d, top_k_index, [compute], exchanges, moved)
            for span in exchanges:  # blocking: all exposed
                self.stats.add_time("a2a_span_s", span)
        return y.to(hidden_states.dtype)

    def _chunked(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor, keep: torch.Tensor | None,
                 counting: bool) -> torch.Tensor:
        """Dispatch, compute and combine in ``moe.dispatch_chunks`` overlapped chunks
        (:mod:`paraxis_moe.overlap`); backward compute is not timed (chunks interleave)."""
        stats, spans, clock = self.stats if counting else None, [], self.dispatcher.clock

        def compute(d: Dispatched) -> torch.Tensor:
            start = clock.mark()
            out = self._local_experts(d)
            spans.append(clock.since(start))
            return out

        y, records, count = chunked_exchange(
            self.dispatcher, hidden_states, top_k_index, top_k_weights, keep,
            self.moe.dispatch_chunks, compute, counted(stats))
        if stats is None:
            return y.to(hidden_states.dtype)
        d = merged(records)
        moved = {"total": d.bytes_out, "per_expert": d.bytes_per_expert(),
                 "share": self._share(d.recv_counts.sum(0))}
        self._record(d, top_k_index, spans, [count], moved)
        stats.add_time("a2a_span_s", count)
        if y.requires_grad:  # backward moves the forward's bytes again
            y = probe(y, lambda: self._backward_segment("bytes", None, moved))
        return y.to(hidden_states.dtype)

    def _alone(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
               top_k_weights: torch.Tensor, timer: BackwardTimer | None,
               moved: dict[str, Any]) -> torch.Tensor:
        """A group of one rank, dropless (``expert: 1``): nothing to exchange, so the
        model's own forward runs as it is, routing weights and all; only counted."""
        counts = torch.bincount(top_k_index.reshape(-1), minlength=self.dispatcher.num_experts)
        moved["share"] = self._share(counts)
        x = timer.point(hidden_states, "compute") if timer is not None else hidden_states
        clock = self.dispatcher.clock
        start = clock.mark()
        if self.expert_tensor is not None:
            y = self.expert_tensor.whole(x, top_k_index, top_k_weights, self._compute)
        else:
            y = self._compute(x, top_k_index, top_k_weights)
        compute = clock.since(start)
        if timer is not None:
            y = timer.point(y, None)
        stats = self.stats
        if stats is not None and torch.is_grad_enabled():
            stats.add_time("expert_compute_s", compute)
            stats.add_time("compute_s_per_expert", compute, moved["share"])
            if self.recording:
                for name in ("assigned", "accepted", "processed"):
                    stats.add(name, counts)
                stats.add("forwards", 1)
        return y

    def _local_experts(self, d: Dispatched) -> torch.Tensor:
        """The model's own experts forward on this rank's rows (local ids, unit weights);
        with a split FFN, on the rows of the whole tensor group (:mod:`.expert_tensor`)."""
        if self.expert_tensor is not None:
            return self.expert_tensor.dispatched(d.tokens, d.recv_counts, d.local_ids,
                                                 self._rows)
        return self._rows(d.tokens, d.local_ids)

    def _rows(self, tokens: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        ids = local_ids.unsqueeze(-1)
        out = self._compute(tokens, ids, torch.ones(ids.shape, dtype=tokens.dtype,
                                                    device=tokens.device))
        if tokens.shape[0] == 0 and tokens.requires_grad:
            # Keep empty rows on the graph: backward's mirrored exchanges are collective,
            # so every rank must reach them, and the experts get zero (not no) gradients.
            params = sum(p.sum() for p in self.parameters(recurse=False))
            out = tokens * 0.0 + params * 0.0
        return out

    def _compute(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor) -> torch.Tensor:
        """The local experts' function, as :func:`paraxis_moe.grouped.local_kernel`
        picks it: the model's own implementation, the grouped form where torch's kernel
        is missing, or the model's own loop where the grouped form was not faster."""
        kernel = local_kernel(self)
        if kernel == "padded_bmm":
            return padded_bmm_forward(self, hidden_states, top_k_index, top_k_weights)
        forward = super().forward
        if kernel == "eager":  # the class's own loop, under the dispatching wrapper
            forward = getattr(forward, "__wrapped__", forward).__get__(self)
        return forward(hidden_states, top_k_index, top_k_weights)

    def _share(self, local_rows: torch.Tensor) -> torch.Tensor:
        """(E,) fraction of this rank's expert rows computed by each expert (zero for
        remote experts), from the rows of each local expert: how a grouped GEMM's
        seconds are apportioned to experts."""
        first, last = self.dispatcher.local_range()
        rows = local_rows.detach().to("cpu", torch.float64)
        share = torch.zeros(self.dispatcher.num_experts, dtype=torch.float64)
        share[first:last] = rows / max(float(rows.sum()), 1.0)
        return share

    def _record(self, d: Dispatched, top_k_index: torch.Tensor, compute: Sequence[Span],
                exchanges: Sequence[Span], moved: dict[str, Any]) -> None:
        stats = self.stats
        assert stats is not None
        stats.add("dispatch_bytes", d.bytes_out)
        stats.add("bytes_per_expert", moved["per_expert"])
        for span in exchanges:
            stats.add_time("dispatch_s", span)
        for span in compute:
            stats.add_time("expert_compute_s", span)
            stats.add_time("compute_s_per_expert", span, moved["share"])
        if not self.recording:
            return
        assigned = torch.bincount(top_k_index.reshape(-1), minlength=self.dispatcher.num_experts)
        first, last = self.dispatcher.local_range()
        processed = torch.zeros_like(assigned)
        processed[first:last] = d.recv_counts.sum(0)
        stats.add("assigned", assigned)
        stats.add("accepted", d.sent_per_expert)
        stats.add("dropped", assigned - d.sent_per_expert)
        stats.add("processed", processed)
        stats.add("forwards", 1)

    def _backward_segment(self, label: str, span: Span | None, moved: dict[str, Any]) -> None:
        """A backward segment's span (None: bytes only, the chunked path's)."""
        stats = self.stats
        if stats is None:
            return
        if label == "compute":
            assert span is not None
            stats.add_time("expert_compute_s", span)
            stats.add_time("compute_s_per_expert", span, moved["share"])
            return
        if span is not None:
            stats.add_time("dispatch_s", span)
            stats.add_time("a2a_span_s", span)
        if label in ("combine", "bytes"):
            # Backward's two mirrored exchanges move the forward's bytes again; the
            # combine's runs first, so both are counted there.
            stats.add("dispatch_bytes", moved["total"])
            stats.add("bytes_per_expert", moved["per_expert"])

    def extra_repr(self) -> str:
        first, last = self.dispatcher.local_range()
        split = self.expert_tensor
        ffn = f", FFN split over {split.group.size} tensor ranks" if split is not None else ""
        return (f"experts [{first}, {last}) of {self.dispatcher.num_experts} on expert rank "
                f"{self.dispatcher.group.rank}/{self.dispatcher.group.size}, "
                f"capacity_factor={self.moe.capacity_factor}{ffn}")


_CLASSES: dict[type, type] = {}


def _expert_parallel_class(cls: type) -> type:
    if issubclass(cls, ExpertParallelExperts):
        return cls
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"ExpertParallel{cls.__name__}", (ExpertParallelExperts, cls), {})
    return _CLASSES[cls]


def shard_experts(experts: nn.Module, group: AxisGroup, *, moe: MoEConfig | None = None,
                  stats: LayerStats | None = None, name: str = "experts",
                  expert_tensor: ExpertTensor | None = None,
                  chunked: bool | None = None) -> ExpertParallelExperts:
    """Keep this rank's ``E / ep`` experts of ``experts`` and dispatch to the others;
    with ``expert_tensor``, also split each expert's FFN over its group.

    ``name`` is the module's qualified name, for errors and for placement records of
    parameters that have none yet. ``chunked`` is ``moe.dispatch_chunks`` resolved by
    a caller sharding many blocks (None: resolved here). Seconds are timed on
    ``stats``' clock. Every rank of ``group`` must call it.
    """
    check_experts(experts, name)
    if isinstance(experts, ExpertParallelExperts):
        raise UnsupportedMoELayout(f"{name} is already expert parallel")
    moe = moe or MoEConfig()
    if chunked is None:
        chunked = chunked_wanted(moe.dispatch_chunks, group)
    dispatcher = AllToAllDispatcher(group, experts.num_experts,
                                    clock=stats.clock if stats is not None else None)
    first, last = dispatcher.local_range()
    for pname, param in list(experts.named_parameters(recurse=False)):
        record = placement_of(param) if has_placement(param) else Placement(
            f"{name}.{pname}", tuple(param.shape), param.dtype,
            replicated=tuple(a for a in AXES if a != "pipeline"))
        local = nn.Parameter(param.detach()[first:last].clone(),
                             requires_grad=param.requires_grad)
        set_placement(local, record.sharded(dim=0, axis="expert", offset=first,
                                            length=last - first))
        setattr(experts, pname, local)
    if expert_tensor is not None:
        shard_expert_ffn(experts, expert_tensor.group)
    experts.__class__ = _expert_parallel_class(type(experts))
    experts.expert_tensor = expert_tensor
    experts.num_global_experts = experts.num_experts
    experts.num_experts = last - first  # what the model's own forward loops / bins over
    experts.dispatcher = dispatcher
    experts.moe = moe
    experts.chunked = chunked
    experts.stats = stats
    experts.recording = True
    return experts  # type: ignore[return-value]
