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

:func:`held_model_state` reads the model state a laid-out engine holds from its tensors'
storages, each storage once (a view, a shard inside a padded parameter or a gradient
inside a bucket adds nothing): on the meta device too, where it is what
``paraxis plan --dry-run`` measures. :func:`end_step_without_forward` first runs what a
step does after its forward and backward, so that every gradient buffer and every piece
of optimizer state the engine would keep exists where it lives.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["HeldState", "SavedActivations", "end_step_without_forward", "held_model_state"]


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


@dataclass(frozen=True)
class HeldState:
    """Bytes of model state one rank holds, each storage counted once."""

    parameters: float
    gradients: float
    optimizer: float


def _storage_id(t: torch.Tensor) -> int:
    # The storage object's address: a meta tensor has no data pointer (0 for all of
    # them), but its views share its storage object as a real tensor's do.
    return t.untyped_storage()._cdata


def _storage_bytes(tensors: Iterable[torch.Tensor | None],
                   skip: set[int]) -> tuple[int, set[int]]:
    """Bytes of the storages behind ``tensors`` not in ``skip``, each once; their ids."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        key = _storage_id(t)
        if key not in skip and key not in seen:
            seen[key] = t.untyped_storage().nbytes()
    return sum(seen.values()), set(seen)


def end_step_without_forward(engine: Any) -> None:
    """The rest of a training step once backward is done, on an engine that ran no
    forward (a dry run's, on the meta device): every gradient synchronizer finishes as
    at the end of a step, creating each gradient where it lives (a bucket, a padded
    stage-1 gradient, a reduce-scattered shard; a parameter backward did not reach is
    reduced as zeros); a parameter the optimizer steps that no synchronizer gave a
    gradient gets one from autograd, as backward would; then the optimizer's first step
    creates its state. Collective (on a fake process group nothing moves).

    The tensor axis' partial-sum synchronizer is left out: it only sums gradients that
    exist, in place, through a temporary buffer, and tells partial parameters from the
    gradients' values, which meta tensors do not have."""
    from paraxis.parallel.optimizers import optimizer_params
    from paraxis.parallel.strategy import SyncOrder

    for sync in engine.ctx.ordered_syncs():
        if getattr(sync, "order", SyncOrder.DATA) != SyncOrder.PARTIAL:
            sync.finish()
    missing = [p for p in optimizer_params(engine.optimizer)
               if p.requires_grad and p.grad is None]
    if missing:  # AccumulateGrad allocates each like its parameter
        torch.autograd.backward([p.sum() for p in missing])
    engine.optimizer.step()


def held_model_state(engine: Any) -> HeldState:
    """Parameters (the model's and the optimizer's: a ZeRO shard is a view of a padded
    parameter, counted with it), gradients (every ``.grad`` of those, and every buffer
    the gradient synchronizers keep, staging buffers included) and optimizer state, in
    bytes, from the storages behind ``engine``'s tensors (see the module docstring)."""
    from paraxis.engine.metrics import tensors_held_by
    from paraxis.parallel.optimizers import optimizer_params

    params = list({id(p): p for p in [*engine.model.parameters(),
                                      *optimizer_params(engine.optimizer)]}.values())
    weights, weight_ids = _storage_bytes(params, set())
    state = [t for s in engine.optimizer.state.values() for t in s.values()
             if isinstance(t, torch.Tensor)]
    optimizer, state_ids = _storage_bytes(state, weight_ids)
    grads = [p.grad for p in params]
    for sync in engine.ctx.grad_syncs:
        grads += list(tensors_held_by(sync))
    gradients, _ = _storage_bytes(grads, weight_ids | state_ids)
    return HeldState(float(weights), float(gradients), float(optimizer))
