"""Per-layer, per-expert statistics of every step, logged rather than averaged away.

For each MoE block and expert: (token, expert) pairs assigned before capacity, accepted,
dropped, rows computed here, bytes moved for it, and compute seconds; for each block:
seconds blocked in the dispatch/combine all-to-alls and spent in the local experts
(forward and backward), and the router's probability distribution (mean probability per
expert, entropy, histogram). The local experts run as one grouped GEMM per projection,
so one expert's compute time is not observable alone: it is the block's local compute
time apportioned by the rows each local expert computed (a grouped GEMM's cost is linear
in its rows).

Bytes follow core's all-to-all convention (what this rank sends to *other* ranks; rows
it keeps never touch a link). Forward moves the dispatched rows out and the computed rows
back; backward moves the same number of rows again, mirrored, and is counted when it
runs. Backward seconds are taken between identity autograd nodes placed around each
segment (:func:`probe`); on one autograd thread the segment's own node runs between them.

Seconds are read from the run's :class:`~paraxis.runtime.clock.Stopwatch` (each
:class:`LayerStats` holds it). On CPU that is the host clock, and the seconds are those
spent. On CUDA, until ``parallelism.stream_timing`` is on (off under ``auto`` until a
GPU run validates it: :mod:`paraxis.runtime.cuda_paths`), it is the host clock too, and
kernels and NCCL all-to-alls return once queued, so ``dispatch_s``, ``a2a_span_s`` and
``expert_compute_s`` measure **launches** (plus any host synchronization, such as the
split sizes read back after the count exchange), not the work. With stream timing on they
are CUDA events on the compute stream, kept as pairs and read when the step's metrics
are reduced (:meth:`LayerStats.settle`), so no op is synchronized.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from paraxis.parallel.metric_names import moe_array, moe_block, moe_total, parse_moe_array
from paraxis.parallel.summary import RunReport
from paraxis.runtime.clock import Span, Stopwatch

__all__ = ["BackwardTimer", "LayerStats", "MoEStats", "expert_load_report", "probe"]

HIST_BINS = 10
# Reduced by sum over the ranks holding distinct tokens; the rest by max.
_SUMMED = ("assigned", "accepted", "dropped", "processed", "bytes_per_expert",
           "compute_s_per_expert", "prob_sum", "hist", "entropy_sum", "tokens", "forwards")
# The per-layer, per-expert arrays of a step (``MoEStats.last``, metrics
# ``moe/<block>/<kind>/<expert>``).
PER_EXPERT = ("assigned", "accepted", "dropped", "processed", "dispatch_bytes", "compute_s",
              "prob_mean")
# ``dispatch_s`` is the time blocked in the exchanges (exposed), ``a2a_span_s`` their
# lifetime from launch to the end of the wait: equal unless dispatch is chunked. On CUDA
# without stream timing, all three timers measure launches (module docstring).
_MAXED = ("dispatch_bytes", "dispatch_s", "a2a_span_s", "expert_compute_s")


class _Probe(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, callback: Callable[[], None]) -> torch.Tensor:
        ctx.callback = callback
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        ctx.callback()
        return grad, None


def probe(x: torch.Tensor, callback: Callable[[], None]) -> torch.Tensor:
    """Identity; ``callback()`` runs when the gradient reaches this point."""
    return _Probe.apply(x, callback) if x.requires_grad else x


class BackwardTimer:
    """Points placed in forward order; in backward, the span since the later point
    fired is credited to the earlier point's segment (``on_segment(label, span)``)."""

    def __init__(self, on_segment: Callable[[str, Span], None], clock: Stopwatch):
        self.on_segment, self.clock = on_segment, clock
        self._last: Any = None

    def point(self, x: torch.Tensor, label: str | None) -> torch.Tensor:
        def fired() -> None:
            now = self.clock.mark()
            if label is not None and self._last is not None:
                self.on_segment(label, Span(self._last, now))
            self._last = now
        return probe(x, fired)


