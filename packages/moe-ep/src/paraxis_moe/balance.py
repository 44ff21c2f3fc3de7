"""DeepSeek-V3's load balancing (arXiv:2412.19437, section 2.1.2), around the model's
own router.

Routers of this kind (DeepSeek-V3, GLM-4.5 MoE, dots.llm1, Kimi-Linear...) score experts
with a sigmoid and pick the top-k of ``scores + e_score_correction_bias``, group-limited;
the bias steers selection only, never the gating weights. paraxis keeps that forward as
the model wrote it and adds the two pieces training needs:

* the *auxiliary-loss-free* bias update (eq. 16's rule): after each optimizer step, each
  layer's bias moves by ``rate * sign(mean_load - load_i)``, where ``load_i`` is the
  (token, expert) pairs routed to expert ``i`` during the step by *every* rank holding
  distinct tokens (data x expert x context). It is the ``assigned`` count the statistics
  already reduce (:class:`paraxis_moe.stats.MoEStats`), so the update costs no extra
  collective and every replica applies the same step: a rank's local counts would
  update replicas differently and drift from one process. Under a pipeline each stage
  updates its own layers (the gathered counts hold every layer);
* the *sequence-wise* balance loss (eq. 17-20) in place of Switch's: per sequence,
  ``f_i = E / (k T) * #tokens choosing i`` and ``P_i`` = the mean over its ``T`` tokens of
  the normalized sigmoid scores ``s_i / sum_j s_j``, loss ``coef * sum_i f_i P_i``,
  averaged over sequences and layers. ``f`` is the model's own selection (the top-k
  indices its router returns). A sequence lies on one rank, so only the number of
  (layer, sequence) rows is reduced: the carry holds it and the row count of the z-loss.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from paraxis.parallel.metric_names import moe_block, moe_total
from paraxis.runtime.collectives import all_reduce_
from paraxis_moe.experts import UnsupportedMoELayout
from paraxis_moe.router import AUX_LOSS, Z_LOSS, RouterLosses

__all__ = ["BIAS_NAME", "BiasBalancer", "SequenceLosses", "correction_bias", "sigmoid_scored"]

BIAS_NAME = "e_score_correction_bias"


def correction_bias(module: nn.Module) -> torch.Tensor | None:
    """The block's ``e_score_correction_bias`` (a buffer, or Ernie's frozen parameter;
    on the router or on the block itself), or None."""
    for name, tensor in [*module.named_buffers(), *module.named_parameters()]:
        if name.rsplit(".", 1)[-1] == BIAS_NAME:
            return tensor
    return None


def sigmoid_scored(router: nn.Module) -> bool:
    """Whether the router's own forward scores experts with a sigmoid (DeepSeek-V3's
    ``router_logits.sigmoid()``), read from its source as transformers itself reads a
    class's source to tell which kernels it can dispatch; Ernie 4.5 and MiniMax-M2 keep
    a correction bias over softmax scores, for which Switch's loss stays the right one."""
    try:
        source = inspect.getsource(type(router).forward)
    except (OSError, TypeError):
        return False
    return "sigmoid" in source


