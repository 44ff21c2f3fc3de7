"""Does this model honour a padding mask and packed-document boundaries? Measured once, on
the whole model (or its twin) before any axis applies, and enforced on every batch.

paraxis hands the model its masks as the model's own call takes them
(:meth:`paraxis.parallel.batch.Batch.model_kwargs`): a 2-D ``attention_mask`` for
padding, ``position_ids`` restarting at each document for packed rows. Whether a family
turns those into attention masks is the family's code (transformers does for most
causal LMs, some compute their own positions or ignore the mask), so it is measured,
not assumed: a document packed behind another must give the same logits as alone, a
left-padded row the same logits on its real tokens as unpadded. A batch the model
would get wrong is refused at ``train_step`` with the measurement, never trained.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from paraxis.parallel.numerics import REDUCTION_RTOL

__all__ = ["MaskSupport", "measure_masks"]


@dataclass(frozen=True)
class MaskSupport:
    """Why the model cannot take packed documents or padding (None: it can), as
    measured; ``checked`` False when nothing was measured (``verify=False``)."""

    documents: str | None = None
    padding: str | None = None
    checked: bool = True

    def refuse(self, batch: Any, model_name: str) -> None:
        """Raise if ``batch`` needs what the model does not honour."""
        if not self.checked:
            return
        if batch.packed and self.documents is not None:
            raise ValueError(
                f"{model_name} does not honour packed-document boundaries given as "
                f"position_ids that restart at each document ({self.documents}); its "
                "tokens would attend across documents. Pack without document masking "
                "(data.document_masking: false, or pass one document per row) or use a "
                "family that builds its mask from positions")
        if batch.padding_mask is not None and self.padding is not None:
            raise ValueError(
                f"{model_name} does not honour a padding attention_mask "
                f"({self.padding}); real tokens would attend to the pads. Pad on the "
                "right without a mask (exact under a causal mask) or pack rows instead")


def _logits(model: nn.Module, ids: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
    out = model(ids, **kwargs)
    return (out.logits if hasattr(out, "logits") else out).float()


def _differs(got: torch.Tensor, want: torch.Tensor) -> str | None:
    scale = float(want.abs().max()) or 1.0
    diff = float((got - want).abs().max()) / scale
    # Two attention orders of one sum: the reduction tolerance, with room for the
    # softmax of a masked row (measured exact paths sit near 1e-7).
    return None if diff <= 10 * REDUCTION_RTOL else f"measured: logits differ by {diff:.1e} " \
        "of their largest"


@torch.no_grad()
def measure_masks(model: nn.Module, vocab: int, forward_kwargs: dict[str, Any]) -> MaskSupport:
    """Run the whole ``model`` (eval mode, one process) on a packed row against its
    second document alone, and on a left-padded row against the row unpadded."""
    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(77)
    first = torch.randint(1, max(vocab, 2), (1, 6), generator=g).to(device)
    second = torch.randint(1, max(vocab, 2), (1, 5), generator=g).to(device)
    modes = {m: m.training for m in model.modules()}
    model.eval()
    try:
        alone = _logits(model, second, dict(forward_kwargs))
        packed = torch.cat([first, second], dim=1)
        positions = torch.cat([torch.arange(6), torch.arange(5)]).to(device)[None]
        documents = _try(lambda: _differs(_logits(model, packed, {
            **forward_kwargs, "position_ids": positions})[:, 6:], alone))
        padded = torch.cat([torch.zeros_like(first[:, :3]), second], dim=1)
        mask = torch.cat([torch.zeros(1, 3), torch.ones(1, 5)], dim=1).long().to(device)
        shifted = (mask.cumsum(-1) - 1).clamp(min=0)  # as Batch.from_user gives them
        padding = _try(lambda: _differs(_logits(model, padded, {
            **forward_kwargs, "attention_mask": mask, "position_ids": shifted})[:, 3:],
            alone))
    finally:
        for m, mode in modes.items():
            m.train(mode)
    return MaskSupport(documents, padding)


def _try(check: Any) -> str | None:
    try:
        return check()
    except Exception as exc:  # a forward that does not take the keyword
        return f"its forward raised {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