@dataclass
class LayerStats:
    """One MoE block's numbers on this rank since the last reset (float64 vectors);
    ``clock`` times what is added with :meth:`add_time`."""

    num_experts: int
    values: dict[str, torch.Tensor] = field(default_factory=dict)
    clock: Stopwatch = field(default_factory=Stopwatch)
    # Spans on the CUDA stream not read yet: (name, span, scale).
    pending: list[tuple[str, Span, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        e = self.num_experts
        self.values = {
            **{k: torch.zeros(e, dtype=torch.float64)
               for k in ("assigned", "accepted", "dropped", "processed", "bytes_per_expert",
                         "compute_s_per_expert", "prob_sum")},
            "hist": torch.zeros(HIST_BINS, dtype=torch.float64),
            **{k: torch.zeros(1, dtype=torch.float64) for k in
               ("entropy_sum", "tokens", "forwards", *_MAXED)},
        }
        self.pending = []

    def add(self, name: str, value: Any) -> None:
        v = value.detach().to("cpu", torch.float64) if torch.is_tensor(value) else value
        self.values[name] += v

    def add_time(self, name: str, span: Span, scale: Any = 1.0) -> None:
        """``span``'s seconds (times ``scale``: an expert's share) into ``name``: now on
        the host clock; on the stream when the step is read (:meth:`settle`)."""
        if span.on_stream:
            self.pending.append((name, span, scale))
        else:
            self.add(name, scale * span.seconds())

    def settle(self) -> None:
        """Read the stream spans added so far (waits for their last events)."""
        pending, self.pending = self.pending, []
        for name, span, scale in pending:
            self.add(name, scale * span.seconds())

    def add_router(self, logits: torch.Tensor) -> None:
        """The router's distribution: softmax over its logits (the distribution the
        Switch loss uses), for every family. A router with extra classes (a skip or
        zero-compute expert) adds its entropy over all of them and the probabilities
        of the real experts (its first ``num_experts`` classes)."""
        with torch.no_grad():
            full = torch.softmax(logits.detach().reshape(-1, logits.shape[-1]).float(), -1)
            entropy = -(full * full.clamp_min(1e-30).log()).sum()
            probs = full[:, :self.num_experts]
            self.add("prob_sum", probs.sum(0))
            self.add("entropy_sum", entropy)
            self.add("tokens", probs.shape[0])
            self.add("hist", torch.histc(probs, bins=HIST_BINS, min=0.0, max=1.0))


class MoEStats:
    """Every block's :class:`LayerStats`, reduced into one step's metrics."""

    def __init__(self, num_experts: int, names: list[str], clock: Stopwatch | None = None):
        self.num_experts = num_experts
        self.clock = clock or Stopwatch()
        self.layers = {name: LayerStats(num_experts, clock=self.clock) for name in names}
        # The last step's reduced values, every layer of the model (all stages).
        self.last: dict[str, dict[str, torch.Tensor]] = {}

    def reset(self) -> None:
        for layer in self.layers.values():
            layer.reset()

    def reduce(self, group: Any = None) -> dict[str, dict[str, torch.Tensor]]:
        """Every layer's values, summed (counts) or maxed (bytes, seconds per rank)
        over ``group`` (an AxisGroup of the ranks holding distinct tokens; None: this
        rank only). Collective over the group."""
        for layer in self.layers.values():
            layer.settle()
        layouts = [[(n, k, self.layers[n].values[k].numel()) for n in sorted(self.layers)
                    for k in keys] for keys in (_SUMMED, _MAXED)]
        flats = [torch.cat([self.layers[n].values[k] for n, k, _ in layout])
                 if layout else torch.zeros(0, dtype=torch.float64) for layout in layouts]
        if group is not None and group.size > 1:
            # One all-gather, then sum and max here: one collective per step, not two.
            mine = torch.cat(flats)
            every = [torch.empty_like(mine) for _ in range(group.size)]
            dist.all_gather(every, mine, group=group.pg)
            stacked, n = torch.stack(every), flats[0].numel()
            flats = [stacked[:, :n].sum(0), stacked[:, n:].amax(0)]
        out: dict[str, dict[str, torch.Tensor]] = {n: {} for n in self.layers}
        for layout, flat in zip(layouts, flats, strict=True):
            for (n, k, _), part in zip(layout, flat.split([size for *_, size in layout]),
                                       strict=True):
                out[n][k] = part
        return out

    def metrics(self, group: Any = None, pipeline: Any = None) -> dict[str, float]:
        """Step metrics (the same on every rank of ``group`` and ``pipeline``), then
        reset. Under a pipeline each stage reduces its own layers over ``group``, then
        the stages exchange them (one all-gather of objects over ``pipeline``)."""
        reduced = self.reduce(group)
        self.reset()
        if pipeline is not None and pipeline.size > 1:
            every: list[Any] = [None] * pipeline.size
            dist.all_gather_object(every, reduced, group=pipeline.pg)
            reduced = {n: v for stage in every for n, v in stage.items()}
        self.last = {n: reduced[n] for n in sorted(reduced, key=_layer_order)}
        return summarize(self.last)


def _layer_order(name: str) -> tuple[Any, ...]:
    """Numbers in a module name compared as numbers (layers.10 after layers.9)."""
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name))


