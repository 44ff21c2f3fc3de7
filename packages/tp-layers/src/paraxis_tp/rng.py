"""Dropout randomness under tensor parallelism (Megatron-LM's RNG tracker, arXiv:1909.08053,
section 3).

Activations replicated across the tensor group need the *same* dropout mask on every
rank, so they draw from torch's default generator, seeded identically everywhere.
Activations split across the group (attention heads between the column- and
row-parallel linears) need *different* masks, so inside that region the generator is
swapped for a per-rank stream seeded with ``seed + 2718 + tensor rank`` (Megatron's
offset). :class:`TensorParallelRNG` holds that stream; its state goes into checkpoints.
"""

from __future__ import annotations

import torch

__all__ = ["TensorParallelRNG"]

MEGATRON_OFFSET = 2718


class TensorParallelRNG:
    """The per-rank stream of the generator that ``device``'s dropout draws from."""

    def __init__(self, seed: int, tensor_rank: int, device: torch.device | None = None):
        cuda = device is not None and device.type == "cuda"
        self._get = torch.cuda.get_rng_state if cuda else torch.get_rng_state
        self._set = torch.cuda.set_rng_state if cuda else torch.set_rng_state
        gen = torch.Generator(device=device or "cpu").manual_seed(
            seed + MEGATRON_OFFSET + tensor_rank)
        self._state = gen.get_state()
        self._outer: torch.Tensor | None = None

    @property
    def active(self) -> bool:
        return self._outer is not None

    def enter(self) -> None:
        """Switch to the per-rank stream (idempotent)."""
        if self._outer is None:
            self._outer = self._get()
            self._set(self._state)

    def exit(self) -> None:
        """Back to the default, replicated stream (idempotent)."""
        if self._outer is not None:
            self._state = self._get()
            self._set(self._outer)
            self._outer = None

    def get_state(self) -> torch.Tensor:
        return (self._get() if self.active else self._state).clone()

    def set_state(self, state: torch.Tensor) -> None:
        if self.active:
            self._set(state)
        else:
            self._state = state.clone()
