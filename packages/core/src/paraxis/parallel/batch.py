"""One step's tokens as the engine hands them to the model: ids, targets, positions,
the padding mask and document boundaries.

:class:`Batch` holds input ids and *targets* (the label of the next position, shifted
once, here, so that an axis may later cut the sequence without losing the label that
crosses the cut). A strategy's batch transform (``ApplyContext.batch_transforms``)
takes and returns a Batch; the engine counts tokens after the transforms, so an axis
that splits the sequence never multiplies the global token count.

What the model is told, through :meth:`Batch.model_kwargs`:

* **Padding** (``attention_mask`` with zeros, left or right): the mask goes to the
  model, which builds its own attention mask from it (transformers does, for every
  attention implementation and sliding window). A token is a target only if the token
  before it is real: pads are never targets, and nothing is predicted from a pad (a
  left-padded row's first real token, which nothing precedes, is not a target).
  Real tokens count positions from 0 after left pads (``cumsum(mask) - 1``, as
  transformers' ``generate`` does), so the loss is the model's own loss for that call
  with labels -100 at the pads and at each row's first real token.
* **Documents** packed in a row (``position_ids`` that restart at 0 where a document
  starts, transformers' ``DataCollatorWithFlattening`` layout, and paraxis' packer's):
  the positions go to the model, which masks attention across the boundaries from them
  (transformers' packed-sequence detection, with ``use_cache=False`` and no 2-D mask);
  the target that would cross a boundary is ignored. Whether a family really honours
  them is checked once at ``parallelize`` (``paraxis.engine.masks``).
* An axis that cuts the sequence (context parallelism) cannot hand a whole-sequence
  mask to a rank's shard: its transform turns padding and documents into per-token
  ``document_ids`` (pads -1) before cutting, and its attention kernel masks with them
  (``paraxis_doc_ids``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

__all__ = ["DOC_IDS_KWARG", "IGNORE_INDEX", "Batch", "document_ids", "shift_labels"]

IGNORE_INDEX = -100
# The keyword under which a sequence-cutting axis hands its attention kernel the
# per-token document ids (transformers passes unknown keywords to the attention).
DOC_IDS_KWARG = "paraxis_doc_ids"


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """targets[:, i] = labels[:, i + 1]; the last position has no next token (ignored)."""
    targets = torch.full_like(labels, IGNORE_INDEX)
    targets[:, :-1] = labels[:, 1:]
    return targets


def document_ids(position_ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Per token, the index of its document in the row (a new one where the position
    restarts at 0, and at the row's start); -1 where ``mask`` is 0 (padding)."""
    starts = position_ids == 0
    starts[..., 0] = True
    docs = starts.long().cumsum(-1) - 1
    return docs if mask is None else docs.masked_fill(~mask.bool(), -1)


def _is_right_padding(mask: torch.Tensor) -> bool:
    m = mask.bool()
    return not bool((m[:, 1:] & ~m[:, :-1]).any())


@dataclass(frozen=True)
class Batch:
    """Token ids ``(b, s)``, their targets ``(b, s)``; ``position_ids`` ``(b, s)`` when
    they are not ``0..s-1`` (packed documents, left padding, or an axis moved them);
    ``padding_mask`` the user's ``attention_mask`` when it masks something; ``packed``
    when rows hold several documents (their positions restart); ``document_ids`` set by
    an axis that cuts the sequence (see the module docstring)."""

    input_ids: torch.Tensor
    targets: torch.Tensor
    position_ids: torch.Tensor | None = None
    padding_mask: torch.Tensor | None = None
    document_ids: torch.Tensor | None = None
    packed: bool = False

    @classmethod
    def from_user(cls, batch: Any) -> Batch:
        """Token ids, or a mapping with ``input_ids`` and optional ``labels`` (``-100``
        ignored; labels equal the ids when absent), ``attention_mask`` and
        ``position_ids``, as transformers' ``labels=``."""
        if isinstance(batch, Batch):
            return batch
        if not isinstance(batch, Mapping):
            return cls(batch, shift_labels(batch))
        ids = batch["input_ids"]
        labels, mask = batch.get("labels", ids), batch.get("attention_mask")
        positions = batch.get("position_ids")
        mask = None if mask is None or bool(mask.bool().all()) else mask
        if mask is not None:
            if mask.shape != ids.shape:
                raise ValueError(f"attention_mask has shape {tuple(mask.shape)}, input_ids "
                                 f"{tuple(ids.shape)}: give one 0/1 per token")
            labels = labels.masked_fill(~mask.bool(), IGNORE_INDEX)
        targets = shift_labels(labels)
        if mask is not None:  # nothing is predicted from a pad (a left-padded row's first
            targets.masked_fill_(~mask.bool(), IGNORE_INDEX)  # real token has no context)
        if positions is None:
            if mask is not None and not _is_right_padding(mask):
                # Real tokens count from 0 after the pads, as transformers' generate does
                # (learned absolute positions need it; rotary ones are unchanged by it).
                positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
            return cls(ids, targets, positions, mask)
        positions = positions.expand_as(ids)
        if mask is not None and not _is_right_padding(mask):
            raise ValueError(
                "packed documents (position_ids) with padding before a token: pad packed "
                "rows on the right only (their pads are ignored as targets)")
        # The target of a document's last token is the next document's first.
        targets[:, :-1].masked_fill_(positions[:, 1:] == 0, IGNORE_INDEX)
        if bool((positions[:, 1:] == positions[:, :-1] + 1).all()):
            return cls(ids, targets, None, mask)  # one document per row: plain positions
        # Right pads after packed documents need no mask under a causal one (the model
        # takes the documents from the positions only when it is given no 2-D mask).
        return cls(ids, targets, positions, None, packed=True)

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])


    def tokens(self) -> torch.Tensor:
        """How many targets count (a 0-d tensor)."""
        return (self.targets != IGNORE_INDEX).sum()

    def chunk(self, n: int) -> list[Batch]:
        if self.batch_size % n:
            raise ValueError(f"local batch of {self.batch_size} does not split into {n} "
                             "microbatches (schedule.microbatches)")
        parts = [_rows(t, n) for t in (self.position_ids, self.padding_mask,
                                       self.document_ids)]
        return [Batch(i, t, p, m, d, self.packed) for i, t, p, m, d in zip(
            self.input_ids.chunk(n), self.targets.chunk(n), *parts, strict=True)]

    def to(self, device: torch.device) -> Batch:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return replace(self, input_ids=self.input_ids.to(device),
                       targets=self.targets.to(device), position_ids=move(self.position_ids),
                       padding_mask=move(self.padding_mask),
                       document_ids=move(self.document_ids))

    def model_kwargs(self) -> dict[str, torch.Tensor]:
        """Keyword arguments besides the ids that the model's forward takes."""
        out: dict[str, torch.Tensor] = {}
        if self.position_ids is not None:
            out["position_ids"] = self.position_ids
        if self.padding_mask is not None:
            out["attention_mask"] = self.padding_mask
        if self.document_ids is not None:
            out[DOC_IDS_KWARG] = self.document_ids
        return out


def _rows(t: torch.Tensor | None, n: int) -> list[torch.Tensor | None]:
    # A tensor with one row (or None) is shared by every sample of every microbatch.
    return [t] * n if t is None or t.shape[0] == 1 else list(t.chunk(n))
