"""The router side: the model's own router, watched; its losses, split over ranks.

paraxis never replaces a router. A forward hook on it reads ``output[0]``, the router
logits (where transformers' own ``OutputRecorder(<Router>, index=0)`` reads them for
``output_router_logits``), for statistics and for the two losses:

* the Switch load-balancing loss (Fedus et al., arXiv:2101.03961, eq. 4-6) exactly as
  transformers' ``load_balancing_loss_func`` computes it: the layers' logits are taken
  together, ``f_i`` = top-k assignments of ``softmax(logits)`` to expert ``i`` over all
  layers' rows, ``P_i`` = summed probability over the same rows, both divided by the
  row count (layers x tokens), and the loss is ``E * sum_i f_i * P_i``;
* the router z-loss (ST-MoE, arXiv:2202.08906, eq. 5): the mean over the same rows of
  ``logsumexp(logits)^2``.

Over ranks holding distinct tokens (data x expert x context) and over pipeline stages
(each holds some layers), the global loss needs global ``f`` (no gradient: counts) and
the global row count, while ``P`` is a sum of per-rank, per-stage parts. Each forward
hands core's auxiliary-loss channel a *carry* (:class:`paraxis.parallel.batch.AuxLosses`): its
``E`` assignment counts and row count (float64), summed along the pipeline and then
all-reduced over the ranks holding distinct tokens (:meth:`RouterLosses.finalize`), and
a resolver that turns those global numbers into this rank's part
``coef * E * sum_i f_i * P_i^local`` with ``P_i^local`` = this rank's probability sums /
the global row count. The parts sum to the global loss, and each part's gradient is
exactly this rank's share of the global loss's gradient (``f`` carries none). The
z-loss splits the same way. Sigmoid routers with DeepSeek-V3's correction bias get
DeepSeek-V3's sequence-wise loss instead (:class:`paraxis_moe.balance.SequenceLosses`,
with its bias update); other non-softmax routers get transformers' loss as it computes
it, from the softmax of the logits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from paraxis.parallel.metric_names import moe_total
from paraxis.runtime.collectives import all_reduce_
from paraxis_moe.experts import UnsupportedMoELayout
from paraxis_moe.stats import LayerStats

__all__ = ["AUX_LOSS", "Z_LOSS", "RouterLosses", "selected_experts", "watch_router"]

AUX_LOSS = moe_total("aux_loss")
Z_LOSS = moe_total("z_loss")

Resolver = Callable[[torch.Tensor], dict[str, torch.Tensor]]


class RouterLosses:
    """The router logits of one forward, turned into this rank's loss parts."""

    # Where the loss is another function than transformers' (``output_router_logits``):
    # the parity probe then leaves it out of its comparison with the model's own.
    unlike_model = ""

    def __init__(self, num_experts: int, top_k: int, *, aux_coef: float, z_coef: float = 0.0,
                 group: Any = None):
        self.num_experts, self.top_k = num_experts, top_k
        self.aux_coef, self.z_coef = aux_coef, z_coef
        self.group = group  # the ranks holding distinct tokens (None: this rank alone)
        self._logits: list[torch.Tensor] = []

    @property
    def names(self) -> list[str]:
        """Both are always reported (a loss whose coefficient is 0 reports 0)."""
        return [AUX_LOSS, Z_LOSS]

    @property
    def carry_size(self) -> int:
        """Numbers each forward carries: ``E`` assignment counts and the row count."""
        return self.num_experts + 1

    def record(self, logits: torch.Tensor, *, chosen: torch.Tensor | None = None,
               seq_len: int | None = None) -> None:
        """Keep one layer's logits. A router with more classes than experts (ZAYA's skip
        class, LongCat-Flash's zero-compute experts) has no Switch loss transformers
        defines: it is recorded only if both coefficients are 0 (then nothing is).
        ``chosen`` (the router's top-k) and ``seq_len`` serve losses that need them."""
        width = logits.shape[-1]
        if width != self.num_experts:
            if self.aux_coef or self.z_coef:
                raise UnsupportedMoELayout(
                    f"a router has {width} logits for {self.num_experts} experts (skip or "
                    "zero-compute classes); its load-balancing loss is not defined. Set "
                    "moe.aux_loss_coef: 0 and moe.z_loss_coef: 0")
            return
        self._logits.append(logits.reshape(-1, self.num_experts))

    def clear(self) -> None:
        self._logits = []

    def local(self) -> tuple[torch.Tensor, Resolver] | None:
        """This forward's carry contribution (``E`` top-k counts and the row count,
        float64) and the resolver of its parts, for the logits recorded since the last
        call, which it forgets; None if none were recorded. No communication."""
        logits, self._logits = self._logits, []
        if not logits:
            return None
        e = self.num_experts
        counts = torch.zeros(e + 1, dtype=torch.float64, device=logits[0].device)
        prob_sum: torch.Tensor = torch.zeros(e, dtype=torch.float32, device=logits[0].device)
        lse_sq: torch.Tensor = torch.zeros((), dtype=torch.float32, device=logits[0].device)
        for layer in logits:
            # As load_balancing_loss_func: softmax in the logits' dtype, top-k of it.
            probs = torch.softmax(layer, dim=-1)
            _, chosen = torch.topk(probs, self.top_k, dim=-1)
            counts[:e] += torch.bincount(chosen.reshape(-1), minlength=e).double()
            counts[e] += layer.shape[0]
            prob_sum = prob_sum + probs.float().sum(0)
            if self.z_coef:
                lse_sq = lse_sq + torch.logsumexp(layer.float(), -1).square().sum()

        def resolve(final: torch.Tensor) -> dict[str, torch.Tensor]:
            rows = final[e].item()
            f = (final[:e] / rows).to(prob_sum.dtype)
            return {AUX_LOSS: self.aux_coef * e * (f * prob_sum).sum() / rows,
                    Z_LOSS: self.z_coef * lse_sq / rows}

        return counts, resolve

    def finalize(self, total: torch.Tensor) -> torch.Tensor:
        """Counts summed over stages -> over every rank holding distinct tokens
        (collective over ``group``: one all-reduce of ``E + 1`` numbers)."""
        total = total.clone()
        if self.group is not None:
            all_reduce_(total, self.group)
        return total

    def parts(self) -> dict[str, torch.Tensor]:
        """This rank's parts for the logits recorded since the last call, without a
        pipeline (collective over ``group``); {} if nothing was recorded."""
        found = self.local()
        if found is None:
            return {}
        counts, resolve = found
        return resolve(self.finalize(counts))