class SequenceLosses(RouterLosses):
    """DeepSeek-V3's sequence-wise balance loss and the z-loss, split over ranks as
    :class:`RouterLosses` splits Switch's (same interface, a carry of 2 numbers).

    Where each sequence is split over ranks (``sequence_groups``: the context group, and
    the tensor group under sequence parallelism), each rank holds a piece of every
    sequence: the per-sequence expert counts (no gradient) are summed over those groups
    before they weigh this rank's probability sums, divided by the whole sequence's
    length, so the ranks' parts add up to the loss of the whole sequences; each rank
    counts its sequences as a share of them."""

    # transformers' own loss for these routers, where a model defines one (Laguna,
    # MiniMax-M2), is Switch's over the softmax of the logits.
    unlike_model = ("DeepSeek-V3's sequence-wise balance loss (arXiv:2412.19437) for a "
                    "sigmoid router with a correction bias")

    @property
    def carry_size(self) -> int:
        """Numbers each forward carries: (layer, sequence) rows and token rows."""
        return 2

    def __init__(self, num_experts: int, top_k: int, *,
                 sequence_groups: tuple[Any, ...] = (), **kwargs: Any):
        super().__init__(num_experts, top_k, **kwargs)
        self.sequence_groups = tuple(g for g in sequence_groups if g.size > 1)
        self.split = math.prod(g.size for g in self.sequence_groups)
        self._rows: list[tuple[torch.Tensor, torch.Tensor, int]] = []
        self._seq_len: int | None = None

    def note_block_input(self, module: nn.Module, args: Any) -> None:
        """Forward pre-hook on an MoE block: its ``(batch, sequence, hidden)`` input
        says where sequences end, for a router that is handed the tokens flattened
        (MiniMax-M2's)."""
        x = args[0] if args and torch.is_tensor(args[0]) else None
        if x is not None and x.dim() == 3:
            self._seq_len = int(x.shape[-2])

    def record(self, logits: torch.Tensor, *, chosen: torch.Tensor | None = None,
               seq_len: int | None = None) -> None:
        if not (self.aux_coef or self.z_coef):
            return
        if logits.shape[-1] != self.num_experts:
            super().record(logits)  # refused there, naming the extra classes
        seq_len = seq_len or self._seq_len
        if chosen is None or not seq_len:
            raise UnsupportedMoELayout(
                "a sigmoid router with e_score_correction_bias gave no top-k indices or "
                "sequence length for DeepSeek-V3's sequence-wise loss; set "
                "moe.aux_loss_coef: 0 and moe.z_loss_coef: 0")
        logits = logits.reshape(-1, self.num_experts)
        self._rows.append((logits, chosen.reshape(-1, self.top_k), int(seq_len)))

    def clear(self) -> None:
        self._rows = []

    def local(self) -> tuple[torch.Tensor, Any] | None:
        rows, self._rows = self._rows, []
        if not rows:
            return None
        e, k = self.num_experts, self.top_k
        device = rows[0][0].device
        counts = torch.zeros(2, dtype=torch.float64, device=device)  # sequences, tokens
        balance = torch.zeros((), dtype=torch.float32, device=device)
        lse_sq = torch.zeros((), dtype=torch.float32, device=device)
        for logits, chosen, seq_len in rows:
            seqs = logits.shape[0] // seq_len
            whole = seq_len * self.split  # the length of the sequences this piece is of
            scores = torch.sigmoid(logits.float())
            p = (scores / scores.sum(-1, keepdim=True)).view(seqs, seq_len, e).sum(1) / whole
            picks = torch.zeros(seqs, e, dtype=torch.float32, device=device)
            picks.scatter_add_(1, chosen.view(seqs, seq_len * k),
                               torch.ones(seqs, seq_len * k, device=device))
            for group in self.sequence_groups:  # the whole sequences' counts
                all_reduce_(picks, group)
            balance = balance + (picks * (e / (k * whole)) * p).sum()
            counts += torch.tensor([seqs / self.split, logits.shape[0]], dtype=torch.float64,
                                   device=device)
            if self.z_coef:
                lse_sq = lse_sq + torch.logsumexp(logits.float(), -1).square().sum()

        def resolve(final: torch.Tensor) -> dict[str, torch.Tensor]:
            seqs_all, tokens_all = final[0].item(), final[1].item()
            return {AUX_LOSS: self.aux_coef * balance / seqs_all,
                    Z_LOSS: self.z_coef * lse_sq / tokens_all}

        return counts, resolve


class BiasBalancer:
    """The post-step bias update of every block of this rank holding a correction bias.

    ``rate`` is ``moe.bias_update_rate``; ``pipeline`` (None without one) is the group
    over which the stages' largest bias is agreed, so the metric is the same on every
    rank, as core's step hooks require."""

    def __init__(self, biases: dict[str, torch.Tensor], rate: float, *,
                 pipeline: Any = None):
        self.biases, self.rate, self.pipeline = biases, rate, pipeline

    @torch.no_grad()
    def update(self, last: dict[str, dict[str, torch.Tensor]]) -> dict[str, float]:
        """Apply one step from ``last`` (the step's reduced per-layer counts, every layer
        of the model) and return ``moe/<block>/correction_bias_max`` (largest absolute
        bias of the block) and ``moe/correction_bias_max`` (of the model)."""
        out: dict[str, float] = {}
        for name, bias in self.biases.items():
            load = last[name]["assigned"]
            if float(load.sum()) > 0:
                step = self.rate * torch.sign(load.mean() - load)
                flat = bias.view(-1)
                flat.add_(step.to(device=flat.device, dtype=flat.dtype))
            out[moe_block(name, "correction_bias_max")] = float(bias.abs().max())
        if self.pipeline is not None and self.pipeline.size > 1:
            every: list[Any] = [None] * self.pipeline.size
            dist.all_gather_object(every, out, group=self.pipeline.pg)
            out = {k: v for stage in every for k, v in stage.items()}
        out[moe_total("correction_bias_max")] = max(out.values(), default=0.0)
        return out
