"""ZeRO stage 3: parameters, gradients and optimizer state sharded (Rajbhandari et al.,
arXiv:1910.02054, section 5.3), unit by unit, with prefetch in both directions.

Units (:func:`~paraxis_zero.units.find_units`): the embedding, each layer, the head, in
forward order, and a root unit for sharded parameters two units share. Hooks on each
unit's module, in the spirit of FSDP2 (Zhao et al., arXiv:2304.11277):

* forward pre-hook: gather the unit (wait for its prefetch) and start the all-gathers
  of the next ``prefetch`` units (``parallelism.zero_prefetch``, default 1), so they
  overlap this unit's compute;
* forward post-hook: reshard (free the full parameters) and register a hook on the
  outputs' gradients (``register_multi_grad_hook``) that gathers the unit again just
  before its backward and starts the all-gathers of the ``prefetch`` units before it;

* post-accumulate-grad hooks: when every parameter of the unit has its gradient, copy
  them rank-major (each freed once copied), reshard, and reduce-scatter in a fixed unit
  order (the reverse of forward), asynchronously, so ranks never disagree on the next
  collective.

Prefetch depth k holds up to k + 1 units whole at once (FSDP2 sets the same with
``set_modules_to_forward_prefetch`` / ``..._backward_prefetch``) and leaves up to
k + 1 units' reduce-scatters in flight, their send buffers alive (FSDP2 keeps one
besides the newest: k = 1). 0 gathers each unit only when it runs, so every all-gather
is exposed, and waits for each reduce-scatter when the next launches: the least memory.
A unit whose backward reads no weight (a plain embedding lookup) is not gathered for
its backward at all.

Recomputation (activation checkpointing) runs a layer's forward again inside its
backward, after the gradient hook has gathered it: it re-gathers by construction. The
root unit is gathered for the whole forward and backward. Under ``no_sync`` gradients
accumulate whole (as FSDP2 without gradient sync); the final microbatch reduces them.

Units are gathered in the dtype the forward computes in (autocast's under
``train.precision`` bf16 or fp16, read when each forward starts; backward re-gathers in
the same), so the fp32 parity probe still gathers fp32. The token embedding's lookup is
no autocast op: with a bf16 table its output would turn the residual stream bf16, so it
is cast back to the master dtype (the table is rounded once, as FSDP2's and Megatron's
bf16 parameters round it; the stream stays fp32 as under autocast alone).

Beside a pipeline (issue 36) every microbatch runs forward and backward at its own
time, so a unit is gathered once per step, at its first forward, and kept through the
schedule; its gradients accumulate whole (fp32) and are reduce-scattered once, when
the schedule is done (torchtitan's ``reshard_after_forward=False`` for pipeline
stages): one all-gather and one reduce-scatter per step instead of 2m + 1.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten, tree_map

from paraxis.parallel.anatomy import Anatomy
from paraxis.parallel.buckets import FlatAllReduce, SyncSwitch
from paraxis.parallel.code_reading import reads_weights_back
from paraxis.parallel.placement import placement_of
from paraxis.parallel.stages import chunks_of
from paraxis.parallel.strategy import SyncOrder
from paraxis.runtime.grid import Grid
from paraxis_zero.groups import shard_groups
from paraxis_zero.layout import ShardLayout
from paraxis_zero.sharded_unit import Fill, ShardedUnit
from paraxis_zero.units import find_units
from paraxis_zero.whole import WHOLE_BELOW, keep_whole

__all__ = ["ShardedParameters"]


def _layouts(params: list[nn.Parameter], grid: Grid) -> list[ShardLayout]:
    """One layout per (sync group, dtype, trainable) among ``params``, in first-seen
    order: frozen parameters get layouts of their own, which no reduction touches."""
    by_key: dict[tuple[Any, ...], list[nn.Parameter]] = {}
    for p in params:
        key = (placement_of(p).grad_sync_axes, p.dtype, p.requires_grad)
        by_key.setdefault(key, []).append(p)
    out = []
    for (axes, _, _), ps in by_key.items():
        groups = shard_groups(grid, axes)
        out.append(ShardLayout.build(groups.shard, ps, grid.token_replicas,
                                     replicas=groups.replicas, split=groups.split))
    return out


@torch.no_grad()
def _draw_whole(p: nn.Parameter, fill: Fill, device: torch.device | None) -> None:
    """A parameter ZeRO keeps whole, still on the meta device: its local tensor."""
    if not p.is_meta:
        return
    rec = placement_of(p)
    local = torch.zeros(rec.local_shape, dtype=p.dtype, device=device)
    fill(rec, local)
    new = nn.Parameter(local, requires_grad=p.requires_grad)
    new.__dict__.update(p.__dict__)
    torch.utils.swap_tensors(p, new)


def _compute_dtype(kind: str) -> torch.dtype | None:
    """The dtype this forward's matmuls run in: autocast's, or None (as held)."""
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None


class ShardedParameters(SyncSwitch):
    """Gradient synchronizer and shard owner for ZeRO stage 3 (``SyncOrder.DATA``); the
    parameters it keeps whole are its follower's (:class:`FlatAllReduce`). ``keep``:
    units stay gathered from their first forward to :meth:`finish` (beside a
    pipeline)."""

    order = SyncOrder.DATA

    def __init__(self, model: nn.Module, *, grid: Grid, anatomy: Anatomy,
                 bucket_bytes: int, whole_below: int = WHOLE_BELOW, prefetch: int = 1,
                 wire_dtype: torch.dtype | None = None, fill: Fill | None = None,
                 device: torch.device | None = None, keep: bool = False):
        self.grid, self.prefetch, self.keep = grid, prefetch, keep
        self.compute: torch.dtype | None = None  # this step's forward dtype
        params = list(model.parameters())
        self.device_type = (device or params[0].device).type if params else "cpu"
        whole = [p for p in params if keep_whole(p, grid, whole_below)]
        if fill is not None:  # a deferred model: whole ones first (the buckets read them)
            for p in whole:
                _draw_whole(p, fill, device)
        self.whole_params = [p for p in whole if p.requires_grad]
        self.whole = FlatAllReduce(self.whole_params, grid, bucket_bytes, wire_dtype=wire_dtype)
        self.followers = (self.whole,)
        sharded = [p for p in params if not keep_whole(p, grid, whole_below)]
        self.units: list[ShardedUnit] = []  # forward order; the roots first
        self._handles: list[Any] = []
        left = {id(p) for p in sharded}
        for chunk in chunks_of(model):  # chunks share no parameter but a tied one
            mine = [p for p in chunk.parameters() if id(p) in left]
            left -= {id(p) for p in mine}
            specs, rest = find_units(chunk, anatomy, mine)
            root = ShardedUnit("root", chunk, _layouts(rest, grid), wire_dtype=wire_dtype,
                               reshard_after_forward=False, fill=fill,
                               device=device) if rest else None
            units = [ShardedUnit(s.name, s.module, _layouts(s.params, grid),
                                 wire_dtype=wire_dtype, fill=fill, device=device)
                     for s in specs]
            self._hook_root(chunk, root, units[0] if units else None)
            self._hook_embedding(anatomy.embedding_of(chunk))
            for unit in units:
                self._hook(unit)
            self.units += ([root] if root else []) + units
        self._backward_order = list(reversed(self.units))
        # Units whose backward reads no weight (an embedding table): never gathered for it.
        self._not_for_backward = {u for u in self.units if not reads_weights_back(u.module)}
        self._unit_of = {p: u for u in self.units for p in u.trainable}
        self._handles += [p.register_post_accumulate_grad_hook(self._on_grad)
                          for p in self._unit_of]
        self._next = 0  # next unit (backward order) whose reduce-scatter may start
        self._released = 0  # units before it (backward order) hold no send buffer
        # Units holding frozen weights, gathered until the next unit's backward starts:
        # their last trainable gradient is not the end of their backward (a LoRA base
        # layer's or a norm's frozen weight still computes the input's gradient after).
        self._frozen_done: list[ShardedUnit] = []

    def optimizer_params(self) -> list[nn.Parameter]:
        return [p for u in self.units for p in u.trainable] + self.whole_params

    # ---- forward ----------------------------------------------------------------------

    def _prefetch(self, unit: ShardedUnit, direction: int, *, itself: bool = False) -> None:
        """Start the all-gathers of the ``prefetch`` units after ``unit`` (direction 1,
        forward) or before it (-1, backward), counting ``unit`` itself first when
        ``itself``; a root unit stops the walk (it stays gathered through its chunk)."""
        i, first = self.units.index(unit), 0 if itself else 1
        for k in range(first, first + self.prefetch):
            j = i + direction * k
            if not 0 <= j < len(self.units) or self.units[j].name == "root":
                return
            if direction > 0 or self.units[j] not in self._not_for_backward:
                self.units[j].start_gather(self.compute)

    def _hook_root(self, chunk: nn.Module, root: ShardedUnit | None,
                   first: ShardedUnit | None) -> None:
        def pre(module: nn.Module, args: Any) -> None:
            self.compute = _compute_dtype(self.device_type)
            if root is not None:
                root.gather(self.compute)
            if first is not None:
                self._prefetch(first, 1, itself=True)

        def post(module: nn.Module, args: Any, output: Any) -> None:
            if root is not None and not torch.is_grad_enabled():
                root.reshard()

        self._handles += [chunk.register_forward_pre_hook(pre, prepend=True),
                          chunk.register_forward_hook(post)]

    def _hook_embedding(self, embedding: nn.Module | None) -> None:
        """Cast the token embedding's output back to its master dtype when the table
        was gathered in the compute dtype (see the module docstring)."""
        masters = {placement_of(p).dtype for p in embedding.parameters()} \
            if embedding is not None else set()
        if len(masters) != 1:
            return
        (master,) = masters

        def post(module: nn.Module, args: Any, output: Any) -> Any:
            low = self.compute
            if low is None:
                return output
            return tree_map(lambda t: t.to(master) if isinstance(t, torch.Tensor)
                            and t.dtype == low else t, output)

        assert embedding is not None
        self._handles.append(embedding.register_forward_hook(post))

    def _hook(self, unit: ShardedUnit) -> None:
        def pre(module: nn.Module, args: Any) -> None:
            unit.gather(self.compute)
            if self.keep:  # what a split backward's weight pass left, in fp32
                unit.fold()
            self._prefetch(unit, 1)

        def post(module: nn.Module, args: Any, output: Any) -> None:
            if torch.is_grad_enabled():
                tensors = [t for t in tree_flatten(output)[0]
                           if isinstance(t, torch.Tensor) and t.requires_grad]
                if tensors:
                    register_multi_grad_hook(tensors, lambda _: self._pre_backward(unit),
                                             mode="any")
            if not torch.is_grad_enabled() or (unit.reshard_after_forward and not self.keep):
                unit.reshard()

        self._handles += [unit.module.register_forward_pre_hook(pre, prepend=True),
                          unit.module.register_forward_hook(post)]

    # ---- backward ---------------------------------------------------------------------

    def _pre_backward(self, unit: ShardedUnit) -> None:
        # This unit's outputs have their gradients: every unit after it is done.
        for done in self._frozen_done:
            if done is not unit:
                done.reshard()
        self._frozen_done = [] if unit.all_trainable or self.keep else [unit]
        if self.keep or unit not in self._not_for_backward:
            unit.gather(self.compute)
        if self.keep:
            unit.fold()
        self._prefetch(unit, -1)

    def _on_grad(self, param: nn.Parameter) -> None:
        unit = self._unit_of[param]
        if not self.sync or self.keep or unit.accumulating:
            unit.fold(param)  # a bf16 gradient that waits for more: into fp32
        unit.ready.add(id(param))
        if len(unit.ready) < len(unit.trainable):
            return
        unit.ready.clear()
        if self.keep:  # gathered until the schedule is done; reduced at finish
            return
        if self.sync:
            unit.prepare_reduce()
            self._launch_ready()
        if unit.all_trainable:  # else at the next unit's backward (_pre_backward)
            unit.reshard()

    def _launch_ready(self) -> None:
        order = self._backward_order
        while self._next < len(order) and order[self._next].prepared:
            order[self._next].launch_reduce()
            self._next += 1
        # At most prefetch + 1 units' send buffers (whole gradients) stay alive: an
        # older reduce-scatter is waited for and its input freed (FSDP2 bounds them the
        # same way); else every unit's whole gradient lived until finish(), the whole
        # model's gradient on every rank at the end of backward.
        while self._released < self._next - (self.prefetch + 1):
            order[self._released].release_send()
            self._released += 1

    def finish(self) -> float:
        """Reduce what backward did not (parameters without a gradient as zeros, or what
        no_sync accumulated), wait for every reduce-scatter, reshard every unit and
        give each shard its gradient; then the whole parameters'."""
        for unit in self._backward_order[self._next:]:
            if not unit.prepared:
                unit.prepare_reduce()
            unit.launch_reduce()
            if self.keep:  # its whole gradients are gone: free the unit too
                unit.reshard()
        self._next = self._released = 0
        self._frozen_done = []
        start = time.perf_counter()
        for unit in self._backward_order:
            unit.ready.clear()
            unit.reshard()
            unit.wait_reduce()
        return time.perf_counter() - start + self.whole.finish()

    # ---- the optimizer's callbacks ------------------------------------------------------

    def after_step(self) -> None:
        """Nothing: the optimizer stepped the shards the parameters hold."""

    def zero_grad(self) -> None:
        """Nothing: the shards' gradients are views the next reduce-scatter rewrites."""

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.whole.remove_hooks()