def selected_experts(output: Any, top_k: int) -> torch.Tensor | None:
    """The router's own top-k indices: the integer tensor of its output tuple whose last
    dimension is ``top_k`` (DeepSeek-V3 returns ``(logits, weights, indices)``)."""
    items = output if isinstance(output, tuple) else (output,)
    return next((t for t in items if torch.is_tensor(t) and not t.is_floating_point()
                 and t.dim() >= 1 and t.shape[-1] == top_k), None)


def watch_router(router: torch.nn.Module, *, stats: LayerStats | None,
                 losses: RouterLosses | None, recording: Callable[[], bool],
                 recording_losses: Callable[[], bool] | None = None,
                 index: int = 0) -> Any:
    """Forward hook on the model's router: its logits (``output[index]`` of a tuple) go
    to ``stats`` while ``recording()`` (off during activation recomputation) and to
    ``losses`` while ``recording_losses()`` (default: ``recording``; also on in a
    gradient check's forward, where statistics are off). Returns the handle."""
    recording_losses = recording_losses or recording

    def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
        counting, losing = recording(), recording_losses()
        if not (counting or losing):
            return
        logits = output[index] if isinstance(output, tuple) else output
        if stats is not None and counting:
            stats.add_router(logits)
        if losses is not None and losing:
            # (batch, sequence, hidden) in: its sequences are known (a flattened input
            # leaves them to a loss that needs none).
            x = args[0] if args and torch.is_tensor(args[0]) else None
            losses.record(logits, chosen=selected_experts(output, losses.top_k),
                          seq_len=x.shape[-2] if x is not None and x.dim() == 3 else None)

    return router.register_forward_hook(hook)
