"""One step's tokens as the engine hands them to the model, and the auxiliary-loss channel.

:class:`Batch` holds input ids, *targets* (the label of the next position, shifted
once, here, so that an axis may later cut the sequence without losing the label that
crosses the cut) and optional ``position_ids`` (an axis that cuts the sequence passes
each rank's true positions). A strategy's batch transform
(``ApplyContext.batch_transforms``) takes and returns a Batch; the engine counts tokens
after the transforms, so an axis that splits the sequence never multiplies the global
token count. A user's ``attention_mask`` is kept only when it masks something
(``padding_mask``). The engine does not pass it to the model yet, so only *right*
padding is accepted: under a causal mask a real token never attends to a pad after it,
and the targets at padded positions are ignored, which makes the loss the model's own
masked loss. Any other mask (left padding, holes) is refused before the step runs:
real tokens would attend to the pads and the loss would silently differ. An axis that
cannot honour even right padding (context parallelism) refuses it too.

:class:`AuxLosses` carries losses other than next-token cross-entropy (a router's
load-balancing loss, its z-loss) from modules to the engine.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

__all__ = ["IGNORE_INDEX", "AuxLosses", "Batch", "Carried", "check_right_padding", "shift_labels"]

IGNORE_INDEX = -100


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """targets[:, i] = labels[:, i + 1]; the last position has no next token (ignored)."""
    targets = torch.full_like(labels, IGNORE_INDEX)
    targets[:, :-1] = labels[:, 1:]
    return targets


def check_right_padding(mask: torch.Tensor) -> None:
    """Raise unless every row of ``mask`` is ones followed by zeros (right padding).

    No axis passes the mask to the model yet; right padding is exact without it under a
    causal mask (a real token never attends to a later pad), any other layout is not
    (real tokens after left pads would attend to them)."""
    m = mask.bool()
    if m.dim() != 2:
        raise ValueError(f"attention_mask must be (batch, sequence); got shape {tuple(m.shape)}")
    bad = (m[:, 1:] & ~m[:, :-1]).any(dim=1).nonzero().flatten()
    if bad.numel():
        raise ValueError(
            f"attention_mask is not right padding: row(s) {bad.tolist()[:8]} have a masked "
            "position before an unmasked one (left padding, or gaps between documents). "
            "paraxis does not pass the mask to the model yet, so real tokens would attend "
            "to the pads and the loss would differ from the model's own. Pad on the right "
            "(labels at padded positions are ignored), or pack rows without padding")


@dataclass(frozen=True)
class Batch:
    """Token ids ``(b, s)``, their targets ``(b, s)`` and, when an axis moved them,
    position ids ``(b, s)`` (None: ``0..s-1`` as the model assumes). ``padding_mask``
    is the user's ``attention_mask`` when it has a zero (None otherwise); it is not
    passed to the model."""

    input_ids: torch.Tensor
    targets: torch.Tensor
    position_ids: torch.Tensor | None = None
    padding_mask: torch.Tensor | None = None

    @classmethod
    def from_user(cls, batch: Any) -> Batch:
        """Token ids, or a mapping with ``input_ids`` and optional ``labels`` (``-100``
        ignored; labels equal the ids when absent), as transformers' ``labels=``."""
        if isinstance(batch, Batch):
            return batch
        mask = None
        if isinstance(batch, Mapping):
            ids = batch["input_ids"]
            labels = batch.get("labels", ids)
            mask = batch.get("attention_mask")
            mask = None if mask is None or bool(mask.bool().all()) else mask
        else:
            ids = labels = batch
        if mask is not None:
            check_right_padding(mask)
            labels = labels.masked_fill(~mask.bool().expand_as(labels), IGNORE_INDEX)
        return cls(ids, shift_labels(labels), padding_mask=mask)

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
        pos = _rows(self.position_ids, n)
        masks = _rows(self.padding_mask, n)
        return [Batch(i, t, p, m) for i, t, p, m in zip(
            self.input_ids.chunk(n), self.targets.chunk(n), pos, masks, strict=True)]

    def to(self, device: torch.device) -> Batch:
        pos = None if self.position_ids is None else self.position_ids.to(device)
        mask = None if self.padding_mask is None else self.padding_mask.to(device)
        return replace(self, input_ids=self.input_ids.to(device),
                       targets=self.targets.to(device), position_ids=pos, padding_mask=mask)

    def model_kwargs(self) -> dict[str, torch.Tensor]:
        """Keyword arguments besides the ids that the model's forward takes."""
        return {} if self.position_ids is None else {"position_ids": self.position_ids}


def _rows(t: torch.Tensor | None, n: int) -> list[torch.Tensor | None]:
    # A tensor with one row (or None) is shared by every sample of every microbatch.
    return [t] * n if t is None or t.shape[0] == 1 else list(t.chunk(n))


@dataclass
class Carried:
    """What one forward of a module left to be resolved once numbers from other pipeline
    stages are known: this stage's contribution to the carry (float64, the declared
    carry size) and, per slot, how to turn the finalized carry into loss parts."""

    contribution: torch.Tensor
    resolvers: list[tuple[int, Callable[[torch.Tensor], dict[str, torch.Tensor]]]]


