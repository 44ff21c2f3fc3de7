"""Losses besides next-token cross-entropy (a router's load-balancing loss, its z-loss),
from the modules that compute them to the engine and the pipeline runner: see
:class:`AuxLosses`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["AuxLosses", "Carried"]


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
        # Parts differ between tensor ranks (a router that sees only its rank's share of
        # the sequence under sequence parallelism): the engine sums them over every
        # rank, not only over tensor rank 0, where tensor ranks hold copies.
        self.split_over_tensor = False
        # A gradient check's forward (``Engine.fp32_backward``, in eval mode): modules add
        # their parts whatever their mode, so its gradients hold the losses training
        # back-propagates, and count nothing else (routing statistics, the loads a bias
        # update reads), which a check must leave as the training steps made them.
        self.checking = False
        # Why the losses trained are another function than the model's own forward
        # computes with ``output_router_logits=True`` ("" where they are the same): a
        # check against the model's own then leaves them out (the parity probe).
        self.unlike_model = ""
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
