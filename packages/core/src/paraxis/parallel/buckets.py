"""Gradient buckets shared by the data axes: which parameters travel together, and flat
buffers laid out for them, and the loop that reduces them.

The scheme of PyTorch DDP (Li et al., "PyTorch Distributed", VLDB 2020,
arXiv:2006.15704): parameters are packed into buckets of about ``bucket_bytes``, filled
in reverse registration order (which approximates the order backward produces
gradients), one reduction group, dtype and device per bucket, so one collective reduces
a bucket. :class:`BucketLoop` is the one loop that launches them from backward hooks
in a fixed order and finishes them; :class:`FlatAllReduce` all-reduces flat buckets
whose views are the gradients (paraxis-dp-core's data parallelism, and the parameters
paraxis-zero-shard keeps whole); ZeRO 1/2 reduce-scatters buckets of the same assignment
through the same loop. :class:`SyncSwitch` is the one ``no_sync``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch
from torch import nn

from paraxis.parallel.placement import placement_of
from paraxis.runtime.collectives import all_reduce_
from paraxis.runtime.grid import AxisGroup, Grid

__all__ = ["BucketLoop", "FlatAllReduce", "FlatBucket", "MiB", "SyncSwitch", "adopt_grad",
           "assign_buckets"]

B = TypeVar("B")

MiB = 1 << 20


def _sync_axes(p: nn.Parameter) -> tuple[str, ...]:
    return placement_of(p).grad_sync_axes


def assign_buckets(params: Iterable[nn.Parameter], grid: Grid, bucket_bytes: int, *,
                   axes_of: Callable[[nn.Parameter], tuple[str, ...]] = _sync_axes,
                   include_single: bool = False,
                   ) -> list[tuple[AxisGroup, list[nn.Parameter]]]:
    """Buckets of ``params`` in reverse order, keyed by the group ``axes_of`` names (the
    gradient-sync group of each placement by default), dtype and device; a bucket closes
    once it holds ``bucket_bytes``. Parameters whose group has one member need no
    reduction and are left out, unless ``include_single`` (they still need the
    :attr:`~paraxis.runtime.grid.Grid.token_replicas` division). Every rank gets the same
    buckets in the same order."""
    open_buckets: dict[tuple[Any, ...], list[nn.Parameter]] = {}
    sizes: dict[tuple[Any, ...], int] = {}
    done: list[tuple[AxisGroup, list[nn.Parameter]]] = []
    for p in reversed(list(params)):
        group = grid.group(axes_of(p))
        if group.size == 1 and not include_single:
            continue
        key = (group.axes, p.dtype, p.device)
        open_buckets.setdefault(key, []).append(p)
        sizes[key] = sizes.get(key, 0) + p.numel() * p.element_size()
        if sizes[key] >= bucket_bytes:
            done.append((group, open_buckets.pop(key)))
            sizes.pop(key)
    for key, ps in open_buckets.items():
        done.append((grid.group(key[0]), ps))
    return done


@dataclass(eq=False)
class FlatBucket:
    """Parameters whose gradients are views of one flat buffer, reduced by one
    collective over ``group``. ``ready`` holds the indices whose gradient is final this
    step; ``work`` the collective in flight."""

    group: AxisGroup
    params: list[nn.Parameter]
    buffer: torch.Tensor
    views: list[torch.Tensor]
    divisor: int = 1  # what the reduced sum is divided by (token_replicas)
    ready: set[int] = field(default_factory=set)
    work: Any = None

    @classmethod
    def allocate(cls, group: AxisGroup, params: list[nn.Parameter],
                 divisor: int = 1) -> FlatBucket:
        total = sum(p.numel() for p in params)
        buffer = torch.zeros(total, dtype=params[0].dtype, device=params[0].device)
        views, offset = [], 0
        for p in params:
            views.append(buffer[offset: offset + p.numel()].view_as(p))
            offset += p.numel()
        return cls(group, params, buffer, views, divisor)

    @property
    def full(self) -> bool:
        return len(self.ready) == len(self.params)


def adopt_grad(param: nn.Parameter, view: torch.Tensor) -> None:
    """Make ``param.grad`` the bucket view ``view`` (a copy only when the optimizer's
    ``zero_grad(set_to_none=True)`` or accumulation replaced it; zeros if it has none)."""
    grad = param.grad
    if grad is None:
        view.zero_()
    elif grad.data_ptr() != view.data_ptr():
        view.copy_(grad)
    param.grad = view


class SyncSwitch:
    """The ``no_sync`` of every data-axis synchronizer (a
    :class:`~paraxis.parallel.strategy.GradientSync`): inside it ``sync`` is false, and
    backward accumulates locally (non-final microbatches). A synchronizer that holds
    others (ZeRO's reducer of the parameters it keeps whole) lists them in
    ``followers``, which switch with it."""

    sync: bool = True
    followers: tuple[SyncSwitch, ...] = ()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        switches = (self, *self.followers)
        previous = [s.sync for s in switches]
        for s in switches:
            s.sync = False
        try:
            yield
        finally:
            for s, was in zip(switches, previous, strict=True):
                s.sync = was


class BucketLoop(SyncSwitch, Generic[B]):
    """Buckets of gradients reduced in a fixed order, overlapped with backward: a
    post-accumulate-grad hook hands each final gradient to its bucket (:meth:`take`), and
    every full bucket at the head of the order is launched (:meth:`launch`, one
    asynchronous collective), so ranks never disagree on which collective comes next
    even when their hooks fire in other orders (PyTorch DDP's scheme, arXiv:2006.15704).
    :meth:`finish` launches what backward did not reach (parameters unused this step
    reduce as zeros, or as what ``no_sync`` accumulated), waits for every bucket, and
    lets a subclass hand out the results (:meth:`received`). A bucket has ``params``,
    ``ready`` (the indices taken this step) and ``work`` (the collective in flight)."""

    def __init__(self, buckets: list[B]):
        self.buckets = buckets
        self._where = {p: (b, i) for b in buckets for i, p in enumerate(b.params)}
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad)
                       for p in self._where]
        self._next = 0  # index of the next bucket to launch

    def take(self, bucket: B, index: int) -> None:
        """Parameter ``index`` of ``bucket`` has its final gradient for this step."""
        raise NotImplementedError

    def launch(self, bucket: B) -> None:
        """Start ``bucket``'s collective (asynchronous), leaving it in ``bucket.work``."""
        raise NotImplementedError

    def received(self, bucket: B) -> None:
        """``bucket``'s collective completed (default: nothing to hand out)."""

    def _on_grad(self, param: nn.Parameter) -> None:
        if not self.sync:
            return
        bucket, i = self._where[param]
        self.take(bucket, i)
        bucket.ready.add(i)
        while self._next < len(self.buckets) and \
                len(self.buckets[self._next].ready) == len(self.buckets[self._next].params):
            self.launch(self.buckets[self._next])
            self._next += 1

    def finish(self) -> float:
        """Complete every bucket of this step (and the followers'); seconds blocked."""
        for bucket in self.buckets[self._next:]:
            for i in range(len(bucket.params)):
                if i not in bucket.ready:
                    self.take(bucket, i)
                    bucket.ready.add(i)
            self.launch(bucket)
        start = time.perf_counter()
        for bucket in self.buckets:
            bucket.work.wait()
            bucket.work = None
            bucket.ready.clear()
            self.received(bucket)
        self._next = 0
        blocked = time.perf_counter() - start
        return blocked + sum(f.finish() for f in self.followers if isinstance(f, BucketLoop))

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        for f in self.followers:
            if isinstance(f, BucketLoop):
                f.remove_hooks()


class FlatAllReduce(BucketLoop[FlatBucket]):
    """Average ``params``' gradients over their sync groups: flat buckets whose views
    are the gradients (no copy for a gradient accumulated in place), each pre-divided
    by the ranks holding distinct tokens (:attr:`~paraxis.runtime.grid.Grid.token_replicas`:
    the engine scales every rank's loss by it) and all-reduced in ``wire_dtype`` (None:
    the buffer's). paraxis-dp-core's data parallelism, and the parameters ZeRO keeps
    whole."""

    def __init__(self, params: Iterable[nn.Parameter], grid: Grid, bucket_bytes: int, *,
                 wire_dtype: torch.dtype | None = None):
        self.grid, self.wire_dtype = grid, wire_dtype
        divisor = grid.token_replicas
        params = [p for p in params if p.requires_grad]
        super().__init__([FlatBucket.allocate(g, ps, divisor) for g, ps in assign_buckets(
            params, grid, bucket_bytes, include_single=divisor > 1)])

    def take(self, bucket: FlatBucket, index: int) -> None:
        adopt_grad(bucket.params[index], bucket.views[index])

    def launch(self, bucket: FlatBucket) -> None:
        # Pre-divided, as DDP does (for dense parameters the sum becomes the mean); fp32
        # keeps it exact enough. A group of one only rescales (expert=E alone).
        bucket.buffer.div_(bucket.divisor)
        bucket.work = all_reduce_(bucket.buffer, bucket.group, async_op=True,
                                  wire_dtype=self.wire_dtype)
