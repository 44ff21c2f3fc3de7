"""The language-model loss every layout reduces to: summed next-token cross-entropy over
non-ignored targets, divided by the global token count by the engine."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from paraxis.parallel.batch import IGNORE_INDEX

__all__ = ["causal_lm_loss_sum"]


def causal_lm_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Summed cross-entropy of ``logits`` against already-shifted ``targets`` (``-100``
    ignored) and the number of tokens it covers. With ``targets = shift_labels(labels)``
    sum / count equals transformers' ``labels=`` loss.

    Computed in at least float32 (half-precision logits are upcast); float64 logits stay
    float64, so a float64 model is float64 end to end (the coverage matrix's exact
    reference, ``paraxis_coverage.drift``)."""
    flat_targets = targets.reshape(-1).to(logits.device)
    wide = torch.promote_types(logits.dtype, torch.float32)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).to(wide), flat_targets,
                           ignore_index=IGNORE_INDEX, reduction="sum")
    return loss, int((flat_targets != IGNORE_INDEX).sum())