def summarize(reduced: dict[str, dict[str, torch.Tensor]]) -> dict[str, float]:
    """Totals (``moe/...``) and the per-layer, per-expert detail (``moe/<block>/...``)."""
    out: dict[str, float] = {}
    totals = {k: 0.0 for k in ("assigned", "dropped", "entropy", "tokens", "bytes", "dispatch_s",
                               "a2a_span_s", "compute_s")}
    imbalance = 0.0
    for name, v in reduced.items():
        assigned = v["assigned"]
        mean = float(assigned.mean())
        layer_imbalance = float(assigned.max()) / mean if mean > 0 else 0.0
        imbalance = max(imbalance, layer_imbalance)
        tokens = float(v["tokens"])
        for e in range(assigned.numel()):
            for k in ("assigned", "accepted", "dropped", "processed"):
                out[moe_array(name, k, e)] = float(v[k][e])
            out[moe_array(name, "dispatch_bytes", e)] = float(v["bytes_per_expert"][e])
            out[moe_array(name, "compute_s", e)] = float(v["compute_s_per_expert"][e])
            out[moe_array(name, "prob_mean", e)] = (float(v["prob_sum"][e]) / tokens
                                                    if tokens else 0.0)
        for b in range(v["hist"].numel()):
            out[moe_array(name, "prob_hist", b)] = float(v["hist"][b])
        out[moe_block(name, "load_imbalance")] = layer_imbalance
        out[moe_block(name, "router_entropy")] = (float(v["entropy_sum"]) / tokens
                                                  if tokens else 0.0)
        for k in _MAXED:
            out[moe_block(name, k)] = float(v[k])
        totals["assigned"] += float(assigned.sum())
        totals["dropped"] += float(v["dropped"].sum())
        totals["entropy"] += float(v["entropy_sum"])
        totals["tokens"] += tokens
        totals["bytes"] += float(v["dispatch_bytes"])
        totals["dispatch_s"] += float(v["dispatch_s"])
        totals["a2a_span_s"] += float(v["a2a_span_s"])
        totals["compute_s"] += float(v["expert_compute_s"])
    assigned = totals["assigned"]
    out.update({
        moe_total("tokens_assigned"): assigned,
        moe_total("tokens_dropped"): totals["dropped"],
        moe_total("dropped_fraction"): totals["dropped"] / assigned if assigned else 0.0,
        moe_total("load_imbalance"): imbalance,
        moe_total("router_entropy"): (totals["entropy"] / totals["tokens"]
                                      if totals["tokens"] else 0.0),
        # Per rank, the busiest rank of each layer, summed over layers.
        moe_total("dispatch_bytes"): totals["bytes"],
        moe_total("dispatch_s"): totals["dispatch_s"],
        moe_total("a2a_span_s"): totals["a2a_span_s"],
        # The share of the all-to-alls' lifetime the rank sat blocked in them.
        moe_total("a2a_exposed_share"): (totals["dispatch_s"] / totals["a2a_span_s"]
                                         if totals["a2a_span_s"] else 0.0),
        moe_total("expert_compute_s"): totals["compute_s"],
    })
    return out


def expert_load_report(history: list[dict[str, float]]) -> RunReport | None:
    """The most and least loaded expert over a run, from the per-layer, per-expert
    ``moe/<block>/assigned/<expert>`` metrics: summary values (load over the mean load)
    and the table's rows naming them; None for a run without them."""
    totals: dict[tuple[str, int], float] = {}
    for m in history:
        for key, value in m.items():
            hit = parse_moe_array(key)
            if hit is not None and hit.kind == "assigned":
                where = (hit.block, hit.index)
                totals[where] = totals.get(where, 0.0) + value
    mean = sum(totals.values()) / len(totals) if totals else 0.0
    if not mean:
        return None
    report = RunReport()
    for label, pick in (("most", max), ("least", min)):
        (block, expert), n = pick(totals.items(), key=lambda kv: kv[1])
        report.values[moe_total(f"{label}_loaded_vs_mean")] = n / mean
        report.rows.append((f"{label} loaded expert",
                            f"{block} #{expert}: {n:,.0f} routed ({n / mean:.2f}x mean)"))
    return report