class AuxLosses:
    """Losses besides next-token cross-entropy, from modules to the engine.

    A strategy ``declare``s each name once at apply time (every rank the same names, so
    metrics reduce as one vector). During a microbatch's forward a module ``add``s its
    *part*: a differentiable scalar whose sum over the ranks holding distinct tokens
    (data x expert x context) and over pipeline stages is the loss's value for that
    microbatch, with its coefficient applied. The engine (or the pipeline runner, per
    stage) ``pop``s the parts after each forward and adds them to what it
    back-propagates, scaled like the language-model loss, and reports each name's value
    averaged over microbatches, separately from the language-model loss.

    **Carries.** A loss that is not a sum of per-stage terms (the Switch load-balancing
    loss is joint over all layers: its routing fractions count every layer's tokens)
    declares a carry slot (``declare_carry(size, finalize)``) and, in each forward,
    ``carry``s this stage's contribution (no gradient) with a ``resolve`` function. The
    contributions are summed along the pipeline: each stage's is added to what the
    previous stage sent beside its hidden states; the stage that completes the sum
    calls ``finalize`` once per microbatch (collective over the ranks holding distinct
    tokens, e.g. an all-reduce), and the finalized numbers travel back beside the
    gradient, so every stage resolves its exact parts before its backward. Without a
    pipeline, :meth:`objective` does all of it at once.
    """

    def __init__(self) -> None:
        self.names: list[str] = []
        self._parts: dict[str, torch.Tensor] = {}
        # This rank's popped values of the current step, by name (summed).
        self.totals: dict[str, float] = {}
        self._slots: list[tuple[int, int, Callable[[torch.Tensor], torch.Tensor]]] = []
        self._carried: list[tuple[int, torch.Tensor, Callable[..., Any]]] = []

    def declare(self, name: str) -> None:
        if name not in self.names:
            self.names.append(name)

    def add(self, name: str, part: torch.Tensor) -> None:
        if name not in self.names:
            raise KeyError(f"auxiliary loss {name!r} was not declared; declared: {self.names}")
        self._parts[name] = self._parts[name] + part if name in self._parts else part

    def pop(self) -> dict[str, torch.Tensor]:
        """The parts added since the last pop (their values go into ``totals``)."""
        parts, self._parts = self._parts, {}
        self._count(parts)
        return parts

    def _count(self, parts: dict[str, torch.Tensor]) -> None:
        for name, part in parts.items():
            self.totals[name] = self.totals.get(name, 0.0) + float(part.detach())

    def reset_totals(self) -> None:
        self.totals = {}

    def clear(self) -> None:
        """Forget parts and carries added since the last pop (evaluation)."""
        self._parts, self._carried = {}, []

    # ---- carries ---------------------------------------------------------------------

    def declare_carry(self, size: int, finalize: Callable[[torch.Tensor], torch.Tensor]) -> int:
        """Reserve ``size`` float64 numbers per microbatch; ``finalize(total)`` maps their
        sum over stages to what every stage resolves with (same size). Returns the slot."""
        self._slots.append((self.carry_size, size, finalize))
        return len(self._slots) - 1

    @property
    def carry_size(self) -> int:
        return sum(size for _, size, _ in self._slots)

    def carry(self, slot: int, contribution: torch.Tensor,
              resolve: Callable[[torch.Tensor], dict[str, torch.Tensor]]) -> None:
        """During a forward: this stage's ``contribution`` to ``slot`` and how to turn
        the slot's finalized numbers into loss parts (differentiable scalars by name)."""
        self._carried.append((slot, contribution.detach().to(torch.float64).reshape(-1),
                              resolve))

    def pop_carried(self, device: Any = None) -> Carried:
        """The contributions and resolvers carried since the last call."""
        items, self._carried = self._carried, []
        vector = torch.zeros(self.carry_size, dtype=torch.float64, device=device)
        for slot, contribution, _ in items:
            offset, size, _ = self._slots[slot]
            vector[offset:offset + size] += contribution.to(vector.device)
        return Carried(vector, [(slot, resolve) for slot, _, resolve in items])

    def finalize(self, total: torch.Tensor) -> torch.Tensor:
        """Every slot's ``finalize`` on its part of the summed carry (collective)."""
        return torch.cat([fin(total[o:o + n]) for o, n, fin in self._slots]) if self._slots \
            else total

    def resolve(self, carried: Carried, final: torch.Tensor) -> dict[str, torch.Tensor]:
        """This stage's parts from the finalized carry (their values go into ``totals``)."""
        parts: dict[str, torch.Tensor] = {}
        for slot, resolve in carried.resolvers:
            offset, size, _ = self._slots[slot]
            for name, part in resolve(final[offset:offset + size]).items():
                if name not in self.names:
                    raise KeyError(f"auxiliary loss {name!r} was not declared")
                parts[name] = parts[name] + part if name in parts else part
        self._count(parts)
        return parts

    @staticmethod
    def weighted(parts: dict[str, torch.Tensor], scale: float) -> torch.Tensor | None:
        """The sum of ``parts`` times ``scale`` (None when there are none)."""
        return sum(parts.values()) * scale if parts else None  # type: ignore[return-value]

    def objective(self, loss: torch.Tensor, scale: float) -> torch.Tensor:
        """``loss`` plus every popped part times ``scale``: what one forward
        back-propagates (the engine's scale undoes the replicas' gradient averaging and
        averages over microbatches). Without a pipeline the carry is finalized here."""
        parts = self.pop()
        if self._slots:
            carried = self.pop_carried(loss.device)
            resolved = self.resolve(carried, self.finalize(carried.contribution))
            for name, part in resolved.items():
                parts[name] = parts[name] + part if name in parts else part
        extra = self.weighted(parts, scale)
        return loss if extra is None else loss + extra

    def __bool__(self) -> bool:
        return bool(self.names)
