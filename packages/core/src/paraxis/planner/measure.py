"""Measure what the plan predicts, to check it (issue 15, "against measurement").

:class:`SavedActivations` counts the bytes autograd keeps for the backward inside a
``with`` block, through :func:`torch.autograd.graph.saved_tensors_hooks`: every tensor
saved for backward is packed through the hook; its storage is counted once however
many views of it are saved, and storages of parameters (weights saved by a matmul are
not activations) can be excluded. Under non-reentrant activation checkpointing the
recomputed region's own hooks take precedence, so what is counted is what is stored.

``bytes`` is every storage ever saved in the block; ``peak`` the most held at once
(a storage is released when autograd drops the last saved reference to it, after its
backward): over a whole training step that is the activation memory of the schedule,
e.g. the p microbatches a 1F1B first stage holds.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["SavedActivations"]


def _key(t: torch.Tensor) -> tuple[str, int]:
    storage = t.untyped_storage()
    return str(t.device), storage.data_ptr()


class _Held:
    """One saved tensor; when autograd frees it, the counter's reference drops."""

    __slots__ = ("counter", "key", "tensor")

    def __init__(self, counter: SavedActivations, key: tuple[str, int] | None,
                 tensor: torch.Tensor):
        self.counter, self.key, self.tensor = counter, key, tensor

    def __del__(self) -> None:
        if self.key is not None:
            self.counter._release(self.key)


class SavedActivations:
    """``with SavedActivations(parameters_of=model) as saved: loss = model(x)``;
    then ``saved.bytes`` is the activation memory of that forward (unique storages) and
    ``saved.peak`` the most bytes held at once."""

    def __init__(self, exclude: Iterable[torch.Tensor] = (),
                 parameters_of: torch.nn.Module | None = None):
        self._excluded = {_key(p) for p in exclude}
        # Checked at each save: a parameter whose storage changes during the step (ZeRO-3
        # gathers a layer's weights into a full buffer) is still not an activation.
        self._module = parameters_of
        self.storages: dict[tuple[str, int], int] = {}
        self.peak = 0
        self._live: dict[tuple[str, int], list[int]] = {}  # key -> [references, bytes]
        self._live_bytes = 0
        self._hooks: Any = None

    def _pack(self, t: torch.Tensor) -> _Held:
        key = _key(t)
        if self._module is not None and key in {_key(p) for p in self._module.parameters()}:
            return _Held(self, None, t)
        if key in self._excluded or key[1] == 0:  # 0: no storage (e.g. meta)
            return _Held(self, None, t)
        nbytes = t.untyped_storage().nbytes()
        self.storages[key] = nbytes
        entry = self._live.get(key)
        if entry is None:
            self._live[key] = [1, nbytes]
            self._live_bytes += nbytes
            self.peak = max(self.peak, self._live_bytes)
        else:
            entry[0] += 1
        return _Held(self, key, t)

    def _release(self, key: tuple[str, int]) -> None:
        entry = self._live.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            self._live_bytes -= entry[1]
            del self._live[key]

    @staticmethod
    def _unpack(held: _Held) -> torch.Tensor:
        return held.tensor

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())

    @property
    def live(self) -> int:
        """Bytes still held for a backward that has not run yet."""
        return self._live_bytes

    def __enter__(self) -> SavedActivations:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)
        self._hooks = None
