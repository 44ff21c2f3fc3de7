"""Measure what the plan predicts, to check it (issue 15, "against measurement").

:class:`SavedActivations` counts the bytes autograd keeps for the backward inside a
``with`` block, through :func:`torch.autograd.graph.saved_tensors_hooks`: every tensor
saved for backward is packed through the hook; its storage is counted once however
many views of it are saved, and storages of parameters (weights saved by a matmul are
not activations) can be excluded. Under non-reentrant activation checkpointing the
recomputed region's own hooks take precedence, so what is counted is what is stored.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["SavedActivations"]


def _key(t: torch.Tensor) -> tuple[str, int]:
    storage = t.untyped_storage()
    return str(t.device), storage.data_ptr()


class SavedActivations:
    """``with SavedActivations(exclude=model.parameters()) as saved: loss = model(x)``;
    then ``saved.bytes`` is the activation memory of that forward (unique storages)."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        self._excluded = {_key(p) for p in exclude}
        self.storages: dict[tuple[str, int], int] = {}
        self._hooks: Any = None

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key = _key(t)
        if key not in self._excluded and key[1] != 0:  # 0: no storage (e.g. meta)
            self.storages[key] = t.untyped_storage().nbytes()
        return t

    @staticmethod
    def _unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())

    def __enter__(self) -> SavedActivations:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)
        self._hooks = None
